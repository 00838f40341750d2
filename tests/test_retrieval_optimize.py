"""fastbert.optimize on sentence-transformers' SparseEncoder (SPLADE, inference-free SPLADE) and MultiVectorEncoder:
the same outputs as their encode (sparse: the same non-zero entries, values within 1e-4; multi-vector: the same
token counts, cosine >= 0.99999 per vector), heads fused and padding-free, with left and right padding, truncation
(texts past max_seq_length) and batches of mixed lengths; what is not fused runs sentence-transformers' own code, said
once; the SPLADE forward's largest live tensors a quarter of sentence-transformers' at most. Tiny random models,
saved and loaded back (tests/retrieval_models.py)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

import fastbert
from retrieval_models import (
    TEXTS,
    assert_same_sparse,
    assert_same_vectors,
    inference_free_folder,
    multi_vector_folder,
    splade_folder,
)

st = pytest.importorskip("sentence_transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fastbench.live_bytes import LiveBytes  # noqa: E402


def optimized(model):
    """A copy of ``model`` with fastbert.optimize applied (the original stays sentence-transformers' own)."""
    ours = fastbert.optimize(copy.deepcopy(model))
    assert type(ours).__module__ == "fastbert.st_retrieval" and type(ours).__name__ == type(model).__name__
    return ours


def no_fallback(encode):
    """``encode()``'s result, asserting that nothing fell back to sentence-transformers' or transformers' code."""
    before = fastbert.announce.seen()
    out = encode()
    assert fastbert.announce.seen().keys() == before.keys(), set(fastbert.announce.seen()) - set(before)
    return out


# --- SPLADE --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("activation, pooling", [("relu", "max"), ("log1p_relu", "max"), ("relu", "sum")])
def test_splade_matches_sentence_transformers(tmp_path, activation, pooling, padding_side):
    model = st.SparseEncoder(splade_folder(tmp_path, "bert", activation, pooling, padding_side), device="cpu")
    expected = model.encode(TEXTS, batch_size=3)
    ours = optimized(model)
    assert_same_sparse(no_fallback(lambda: ours.encode(TEXTS, batch_size=3)), expected)
    assert model[1].embedding_dimension == ours[1].embedding_dimension == 30522


@pytest.mark.parametrize("family", ["roberta", "distilbert"])
def test_splade_other_families(tmp_path, family):
    model = st.SparseEncoder(splade_folder(tmp_path, family), device="cpu")
    expected = model.encode(TEXTS, batch_size=4)
    assert_same_sparse(no_fallback(lambda: optimized(model).encode(TEXTS, batch_size=4)), expected)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_inference_free_splade(tmp_path, padding_side):
    """Documents through the fused pair on the Router's document route; queries through SparseStaticEmbedding."""
    model = st.SparseEncoder(inference_free_folder(tmp_path, padding_side), device="cpu")
    documents, queries = model.encode_document(TEXTS, batch_size=3), model.encode_query(TEXTS, batch_size=3)
    ours = optimized(model)
    assert_same_sparse(no_fallback(lambda: ours.encode_document(TEXTS, batch_size=3)), documents)
    assert_same_sparse(no_fallback(lambda: ours.encode_query(TEXTS, batch_size=3)), queries)


def test_splade_options_it_does_not_fuse_run_sentence_transformers(tmp_path):
    """A hook on a module the fused path would bypass: sentence-transformers' forward runs (said once), and gives
    sentence-transformers' result; with gradients too."""
    model = st.SparseEncoder(splade_folder(tmp_path), device="cpu")
    expected = model.encode(TEXTS[:4])
    ours = optimized(model)
    hook = ours[1].register_forward_hook(lambda module, args, out: None)
    with pytest.warns(RuntimeWarning, match="SparseEncoder: sentence-transformers' own forward runs .*hooks"):
        assert_same_sparse(ours.encode(TEXTS[:4]), expected)
    hook.remove()
    features = ours.preprocess(TEXTS[:2])
    ours.train()
    with pytest.warns(RuntimeWarning, match="own forward runs .*gradients are required or the model trains"):
        out = ours(features)["sentence_embedding"]
    assert out.requires_grad and "token_embeddings" in ours(features)


def test_splade_peak_memory_is_a_quarter_of_sentence_transformers(tmp_path):
    """One forward on 8 texts (vocabulary 30,522): sentence-transformers holds [8, S, vocab] logits and their masked
    copy; the fused head a bounded block and [8, vocab]. Counted from the tensors' sizes (benchmarks/fastbench/
    live_bytes.py), not the process's memory, so it holds on a busy machine."""
    model = st.SparseEncoder(splade_folder(tmp_path), device="cpu")
    features = model.preprocess(TEXTS)
    peaks = []
    for m in (model.eval(), optimized(model).eval()):  # (as encode runs them)
        with torch.inference_mode(), LiveBytes() as live:
            out = m(dict(features))["sentence_embedding"]
        peaks.append(live.peak)
        del out
    logits = features["input_ids"].numel() * 30522 * 4
    assert peaks[0] >= 2 * logits
    assert peaks[1] <= peaks[0] / 4, peaks


# --- multi-vector ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("dense", ["identity", "tanh+bias"])
def test_multi_vector_matches_sentence_transformers(tmp_path, padding_side, dense):
    activation, bias = (torch.nn.Tanh(), True) if dense == "tanh+bias" else (None, False)
    model = st.MultiVectorEncoder(multi_vector_folder(tmp_path, padding_side, dense_activation=activation, bias=bias),
                                  device="cpu")
    documents, queries = model.encode_document(TEXTS, batch_size=3), model.encode_query(TEXTS, batch_size=3)
    ours = optimized(model)
    out = no_fallback(lambda: ours.encode_document(TEXTS, batch_size=3))
    assert_same_vectors(out, documents)
    assert len(out[1]) < 9  # "The cat sat on the mat.": [CLS] 6 words [SEP], the period skipped in documents
    assert_same_vectors(no_fallback(lambda: ours.encode_query(TEXTS, batch_size=3)), queries)
    assert_same_vectors(ours.encode_document(TEXTS, truncate_dim=8), model.encode_document(TEXTS, truncate_dim=8))


@pytest.mark.parametrize("expansion", [
    {"strategy": "fixed", "length": 16},
    {"strategy": "fixed", "length": 16, "attend": True},
    {"strategy": "min", "length": 12},
], ids=["fixed", "fixed-attend", "min"])
def test_multi_vector_query_expansion(tmp_path, expansion):
    """ColBERT's query expansion: [MASK] positions scored although (attend=False) nothing attends to them, computed
    as transformers computes them; queries past the expansion length truncated ("fixed") or kept ("min")."""
    model = st.MultiVectorEncoder(multi_vector_folder(tmp_path, query_expansion=expansion), device="cpu")
    expected = model.encode_query(TEXTS, batch_size=3)
    out = no_fallback(lambda: optimized(model).encode_query(TEXTS, batch_size=3))
    assert_same_vectors(out, expected)
    assert min(len(q) for q in out) >= expansion["length"]
