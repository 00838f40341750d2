"""The HTTP API: OpenAI's embeddings schema, rerank and classify as Cohere, TEI, Infinity and vLLM shape them, models,
health and Prometheus metrics, on Starlette.

    POST /v1/embeddings   {"input": str | [str] | [int] | [[int]], "model"?, "encoding_format"?: "float"|"base64",
                           "dimensions"?: int, "truncate"?: bool}
    POST /v1/rerank       {"query": str, "documents": [str | {"text": str}], "top_n"?: int,
                           "return_documents"?: bool, "model"?, "truncate"?: bool}      (also /rerank)
    POST /v1/classify     {"input": str | [str], "model"?, "truncate"?: bool}        (also /classify)
    GET  /v1/models, /health, /metrics

Every request is checked before anything runs; what does not fit gets a 4xx with OpenAI's error body
(``{"error": {"message", "type", "param", "code"}}``): a malformed body 400, a wrong API key 401, another model's name
404, a body over ``max_body_bytes`` 413, too many inputs or tokens 400, a full queue 429 with Retry-After. Texts are
tokenized off the event loop (a thread; fast tokenizers release the GIL) and handed to the ``Batcher``. A request
whose client disconnects is dropped before it runs. ``dimensions`` keeps the first dimensions and normalizes them
again (Matryoshka models); ``truncate`` (default true) cuts inputs at the model's length, false refuses them.
"""

import asyncio
import base64
import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .batcher import Batcher, QueueFull
from .engine import InputError, describe
from .metrics import Metrics

MAX_INPUTS = 2048  # per request, as OpenAI's embeddings endpoint
MAX_REQUEST_TOKENS = 300_000  # per request, as OpenAI's


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers


def _json(content, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)


