"""``create_app``: the ASGI app of one engine -- the routes of ``handlers.py`` on Starlette, and the state they serve
with in ``app.state``:

    engine       the model and its tokenizer (``loading.load``)
    batcher      the queue and the model instances (``batcher.py``)
    tokenizing   the threads that tokenize (fast tokenizers release the GIL: the event loop goes on meanwhile)
    metrics      the Prometheus registry (``metrics.py``)
    api_key      the bytes an ``Authorization: Bearer`` header must carry, or None
    max_body_bytes, created

The app's ASGI lifespan stops the batcher at shutdown, after the server has answered what it accepted.
"""

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette

from . import handlers
from .batcher import Batcher
from .metrics import Metrics


def create_app(engine, *, max_batch_tokens: int = 8192, max_queue: int = 256, api_key: str | None = None,
               max_body_bytes: int = 16 << 20, tokenizer_threads: int = 2, instances: int = 1) -> Starlette:
    """The ASGI app serving ``engine`` (``load(...)``, or an engine of ``engine.py`` or ``retrieval.py`` around a
    model and tokenizer of your own) with ``instances`` model instances; mount it in an existing app or run it with
    any ASGI server. Its instances start at once and stop, after answering every accepted request, when the app shuts
    down (its ASGI lifespan; mounted inside another app, whose lifespan does not reach it, call
    ``app.state.batcher.close()`` at shutdown)."""
    app = Starlette(routes=handlers.ROUTES, lifespan=_lifespan, exception_handlers=handlers.EXCEPTION_HANDLERS)
    state = app.state
    state.engine, state.metrics = engine, Metrics()
    state.batcher = Batcher(engine, max_batch_tokens, max_queue, state.metrics, instances)
    state.tokenizing = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="fastbert-serve-tokenize")
    state.api_key = None if api_key is None else api_key.encode()
    state.max_body_bytes, state.created = max_body_bytes, int(time.time())
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    yield
    # (the server has answered every request it accepted: what is left in the queue runs, then the instances stop)
    await asyncio.get_running_loop().run_in_executor(None, app.state.batcher.close)
    app.state.tokenizing.shutdown(wait=False, cancel_futures=True)
