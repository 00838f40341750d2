"""``fastbert serve`` on sentence-transformers' retrieval folders, in process (httpx on the ASGI app): ``/embed_sparse``
on a SparseEncoder (SPLADE) folder and ``/embed_all`` on a MultiVectorEncoder (ColBERT-style) folder give their
``encode`` / ``encode_query`` / ``encode_document`` outputs -- sparse: the same non-zero entries, values within 1e-4;
multi-vector: the same tokens, cosine >= 0.99999 per vector -- from packed batches of mixed lengths and tasks (a
token budget of a few sequences a batch), with left and right padding tokenizers, truncation, prompts, top-k, query
expansion, the skip-list and truncate_dim. The routes a model does not serve, and bad fields, answer 400 naming
what is wrong. Tiny random models (tests/retrieval_models.py), no network."""

import asyncio
import json

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
st = pytest.importorskip("sentence_transformers")

from fastbert.serve import create_app, load  # noqa: E402
from retrieval_models import (  # noqa: E402
    TEXTS,
    assert_same_sparse,
    assert_same_vectors,
    inference_free_folder,
    multi_vector_folder,
    splade_folder,
)

ENCODE = {None: "encode", "query": "encode_query", "document": "encode_document"}
BUDGET = 40  # tokens a batch: a request's texts run over several batches, beside other requests' (TEXTS: 3-24 tokens)


def ask(app, *requests: tuple[str, dict]) -> list:
    """POST the requests to ``app`` at once (their sequences share batches); their responses, in order."""
    async def post_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=300) as client:
            return await asyncio.gather(*(client.post(path, json=body) for path, body in requests))

    try:
        return asyncio.run(post_all())
    finally:
        app.state.batcher.close()


def sparse_rows(response, vocab: int = 30522) -> torch.Tensor:
    """/embed_sparse's answer -> [texts, vocab], after checking each entry's form (ascending, non-zero)."""
    assert response.status_code == 200, response.text
    rows = response.json()
    out = torch.zeros(len(rows), vocab)
    for row, entries in zip(out, rows):
        indices = [entry["index"] for entry in entries]
        assert indices == sorted(set(indices)) and all(entry["value"] != 0 for entry in entries)
        assert all(set(entry) == {"index", "value"} for entry in entries)
        row[indices] = torch.tensor([entry["value"] for entry in entries])
    return out


def token_vectors(response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    return [np.array(vectors, dtype=np.float32) for vectors in response.json()]


@pytest.mark.parametrize("family, padding_side", [("bert", "right"), ("bert", "left"), ("roberta", "right"),
                                                  ("distilbert", "right")])
def test_sparse_equals_sparse_encoder(tmp_path, family, padding_side):
    """Each text's entries as SparseEncoder.encode gives them for it alone (a left-padding tokenizer shifts BERT's
    positions in sentence-transformers' batches: compared one text at a time there); one string gives one row; the
    longest text is cut at max_seq_length."""
    folder = splade_folder(tmp_path, family=family, activation="log1p_relu", padding_side=padding_side)
    model = st.SparseEncoder(folder, device="cpu")
    expected = model.encode(TEXTS, batch_size=3 if padding_side == "right" else 1).to_dense()
    many, one = ask(create_app(load(folder, dtype="float32"), max_batch_tokens=BUDGET),
                    ("/embed_sparse", {"inputs": TEXTS}), ("/embed_sparse", {"inputs": TEXTS[3]}))
    assert_same_sparse(sparse_rows(many), expected)
    assert_same_sparse(sparse_rows(one), expected[3:4])


def test_sparse_top_k_and_prompts(tmp_path):
    """top_k as encode's max_active_dims (default: the folder's); a task's prompt, as encode_query prepends it."""
    folder = splade_folder(tmp_path, pooling="sum")
    config_path = tmp_path / "splade" / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "prompts": {"query": "search: "}, "max_active_dims": 9}))
    model = st.SparseEncoder(folder, device="cpu")
    given, default, query = ask(create_app(load(folder, dtype="float32"), max_batch_tokens=BUDGET),
                                ("/embed_sparse", {"inputs": TEXTS, "top_k": 5}),
                                ("/embed_sparse", {"inputs": TEXTS}),
                                ("/embed_sparse", {"inputs": TEXTS, "task": "query", "top_k": 3000}))
    assert_same_sparse(sparse_rows(given), model.encode(TEXTS, max_active_dims=5))
    assert_same_sparse(sparse_rows(default), model.encode(TEXTS))
    assert_same_sparse(sparse_rows(query), model.encode_query(TEXTS, max_active_dims=3000))
    assert max(len(row) for row in default.json()) == 9


