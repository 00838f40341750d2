"""The wire format every route shares: OpenAI's error body, a JSON body read within its size limit, and the checks of
the fields several routes take (``model``, ``truncate``, ``priority``, ``input``, ``task``), each failing with the
4xx and the message that name the field -- before anything is tokenized or run."""

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .batcher import PRIORITIES

MAX_INPUTS = 2048  # per request, as OpenAI's embeddings endpoint
PRIORITY_HEADER = "x-priority"


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers


def json_response(content, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)


def json_rows_response(rows, encode_row) -> StreamingResponse:
    """A JSON list of ``encode_row(row)`` for each row, written a row at a time: a request's answer of up to its
    300,000 tokens' vectors (hundreds of MB of JSON, seconds of encoding) never holds the event loop for more than
    one row -- Starlette runs the generator in a thread, and other requests go on between rows."""
    def chunks():
        for i, row in enumerate(rows):
            yield (b"[" if i == 0 else b",") + orjson.dumps(encode_row(row), option=orjson.OPT_SERIALIZE_NUMPY)
        yield b"]" if rows else b"[]"

    return StreamingResponse(chunks(), media_type="application/json")


def error_response(error: ApiError) -> Response:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return json_response({"error": {"message": str(error), "type": error.kind, "param": error.param,
                                    "code": error.code}}, error.status, error.headers)


async def read_body(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, refused (413) as soon as it passes ``max_bytes``, whatever its Content-Length says."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"the body has {length} bytes, more than this server's {max_bytes}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        request.state.body_bytes = len(raw)  # (what the request held: memory.give_back after a large one)
        if len(raw) > max_bytes:
            raise ApiError(413, f"the body has more than this server's {max_bytes} bytes")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise ApiError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict, served: str) -> None:
    """``model`` may be left out; given, it must be the served model's name."""
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(404, f"the model `{model}` is not served here (this server serves `{served}`)",
                       param="model", code="model_not_found")


def truncate_of(body: dict) -> bool:
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ApiError(400, "truncate must be true or false", param="truncate")
    return truncate


def priority_of(body: dict, request: Request) -> str:
    """``priority`` from the body or the X-Priority header: interactive (the default) or bulk."""
    given = {source: value for source, value in (("priority", body.get("priority")),
                                                 ("X-Priority", request.headers.get(PRIORITY_HEADER)))
             if value is not None}
    for source, value in given.items():
        if value not in PRIORITIES:
            raise ApiError(400, f"{source} must be one of {', '.join(PRIORITIES)}, got {value!r}", param="priority")
    if len(set(given.values())) > 1:
        raise ApiError(400, f"priority {given['priority']!r} and X-Priority {given['X-Priority']!r} disagree",
                       param="priority")
    return next(iter(given.values()), PRIORITIES[0])


def positive_int(body: dict, name: str, default: int | None, most: int | None = None) -> int | None:
    """The integer field ``name`` in [1, most] (``default`` where it is left out or null)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most is not None and value > most):
        raise ApiError(400, f"{name} must be an integer in [1, {most}], got {value!r}" if most is not None else
                       f"{name} must be a positive integer, got {value!r}", param=name)
    return value


def inputs_of(value, allow_ids: bool, field: str = "input") -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's ``input`` (TEI's ``inputs``: ``field``): a string, a list of strings, a list of token ids or a list of
    such lists -> (texts, None) or (None, token id lists)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"{field} must be a non-empty string, a list of strings"
                       + (", a list of token ids or a list of token-id lists" if allow_ids else ""), param=field)
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"{field} has {len(value)} items, more than {MAX_INPUTS}; split the request",
                       param=field)
    if all(isinstance(v, str) for v in value):
        empty = next((i for i, v in enumerate(value) if _blank(v)), None)
        if empty is not None:
            raise ApiError(400, f"{field}[{empty}] is an empty string", param=field)
        return value, None
    if allow_ids and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None, [value]
    if allow_ids and all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
                         for v in value):
        return None, value
    raise ApiError(400, f"{field} mixes types: give strings, or token ids" if allow_ids else
                   f"{field} must be strings", param=field)


def task_of(body: dict) -> str | None:
    """``task`` of an embeddings, sparse or multi-vector request: left out or null (``encode``), "query" or
    "document" (``encode_query`` / ``encode_document``: the folder's prompt for it)."""
    task = body.get("task")
    if task not in (None, "query", "document"):
        raise ApiError(400, f"task must be \"query\", \"document\" or null, got {task!r}", param="task")
    return task


def documents_of(body: dict) -> list[str]:
    """Rerank's ``documents``: 1 to ``MAX_INPUTS`` strings or ``{"text": string}``."""
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents or len(documents) > MAX_INPUTS:
        raise ApiError(400, f"documents must be a list of 1 to {MAX_INPUTS} strings", param="documents")
    texts = []
    for i, document in enumerate(documents):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str) or _blank(text):
            raise ApiError(400, f"documents[{i}] must be a non-empty string (or {{\"text\": string}})",
                           param="documents")
        texts.append(text)
    return texts


def _blank(text: str) -> bool:
    return not text or text.isspace()  # (isspace stops at the first other character: no copy of a long text)
