"""The routes: OpenAI's embeddings, rerank and classify as Cohere, TEI, Infinity and vLLM shape them, TEI's sparse
and token embeddings, models, health and Prometheus metrics. Each handler is a plain function of the request; what
it serves with (the engine, the batcher, the tokenizing threads, the metrics, the key) is the app's state
(``app.py``). A model serves the routes of its task (``engine.task``); the others answer 400 saying which it serves.

    POST /v1/embeddings   {"input": str | [str] | [int] | [[int]], "model"?, "encoding_format"?: "float"|"base64"|
                           "int8"|"uint8"|"binary"|"ubinary" (formats.py), "dimensions"?: int, "truncate"?: bool,
                           "task"?: "query"|"document", "priority"?: "interactive"|"bulk"}       (embeddings)
    POST /v1/rerank       {"query": str, "documents": [str | {"text": str}], "top_n"?: int,
                           "return_documents"?: bool, "model"?, "truncate"?, "priority"?}      (also /rerank; scores)
    POST /v1/classify     {"input": str | [str], "model"?, "truncate"?, "priority"?}     (also /classify; scores)
    POST /embed_sparse    {"inputs": str | [str], "top_k"?: int, "task"?: "query"|"document", "model"?, "truncate"?,
                           "priority"?} -> [[{"index": int, "value": float}, ...], ...]               (sparse)
    POST /embed_all       {"inputs": str | [str], "task"?, "model"?, "truncate"?, "priority"?}
                           -> [[[float] * dim] * scored tokens, ...]                            (multi_vector)
    GET  /v1/models, /health, /metrics

``endpoint`` wraps each handler: the one authorization check (every route but /health, when a key is set), the
error body of a 4xx (``protocol.ApiError``) or of a failed forward (500), and the request's metrics. Work is bounded
before it is done: the body's size while it is read, the fields, the number of inputs, then texts tokenized in the
tokenizing threads ``TEXTS_PER_TASK`` at a time (each cut to a bounded prefix: ``tokens.py``), so that a large
request takes turns with small ones; rerank tokenizes its query once and refuses a request whose pairs must pass
``MAX_REQUEST_TOKENS`` before it tokenizes any document.
"""

import asyncio
import hmac
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import formats, memory
from .batcher import QueueFull
from .engine import InputError
from .protocol import (ApiError, check_model, documents_of, error_response, inputs_of, json_response,
                       json_rows_response, positive_int, priority_of, read_body, task_of, truncate_of)
from .retrieval import largest

MAX_REQUEST_TOKENS = 300_000  # per request, as OpenAI's
TEXTS_PER_TASK = 64  # texts tokenized in one go (at most ~64 x 8K characters): then other requests' turn
# engine.task -> (the model a route of the task needs, the routes that serve it)
TASKS = {"embeddings": ("a sentence-embedding", "/v1/embeddings"),
         "scores": ("a cross-encoder or sequence-classification", "/v1/rerank and /v1/classify"),
         "sparse": ("a SPLADE (SparseEncoder)", "/embed_sparse"),
         "multi_vector": ("a multi-vector (MultiVectorEncoder)", "/embed_all")}


async def embeddings(request: Request) -> Response:
    state = request.app.state
    engine = state.engine
    body = await _model_request(request, "embeddings", "/v1/embeddings")
    texts, ids = inputs_of(body.get("input"), allow_ids=True)
    encoding = body.get("encoding_format") or "float"
    if encoding not in formats.FORMATS:
        raise ApiError(400, f"encoding_format must be one of {', '.join(formats.FORMATS)}, got {encoding!r}",
                       param="encoding_format")
    dimensions = positive_int(body, "dimensions", None, most=engine.dim)
    truncate, task, priority = truncate_of(body), task_of(body), priority_of(body, request)
    if texts is not None:
        items = await _tokenized(state, lambda chunk, first: engine.tokenize(chunk, truncate, first, task=task),
                                 texts)
    elif task is not None:
        raise ApiError(400, "task applies to texts (its prompt is text); token-id inputs are run as they are",
                       param="task")
    else:
        items = await _in_pool(state, engine.token_ids, ids, truncate)
    vectors = formats.truncated(np.stack(await _run(request, items, priority)), dimensions)
    data = [{"object": "embedding", "index": i, "embedding": embedding}
            for i, embedding in enumerate(formats.encoded(vectors, encoding, engine.calibration))]
    return json_response({"object": "list", "data": data, "model": engine.name, "usage": _usage(items)})


async def embed_sparse(request: Request) -> Response:
    """TEI's ``/embed_sparse``: each text's non-zero vocabulary entries, ascending, as {"index", "value"}."""
    engine = request.app.state.engine
    body = await _model_request(request, "sparse", "/embed_sparse")
    top_k = positive_int(body, "top_k", engine.splade.top_k)
    rows = await _retrieval(request, body)
    return json_rows_response(rows, lambda row: [{"index": int(i), "value": float(v)}
                                                 for i, v in zip(*largest(*row, top_k))])


