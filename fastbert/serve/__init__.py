"""``fastbert serve``: an OpenAI-compatible embeddings, rerank and classify server on the padding-free path.

    fastbert serve MODEL [--host 127.0.0.1] [--port 8000] [--int8] [--dtype float32|bfloat16|float16]
                         [--device cpu|cuda] [--task embeddings|scores] [--max-batch-tokens N] [--max-queue N]
                         [--api-key KEY] [--served-model-name NAME]
    python -m fastbert serve MODEL ...

    from fastbert.serve import create_app, load
    app = create_app(load("path/to/model"))          # an ASGI app: mount it, or run it with any ASGI server

MODEL is a local folder or a Hub id in the cache. The task follows the model (``engine.py``): a sentence-transformers
folder or a plain encoder serves embeddings (its pooling, normalization and ``max_seq_length``); a cross-encoder or
any ``*ForSequenceClassification`` checkpoint serves rerank and classify. Requests are tokenized off the event loop,
their token ids run back to back in batches under a token budget by one model worker (``batcher.py``: no padded
tensor, no request waits behind more than one batch), and the API (``api.py``) answers in OpenAI's shapes. Binds to
127.0.0.1 unless told otherwise; SIGTERM stops accepting, answers every accepted request, then exits 0.
"""

from .api import create_app
from .engine import Embeddings, Scores, load

__all__ = ["create_app", "load", "Embeddings", "Scores", "main", "allocator_advice"]


def allocator_advice() -> str | None:
    """What to say when this process allocates with glibc's malloc (None under tcmalloc or jemalloc, or where it
    cannot be told). A server's batches have a new shape nearly every time, and glibc's heap keeps growing with
    them, as it does under transformers; tcmalloc keeps the memory flat (docs/serving.md, "Memory")."""
    import ctypes.util

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    if "libc.so" not in maps or "tcmalloc" in maps or "jemalloc" in maps:
        return None
    # (tcmalloc only: the allocator measured, benchmarks/memory.py)
    found = next(filter(None, map(ctypes.util.find_library, ("tcmalloc_minimal", "tcmalloc"))), None)
    remedy = f"start it with LD_PRELOAD={found}" if found else "install tcmalloc (libtcmalloc-minimal4, gperftools)"
    return ("memory: glibc's malloc, whose heap grows with new batch shapes (resident memory keeps rising); "
            f"{remedy} to keep it flat (docs/serving.md, Memory)")


def main(argv: list[str] | None = None) -> None:
    """The ``fastbert serve`` command."""
    import argparse
    import logging
    import os
    import signal

    parser = argparse.ArgumentParser(prog="fastbert serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a local folder or a Hub id in the cache")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--int8", action="store_true", help="int8 GEMMs on the CPU (fastbert.quantize, guarded)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--task", choices=("embeddings", "scores"), default=None,
                        help="what to serve (default: from the checkpoint's architecture)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per model batch (default 8192)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting for the model before new ones get 429 (default 256)")
    parser.add_argument("--api-key", default=os.environ.get("FASTBERT_API_KEY"),
                        help="require Authorization: Bearer KEY on every route but /health (or FASTBERT_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: MODEL)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    engine = load(args.model, device=args.device, dtype=args.dtype, int8=args.int8, task=args.task,
                  name=args.served_model_name)
    app = create_app(engine, max_batch_tokens=args.max_batch_tokens, max_queue=args.max_queue, api_key=args.api_key)
    logger = logging.getLogger("fastbert")
    logger.info("fastbert serve: %s (%s) on http://%s:%d", engine.name, engine.task, args.host, args.port)
    if advice := allocator_advice():
        logger.warning(advice)
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: a no-op one, so that a
    # drained server exits 0 (the default handler would end it with -SIGTERM).
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=None)