def test_inference_free_splade_serves_both_routes(tmp_path):
    """Documents (and no task: the default route) run SPLADE; queries, routed to the static lookup, get
    encode_query's entries (no special tokens, cut at the tokenizer's length; top-k too); a query cut there is
    refused with truncate false."""
    folder = inference_free_folder(tmp_path)
    model = st.SparseEncoder(folder, device="cpu")
    long_query = " ".join(["word"] * 600)
    document, default, query, top, long, refused = ask(
        create_app(load(folder, dtype="float32"), max_batch_tokens=BUDGET),
        ("/embed_sparse", {"inputs": TEXTS, "task": "document"}), ("/embed_sparse", {"inputs": TEXTS}),
        ("/embed_sparse", {"inputs": TEXTS, "task": "query"}),
        ("/embed_sparse", {"inputs": TEXTS, "task": "query", "top_k": 2}),
        ("/embed_sparse", {"inputs": [long_query + " tail"], "task": "query"}),
        ("/embed_sparse", {"inputs": ["x", long_query], "task": "query", "truncate": False}))
    assert_same_sparse(sparse_rows(document), model.encode_document(TEXTS))
    assert_same_sparse(sparse_rows(default), model.encode(TEXTS))
    assert_same_sparse(sparse_rows(query), model.encode_query(TEXTS))
    assert_same_sparse(sparse_rows(top), model.encode_query(TEXTS, max_active_dims=2))
    assert_same_sparse(sparse_rows(long), model.encode_query([long_query + " tail"]))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "inputs"
    assert "inputs[1]" in refused.json()["error"]["message"]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_multi_vector_equals_multi_vector_encoder(tmp_path, padding_side):
    """Requests of every task at once, sharing batches: each text's vectors as encode / encode_query /
    encode_document give them (prompts per task, the document skip-list, truncation at max_seq_length)."""
    folder = multi_vector_folder(tmp_path, padding_side, dense_activation=torch.nn.Tanh(), bias=True,
                                 prompts={"query": "query: ", "document": "passage: "})
    model = st.MultiVectorEncoder(folder, device="cpu")
    responses = ask(create_app(load(folder, dtype="float32"), max_batch_tokens=BUDGET),
                    *(("/embed_all", {"inputs": TEXTS, "task": task}) for task in ENCODE),
                    ("/embed_all", {"inputs": TEXTS[2]}))
    for task, response in zip(ENCODE, responses):
        expected = getattr(model, ENCODE[task])(TEXTS, batch_size=3 if padding_side == "right" else 1)
        assert_same_vectors(token_vectors(response), expected)
    assert_same_vectors(token_vectors(responses[-1]), model.encode(TEXTS[2:3]))


@pytest.mark.parametrize("expansion, padding_side", [
    ({"strategy": "fixed", "length": 16}, "right"),
    ({"strategy": "fixed", "length": 16}, "left"),
    ({"strategy": "fixed", "length": 16, "attend": True}, "left"),
    ({"strategy": "min", "length": 12}, "right"),
], ids=["fixed", "fixed-left", "fixed-attend-left", "min"])
def test_multi_vector_query_expansion(tmp_path, expansion, padding_side):
    """ColBERT's query expansion: queries padded with [MASK] to the expansion width (a fixed width on the tokenizer's
    padding side), scored there; attended to or not. Documents beside them in the same batches are not expanded."""
    folder = multi_vector_folder(tmp_path, padding_side, query_expansion=expansion)
    model = st.MultiVectorEncoder(folder, device="cpu")
    queries, documents = ask(create_app(load(folder, dtype="float32"), max_batch_tokens=BUDGET),
                             ("/embed_all", {"inputs": TEXTS, "task": "query"}),
                             ("/embed_all", {"inputs": TEXTS, "task": "document"}))
    batch_size = 3 if padding_side == "right" else 1  # (left padding shifts positions in a batch of documents)
    assert_same_vectors(token_vectors(queries), model.encode_query(TEXTS, batch_size=batch_size))
    assert_same_vectors(token_vectors(documents), model.encode_document(TEXTS, batch_size=batch_size))