async def embed_all(request: Request) -> Response:
    """TEI's ``/embed_all`` shape: each text's token vectors, its scored tokens only (no padding rows)."""
    body = await _model_request(request, "multi_vector", "/embed_all")
    return json_rows_response(await _retrieval(request, body), lambda vectors: vectors)


async def rerank(request: Request) -> Response:
    state = request.app.state
    engine = state.engine
    body = await _model_request(request, "scores", "rerank")
    query = body.get("query")
    if not isinstance(query, str) or not query or query.isspace():
        raise ApiError(400, "query must be a non-empty string", param="query")
    documents = documents_of(body)
    top_n = positive_int(body, "top_n", len(documents))
    truncate = truncate_of(body)
    priority = priority_of(body, request)
    if len(engine.labels) != 1:
        raise ApiError(400, f"rerank needs a model with one relevance logit; this one has {len(engine.labels)} "
                       "labels (use /v1/classify)")
    tokenized_query = await _in_pool(state, engine.query, query)
    fewest = len(documents) * engine.shortest_pair(tokenized_query)
    if fewest > MAX_REQUEST_TOKENS:
        raise ApiError(400, f"the request has at least {fewest} tokens (each of its {len(documents)} documents with "
                       f"the query), more than {MAX_REQUEST_TOKENS}; split it or shorten the query")
    items = await _tokenized(state, lambda chunk, first: engine.pairs(tokenized_query, chunk, truncate, first),
                             documents)
    logits = np.stack(await _run(request, items, priority))
    scores = logits[:, 0] if engine.activation == "identity" else 1 / (1 + np.exp(-logits[:, 0]))
    order = np.argsort(-scores, kind="stable")[:top_n]
    results = [{"index": int(i), "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if body.get("return_documents") else {})} for i in order]
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": engine.name, "results": results,
                          "usage": _usage(items)})


async def classify(request: Request) -> Response:
    state = request.app.state
    engine = state.engine
    body = await _model_request(request, "scores", "classify")
    texts, _ = inputs_of(body.get("input"), allow_ids=False)
    truncate, priority = truncate_of(body), priority_of(body, request)
    items = await _tokenized(state, lambda chunk, first: engine.tokenize(chunk, truncate, first), texts)
    logits = np.stack(await _run(request, items, priority))
    if logits.shape[1] == 1:
        positive = 1 / (1 + np.exp(-logits[:, 0]))
        probs = np.stack([1 - positive, positive], axis=1)
    else:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = shifted / shifted.sum(axis=1, keepdims=True)
    labels = engine.labels if len(engine.labels) == probs.shape[1] else [str(i) for i in range(probs.shape[1])]
    data = [{"index": i, "label": labels[int(row.argmax())], "probs": row.tolist(), "num_classes": len(row)}
            for i, row in enumerate(probs)]
    return json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                          "model": engine.name, "data": data, "usage": _usage(items)})


async def models(request: Request) -> Response:
    state = request.app.state
    return json_response({"object": "list", "data": [{"id": state.engine.name, "object": "model",
                                                      "created": state.created, "owned_by": "fastbert",
                                                      **state.engine.describe()}]})


async def health(request: Request) -> Response:
    return json_response({"status": "ok", "queued_requests": request.app.state.batcher.queued()})


async def metrics(request: Request) -> Response:
    collected = request.app.state.metrics
    return Response(collected.render(), media_type=collected.content_type)


# --- what every handler shares ----------------------------------------------------------------------------------------


async def _model_request(request: Request, task: str, route: str) -> dict:
    """The body of a request for the model, checked: it is for this server's model and task."""
    state = request.app.state
    body = await read_body(request, state.max_body_bytes)
    check_model(body, state.engine.name)
    if state.engine.task != task:
        needed, served = TASKS[task][0], TASKS[state.engine.task][1]
        raise ApiError(400, f"{route} needs {needed} model; this server's model serves {served}")
    return body


async def _retrieval(request: Request, body: dict) -> list:
    """The rows of a sparse or multi-vector request (TEI's ``inputs``, ``task``, ``truncate``, ``priority``)."""
    state = request.app.state
    engine = state.engine
    texts, _ = inputs_of(body.get("inputs"), allow_ids=False, field="inputs")
    task, truncate, priority = task_of(body), truncate_of(body), priority_of(body, request)
    if task in engine.refused:
        raise ApiError(400, engine.refused[task], param="task")
    if task in engine.lookups:  # (inference-free SPLADE's queries: a lookup, no forward, in the tokenizing threads)
        lookup = engine.lookups[task]
        items = await _tokenized(state, lambda chunk, first: lookup.tokenize(chunk, truncate, first, "inputs", task),
                                 texts)
        return await _in_pool(state, lookup.run, items)
    items = await _tokenized(state, lambda chunk, first: engine.tokenize(chunk, truncate, first, "inputs", task),
                             texts)
    return await _run(request, items, priority)