def _error(error: ApiError) -> Response:
    return _json({"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}},
                 error.status, error.headers)


def create_app(engine, *, max_batch_tokens: int = 8192, max_queue: int = 256, api_key: str | None = None,
               max_body_bytes: int = 16 << 20, tokenizer_threads: int = 1) -> Starlette:
    """The ASGI app serving ``engine`` (``engine.load(...)``, or ``Embeddings``/``Scores`` around a model and
    tokenizer of your own); mount it in an existing app or run it with any ASGI server. Its model worker starts at
    once and stops, after answering every accepted request, when the app shuts down (its ASGI lifespan; mounted
    inside another app, whose lifespan does not reach it, call ``app.state.batcher.close()`` at shutdown)."""
    metrics = Metrics()
    batcher = Batcher(engine, max_batch_tokens, max_queue, metrics)
    tokenizing = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="fastbert-serve-tokenize")
    created = int(time.time())

    async def body_of(request: Request) -> dict:
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise ApiError(413, f"the body has {length} bytes, more than this server's {max_body_bytes}")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body_bytes:
                raise ApiError(413, f"the body has more than this server's {max_body_bytes} bytes")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as error:
            raise ApiError(400, f"the body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != engine.name:
            raise ApiError(404, f"the model `{model}` is not served here (this server serves `{engine.name}`)",
                           param="model", code="model_not_found")
        truncate = body.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ApiError(400, "truncate must be true or false", param="truncate")
        return body

    async def run(request: Request, items) -> np.ndarray:
        """The rows of ``items``, unless the client goes away first (then the work is dropped)."""
        if sum(len(item.ids) for item in items) > MAX_REQUEST_TOKENS:
            raise ApiError(400, f"the request has more than {MAX_REQUEST_TOKENS} tokens; split it")
        submitted = asyncio.ensure_future(batcher.submit(items))
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({submitted, gone}, return_when=asyncio.FIRST_COMPLETED)
        if submitted not in done:
            submitted.cancel()
            raise ApiError(499, "the client closed the request")
        gone.cancel()
        try:
            return submitted.result()
        except QueueFull as error:
            raise ApiError(429, str(error), kind="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(error.retry_after)}) from None

    async def tokenized(function, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(tokenizing, function, *args)
        except InputError as error:
            raise ApiError(400, str(error), param=error.param) from None

    def usage(items) -> dict:
        tokens = sum(len(item.ids) for item in items)
        return {"prompt_tokens": tokens, "total_tokens": tokens}

    async def embeddings(request: Request):
        body = await body_of(request)
        _needs(engine, "embeddings", "/v1/embeddings")
        texts, ids = _inputs(body.get("input"), allow_ids=True)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise ApiError(400, f"encoding_format must be 'float' or 'base64', got {encoding!r}",
                           param="encoding_format")
        dimensions = body.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or not 1 <= dimensions <= engine.dim):
            raise ApiError(400, f"dimensions must be an integer in [1, {engine.dim}], got {dimensions!r}",
                           param="dimensions")
        if texts is not None:
            items = await tokenized(engine.tokenize, texts, body.get("truncate", True))
        else:
            items = await tokenized(engine.token_ids, ids, body.get("truncate", True))
        vectors = await run(request, items)  # [n, dim] float32
        if dimensions is not None and dimensions < engine.dim:
            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
                 if encoding == "base64" else row}
                for i, row in enumerate(vectors)]
        return _json({"object": "list", "data": data, "model": engine.name, "usage": usage(items)})

    async def rerank(request: Request):
        body = await body_of(request)
        _needs(engine, "scores", "rerank")
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not query.strip():
            raise ApiError(400, "query must be a non-empty string", param="query")
        if not isinstance(documents, list) or not documents or len(documents) > MAX_INPUTS:
            raise ApiError(400, f"documents must be a list of 1 to {MAX_INPUTS} strings", param="documents")
        texts = []
        for i, document in enumerate(documents):
            text = document.get("text") if isinstance(document, dict) else document
            if not isinstance(text, str) or not text.strip():
                raise ApiError(400, f"documents[{i}] must be a non-empty string (or {{\"text\": string}})",
                               param="documents")
            texts.append(text)
        top_n = body.get("top_n", len(texts))
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise ApiError(400, f"top_n must be a positive integer, got {top_n!r}", param="top_n")
        items = await tokenized(engine.tokenize, [query] * len(texts), body.get("truncate", True), texts)
        logits = await run(request, items)
        if logits.shape[1] != 1:
            raise ApiError(400, f"rerank needs a model with one relevance logit; this one has {logits.shape[1]} "
                           "labels (use /v1/classify)")
        scores = logits[:, 0] if engine.activation == "identity" else 1 / (1 + np.exp(-logits[:, 0]))
        order = np.argsort(-scores, kind="stable")[:top_n]
        results = [{"index": int(i), "relevance_score": float(scores[i]),
                    **({"document": {"text": texts[i]}} if body.get("return_documents") else {})} for i in order]
        return _json({"id": f"rerank-{uuid.uuid4().hex}", "model": engine.name, "results": results,
                      "usage": usage(items)})

    async def classify(request: Request):
        body = await body_of(request)
        _needs(engine, "scores", "classify")
        texts, _ = _inputs(body.get("input"), allow_ids=False)
        items = await tokenized(engine.tokenize, texts, body.get("truncate", True))
        logits = await run(request, items)
        if logits.shape[1] == 1:
            positive = 1 / (1 + np.exp(-logits[:, 0]))
            probs = np.stack([1 - positive, positive], axis=1)
        else:
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = shifted / shifted.sum(axis=1, keepdims=True)
        labels = engine.labels if len(engine.labels) == probs.shape[1] else [str(i) for i in range(probs.shape[1])]
        data = [{"index": i, "label": labels[int(row.argmax())], "probs": row.tolist(), "num_classes": len(row)}
                for i, row in enumerate(probs)]
        return _json({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": engine.name, "data": data, "usage": usage(items)})

    async def models(request: Request):
        await body_of_get(request)
        return _json({"object": "list", "data": [{"id": engine.name, "object": "model", "created": created,
                                                  "owned_by": "fastbert", **describe(engine)}]})

    async def health(request: Request):
        return _json({"status": "ok", "queued_requests": batcher.queued()})

    async def prometheus(request: Request):
        await body_of_get(request)
        return Response(metrics.render(), media_type=metrics.content_type)

    async def body_of_get(request: Request):
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    def handled(route: str, handler):
        async def endpoint(request: Request):
            start = time.perf_counter()
            try:
                response = await handler(request)
            except ApiError as error:
                response = _error(error)
            except Exception as error:  # noqa: BLE001 - a failed forward: this request's 500, the server goes on
                response = _error(ApiError(500, f"the server failed on this request: {type(error).__name__}: "
                                                f"{error}", kind="server_error"))
            metrics.request(route, response.status_code, time.perf_counter() - start)
            return response

        return endpoint

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # (uvicorn has answered every request it accepted: what is left in the queue runs, then the worker stops)
        await asyncio.get_running_loop().run_in_executor(None, batcher.close)
        tokenizing.shutdown()

    routes = [Route("/v1/embeddings", handled("embeddings", embeddings), methods=["POST"]),
              Route("/v1/rerank", handled("rerank", rerank), methods=["POST"]),
              Route("/rerank", handled("rerank", rerank), methods=["POST"]),
              Route("/v1/classify", handled("classify", classify), methods=["POST"]),
              Route("/classify", handled("classify", classify), methods=["POST"]),
              Route("/v1/models", handled("models", models), methods=["GET"]),
              Route("/health", handled("health", health), methods=["GET"]),
              Route("/metrics", handled("metrics", prometheus), methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.batcher, app.state.engine = batcher, engine
    return app


async def _not_found(request, exc):
    return _error(ApiError(404, f"no route {request.url.path}"))


async def _not_allowed(request, exc):
    return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _needs(engine, task: str, route: str) -> None:
    if engine.task != task:
        needed = "a sentence-embedding" if task == "embeddings" else "a cross-encoder or sequence-classification"
        served = "embeddings (/v1/embeddings)" if engine.task == "embeddings" else "rerank and classify"
        raise ApiError(400, f"{route} needs {needed} model; this server's model does {served}")


def _inputs(value, allow_ids: bool) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids or a list of such lists -> (texts, None)
    or (None, token id lists)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "input must be a non-empty string, a list of strings"
                       + (", a list of token ids or a list of token-id lists" if allow_ids else ""), param="input")
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"input has {len(value)} items, more than {MAX_INPUTS}; split the request",
                       param="input")
    if all(isinstance(v, str) for v in value):
        empty = next((i for i, v in enumerate(value) if not v.strip()), None)
        if empty is not None:
            raise ApiError(400, f"input[{empty}] is an empty string", param="input")
        return value, None
    if allow_ids and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None, [value]
    if allow_ids and all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
                         for v in value):
        return None, value
    raise ApiError(400, "input mixes types: give strings, or token ids" if allow_ids else
                   "input must be strings", param="input")
