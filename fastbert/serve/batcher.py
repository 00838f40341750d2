"""One model worker, fed batches of whole sequences under a token budget, in arrival order.

    request (its sequences, tokenized off the event loop)  ->  queue of Work  ->  worker thread  ->  engine.run(batch)

The worker fills a batch by taking one sequence from each waiting request in turn, oldest request first, until the
next one would pass ``max_batch_tokens`` (a batch always holds at least one sequence); it runs them as one batch and
hands each request its rows when all of its sequences are done. The model is padding-free, so a batch of mixed
lengths costs what its tokens cost and the interleaving loses nothing: a request of one input waits for at most the
batch running when it arrives, however many inputs the requests before it hold, and the next batch forms while the
current one runs (from whatever arrived meanwhile).

Overload is a bounded queue: at ``max_queue`` waiting requests ``submit`` raises ``QueueFull`` (the API answers 429
with a Retry-After from the recent throughput). A request whose client went away is dropped before its sequences
run. A batch whose forward fails fails its own requests only; the worker goes on. ``close`` runs every request
already accepted, then stops the worker.
"""

import asyncio
import collections
import threading
import time

import numpy as np


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server's queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class _Work:
    """One request: its sequences, where the next one to run is, and its rows as they come."""

    __slots__ = ("items", "taken", "done", "rows", "future", "loop", "cancelled", "tokens")

    def __init__(self, items, future, loop):
        self.items, self.future, self.loop = items, future, loop
        self.taken = self.done = 0
        self.rows = [None] * len(items)
        self.cancelled = False
        self.tokens = sum(len(item.ids) for item in items)


class Batcher:
    """The queue and the worker thread of one engine (``engine.run(items) -> np.ndarray [len(items), ...]``)."""

    def __init__(self, engine, max_batch_tokens: int, max_queue: int, metrics=None):
        if max_batch_tokens < 1 or max_queue < 1:
            raise ValueError("max_batch_tokens and max_queue must be >= 1")
        self.engine, self.max_batch_tokens, self.max_queue = engine, max_batch_tokens, max_queue
        self.metrics = metrics
        self.pending: collections.deque[_Work] = collections.deque()  # requests with sequences not yet taken
        self.condition = threading.Condition()
        self.closing = False
        self.tokens_per_second = 0.0  # recent throughput, for Retry-After
        self.worker = threading.Thread(target=self._serve, name="fastbert-serve-model", daemon=True)
        self.worker.start()

    # --- the event loop's side ---------------------------------------------------------------------------------------

    async def submit(self, items) -> np.ndarray:
        """Run ``items`` (one request's sequences); their rows in order. Raises ``QueueFull``; cancelling the
        awaiting task (the client went away) drops what has not run."""
        loop = asyncio.get_running_loop()
        work = _Work(items, loop.create_future(), loop)
        with self.condition:
            if self.closing:
                raise QueueFull(1)
            if len(self.pending) >= self.max_queue:
                queued = sum(w.tokens for w in self.pending)
                raise QueueFull(max(1, round(queued / self.tokens_per_second)) if self.tokens_per_second else 1)
            self.pending.append(work)
            self._gauge()
            self.condition.notify()
        try:
            return await work.future
        except asyncio.CancelledError:
            work.cancelled = True
            raise

    def queued(self) -> int:
        with self.condition:
            return len(self.pending)

    def close(self) -> None:
        """Run every accepted request, then stop the worker (blocks until it has)."""
        with self.condition:
            self.closing = True
            self.condition.notify()
        self.worker.join()

    # --- the worker's side -------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self.condition:
                while not self.pending and not self.closing:
                    self.condition.wait()
                if not self.pending and self.closing:
                    return
                batch = self._take()
                self._gauge()
            if batch:
                self._run(batch)

    def _take(self) -> list[tuple[_Work, int]]:
        """(request, sequence index) pairs of the next batch within the token budget: one sequence of each waiting
        request in turn (a request that gave one goes to the back of the line, also across batches)."""
        batch, tokens = [], 0
        while self.pending:
            work = self.pending[0]
            if work.cancelled:
                self.pending.popleft()
                continue
            length = len(work.items[work.taken].ids)
            if batch and tokens + length > self.max_batch_tokens:
                break
            batch.append((work, work.taken))
            tokens += length
            work.taken += 1
            self.pending.popleft()
            if work.taken < len(work.items):
                self.pending.append(work)
        return batch

    def _run(self, batch: list[tuple[_Work, int]]) -> None:
        start = time.perf_counter()
        tokens = sum(len(work.items[i].ids) for work, i in batch)
        try:
            rows = self.engine.run([work.items[i] for work, i in batch])
        except Exception as error:  # noqa: BLE001 - this batch's requests fail; the server goes on
            for work in {id(work): work for work, _ in batch}.values():
                work.cancelled = True
                _resolve(work, error=error)
            return
        seconds = time.perf_counter() - start
        self.tokens_per_second = 0.8 * self.tokens_per_second + 0.2 * tokens / seconds if self.tokens_per_second \
            else tokens / seconds
        if self.metrics is not None:
            self.metrics.batch(tokens, len(batch), seconds)
        for (work, i), row in zip(batch, rows):
            work.rows[i] = row
            work.done += 1
            if work.done == len(work.items) and not work.cancelled:
                _resolve(work, result=np.stack(work.rows))

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(len(self.pending))


def _resolve(work: _Work, result=None, error: BaseException | None = None) -> None:
    def settle():
        if work.future.done():  # (cancelled: the client went away)
            return
        if error is not None:
            work.future.set_exception(error)
        else:
            work.future.set_result(result)

    try:
        work.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits for it any more
        pass