async def _in_pool(state, function, *args):
    """``function(*args)`` in the tokenizing threads; its InputError is the request's 400."""
    try:
        return await asyncio.get_running_loop().run_in_executor(state.tokenizing, function, *args)
    except InputError as error:
        raise ApiError(400, str(error), param=error.param) from None


async def _tokenized(state, tokenize, texts: list[str]) -> list:
    """``tokenize(chunk, first)`` of ``TEXTS_PER_TASK`` texts at a time (``first``: the chunk's first index), each a
    task of its own in the tokenizing threads; stops once the request passes ``MAX_REQUEST_TOKENS``."""
    items, tokens = [], 0
    for first in range(0, len(texts), TEXTS_PER_TASK):
        chunk = await _in_pool(state, tokenize, texts[first: first + TEXTS_PER_TASK], first)
        items += chunk
        tokens += sum(len(item.ids) for item in chunk)
        if tokens > MAX_REQUEST_TOKENS:
            raise ApiError(400, f"the request has more than {MAX_REQUEST_TOKENS} tokens; split it")
    return items


async def _run(request: Request, items, priority: str) -> list:
    """The rows of ``items`` (``engine.run``'s, in order), unless the client goes away first (then the work is
    dropped)."""
    if sum(len(item.ids) for item in items) > MAX_REQUEST_TOKENS:
        raise ApiError(400, f"the request has more than {MAX_REQUEST_TOKENS} tokens; split it")
    submitted = asyncio.ensure_future(request.app.state.batcher.submit(items, priority, request.state.arrived))
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({submitted, gone}, return_when=asyncio.FIRST_COMPLETED)
    if submitted not in done:
        submitted.cancel()
        raise ApiError(499, "the client closed the request")
    gone.cancel()
    try:
        rows, request.state.finished = submitted.result()
    except QueueFull as error:
        raise ApiError(429, str(error), kind="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(error.retry_after)}) from None
    return rows


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(items) -> dict:
    tokens = sum(len(item.ids) for item in items)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _authorized(request: Request, key: bytes) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    given = request.headers.get("authorization", "").encode()
    return hmac.compare_digest(given, b"Bearer " + key)


def endpoint(route: str, handler, public: bool = False):
    """``handler`` as a route's endpoint: authorized (unless ``public``), its errors answered in OpenAI's shape, its
    status and times in the metrics under ``route``."""

    async def answer(request: Request) -> Response:
        state = request.app.state
        request.state.arrived, request.state.finished, request.state.body_bytes = time.perf_counter(), None, 0
        try:
            if not public and state.api_key is not None and not _authorized(request, state.api_key):
                raise ApiError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key")
            response = await handler(request)
        except ApiError as error:
            response = error_response(error)
        except Exception as error:  # noqa: BLE001 - a failed forward: this request's 500, the server goes on
            response = error_response(ApiError(500, f"the server failed on this request: {type(error).__name__}: "
                                                    f"{error}", kind="server_error"))
        if request.state.body_bytes >= memory.LARGE_BODY:  # (its body and text are freed by now)
            await asyncio.get_running_loop().run_in_executor(None, memory.give_back)
        now = time.perf_counter()
        state.metrics.request(route, response.status_code, now - request.state.arrived)
        if request.state.finished is not None:
            state.metrics.answered(route, now - request.state.finished)
        return response

    return answer


async def not_found(request: Request, exc) -> Response:
    return error_response(ApiError(404, f"no route {request.url.path}"))


async def not_allowed(request: Request, exc) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))


ROUTES = [Route("/v1/embeddings", endpoint("embeddings", embeddings), methods=["POST"]),
          Route("/v1/rerank", endpoint("rerank", rerank), methods=["POST"]),
          Route("/rerank", endpoint("rerank", rerank), methods=["POST"]),
          Route("/v1/classify", endpoint("classify", classify), methods=["POST"]),
          Route("/classify", endpoint("classify", classify), methods=["POST"]),
          Route("/embed_sparse", endpoint("embed_sparse", embed_sparse), methods=["POST"]),
          Route("/embed_all", endpoint("embed_all", embed_all), methods=["POST"]),
          Route("/v1/models", endpoint("models", models), methods=["GET"]),
          Route("/health", endpoint("health", health, public=True), methods=["GET"]),
          Route("/metrics", endpoint("metrics", metrics), methods=["GET"])]
EXCEPTION_HANDLERS = {404: not_found, 405: not_allowed}