def test_multi_vector_truncate_dim(tmp_path):
    """The folder's truncate_dim: the first dimensions, normalized again (sentence-transformers' multi-vector
    truncation)."""
    folder = multi_vector_folder(tmp_path)
    config_path = tmp_path / "multi" / "config_sentence_transformers.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "truncate_dim": 8}))
    model = st.MultiVectorEncoder(folder, device="cpu")
    (response,) = ask(create_app(load(folder, dtype="float32"), max_batch_tokens=BUDGET), ("/embed_all", {"inputs": TEXTS}))
    vectors = token_vectors(response)
    assert vectors[0].shape[1] == 8
    assert_same_vectors(vectors, model.encode(TEXTS))


@pytest.fixture(scope="module")
def sparse_engine(tmp_path_factory):
    return load(splade_folder(tmp_path_factory.mktemp("splade")), name="splade", dtype="float32")


@pytest.fixture(scope="module")
def multi_vector_engine(tmp_path_factory):
    return load(multi_vector_folder(tmp_path_factory.mktemp("multi")), name="colbert", dtype="float32")


REFUSED = [  # (engine, path, body, the field named (None: the route itself), a fragment of the message)
    ("sparse", "/v1/embeddings", {"input": "a"}, None,
     "/v1/embeddings needs a sentence-embedding model; this server's model serves /embed_sparse"),
    ("sparse", "/embed_all", {"inputs": "a"}, None, "/embed_all needs a multi-vector (MultiVectorEncoder) model"),
    ("sparse", "/v1/rerank", {"query": "a", "documents": ["b"]}, None, "serves /embed_sparse"),
    ("multi", "/embed_sparse", {"inputs": "a"}, None,
     "/embed_sparse needs a SPLADE (SparseEncoder) model; this server's model serves /embed_all"),
    ("multi", "/v1/classify", {"input": "a"}, None, "serves /embed_all"),
    ("sparse", "/embed_sparse", {}, "inputs", "inputs must be a non-empty string"),
    ("sparse", "/embed_sparse", {"input": "a"}, "inputs", "inputs must be a non-empty string"),
    ("sparse", "/embed_sparse", {"inputs": ["a", ""]}, "inputs", "inputs[1] is an empty string"),
    ("sparse", "/embed_sparse", {"inputs": [[101, 102]]}, "inputs", "inputs must be strings"),
    ("sparse", "/embed_sparse", {"inputs": ["a"] * 2049}, "inputs", "more than 2048"),
    ("sparse", "/embed_sparse", {"inputs": "a", "top_k": 0}, "top_k", "top_k must be a positive integer"),
    ("sparse", "/embed_sparse", {"inputs": "a", "task": "passage"}, "task", "task must be \"query\", \"document\""),
    ("sparse", "/embed_sparse", {"inputs": ["a", "a " * 40], "truncate": False}, "inputs",
     "inputs[1] has more than the model's 24 tokens"),
    ("sparse", "/embed_sparse", {"inputs": "a", "model": "other"}, "model", "is not served here"),
    ("multi", "/embed_all", {"inputs": "a", "truncate": "no"}, "truncate", "truncate must be true or false"),
    ("multi", "/embed_all", {"inputs": "a", "priority": "now"}, "priority", "priority must be one of"),
    ("multi", "/embed_all", {"inputs": "a", "task": 1}, "task", "task must be"),
]


@pytest.mark.parametrize("kind, path, body, param, fragment", REFUSED,
                         ids=[f"{kind}-{path}-{param}" for kind, path, _, param, _ in REFUSED])
def test_what_a_model_does_not_serve_and_bad_fields_answer_400(sparse_engine, multi_vector_engine, kind, path, body,
                                                               param, fragment):
    engine = sparse_engine if kind == "sparse" else multi_vector_engine
    (response,) = ask(create_app(engine), (path, body))
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error


def test_models_describes_the_retrieval_task(sparse_engine, multi_vector_engine):
    async def models(engine):
        app = create_app(engine)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
                return (await client.get("/v1/models")).json()["data"][0]
        finally:
            app.state.batcher.close()

    sparse, multi = asyncio.run(models(sparse_engine)), asyncio.run(models(multi_vector_engine))
    assert sparse["id"] == "splade" and sparse["task"] == "sparse" and sparse["vocab_size"] == 30522
    assert multi["id"] == "colbert" and multi["task"] == "multi_vector" and multi["dim"] == 20
    assert multi["max_lengths"] == {"encode": 24, "query": 24, "document": 24}


def test_a_retrieval_folder_takes_no_task_or_calibration(tmp_path):
    folder = splade_folder(tmp_path)
    with pytest.raises(ValueError, match="task='embeddings': .* is a sparse model"):
        load(folder, task="embeddings")
    with pytest.raises(ValueError, match="calibration: .* is a sparse model"):
        load(folder, calibration="sentences.txt")
