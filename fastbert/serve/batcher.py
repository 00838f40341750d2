"""Model instances fed batches of whole sequences under a token budget, from one queue, interactive work first.

    request (its sequences, tokenized)  ->  queue (an interactive and a bulk line)  ->  instance threads
                                                                                        -> engine.run(batch)

Each instance (a thread running the model's forwards with its share of the CPUs: ``threads.one_of``) takes the next
batch when it is free. A batch takes one sequence from each waiting request of a line in turn, oldest request
first, until the next one would pass ``max_batch_tokens`` (a batch always holds at least one sequence); each
request gets its rows when all of its sequences are done. The model is padding-free, so a batch of mixed lengths
costs what its tokens cost and the interleaving loses nothing: a request of one input waits for at most the
batches running when it arrives, however many inputs the requests before it hold.

Priority: interactive sequences go into a batch first, bulk ones fill what is left. Bulk work never starves: while
it waits, it earns ``BULK_SHARE`` of the interactive tokens run as credit, and goes ahead of interactive work as far
as that credit goes -- so under a flood of interactive requests, bulk still gets 1/9 of the tokens.

Overload is a bounded queue: at ``max_queue`` waiting requests ``submit`` raises ``QueueFull`` (the API answers 429
with a Retry-After from the recent throughput). A request whose client went away is dropped before its sequences
run. A batch whose forward fails fails its own requests only; the instance goes on. ``close`` runs every request
already accepted, then stops the instances.
"""

import asyncio
import collections
import threading
import time

from .. import threads

PRIORITIES = ("interactive", "bulk")
BULK_SHARE = 1 / 8  # credit bulk work earns per interactive token run while it waits


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server's queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class _Work:
    """One request: its sequences, where the next one to run is, its rows as they come, and when it arrived, had its
    first sequence taken into a batch and had its last one run (``time.perf_counter``)."""

    __slots__ = ("items", "priority", "taken", "done", "rows", "future", "loop", "cancelled", "tokens", "arrived",
                 "started", "finished")

    def __init__(self, items, priority: str, arrived: float, future, loop):
        self.items, self.priority, self.arrived, self.future, self.loop = items, priority, arrived, future, loop
        self.taken = self.done = 0
        self.rows = [None] * len(items)
        self.cancelled = False
        self.tokens = sum(len(item.ids) for item in items)
        self.started = self.finished = None


class Batcher:
    """The queue and the instance threads of one engine (``engine.run(items)``: one row per item -- an array's rows,
    or outputs of each item's own shape -- safe to call from several threads)."""

    def __init__(self, engine, max_batch_tokens: int, max_queue: int, metrics=None, instances: int = 1):
        if max_batch_tokens < 1 or max_queue < 1 or instances < 1:
            raise ValueError("max_batch_tokens, max_queue and instances must be >= 1")
        self.engine, self.max_batch_tokens, self.max_queue = engine, max_batch_tokens, max_queue
        self.metrics, self.instances = metrics, instances
        self.lines = {priority: collections.deque() for priority in PRIORITIES}  # requests with sequences to take
        self.bulk_credit = 0.0  # tokens bulk work may run ahead of interactive work
        self.condition = threading.Condition()
        self.closing = False
        self.tokens_per_second = 0.0  # recent throughput of one instance, for Retry-After
        self.workers = [threading.Thread(target=self._serve, name=f"fastbert-serve-model-{i}", daemon=True)
                        for i in range(instances)]
        for worker in self.workers:
            worker.start()

    # --- the event loop's side ---------------------------------------------------------------------------------------

    async def submit(self, items, priority: str = "interactive", arrived: float | None = None,
                     ) -> tuple[list, float]:
        """Run ``items`` (one request's sequences) -> (their rows in order, when the last of them finished). Raises
        ``QueueFull``; cancelling the awaiting task (the client went away) drops what has not run."""
        loop = asyncio.get_running_loop()
        work = _Work(items, priority, time.perf_counter() if arrived is None else arrived, loop.create_future(), loop)
        with self.condition:
            waiting = self._waiting()
            if self.closing:
                raise QueueFull(1)
            if waiting >= self.max_queue:
                queued = sum(w.tokens for line in self.lines.values() for w in line)
                rate = self.tokens_per_second * self.instances
                raise QueueFull(max(1, round(queued / rate)) if rate else 1)
            self.lines[priority].append(work)
            self._gauge()
            self.condition.notify()
        try:
            return await work.future, work.finished
        except asyncio.CancelledError:
            work.cancelled = True
            raise

    def queued(self) -> int:
        with self.condition:
            return self._waiting()

    def close(self) -> None:
        """Run every accepted request, then stop the instances (blocks until they have)."""
        with self.condition:
            self.closing = True
            self.condition.notify_all()
        for worker in self.workers:
            worker.join()

    # --- the instances' side -----------------------------------------------------------------------------------------

    def _serve(self) -> None:
        if self.instances > 1 and self.engine.device.type == "cpu":
            threads.one_of(self.instances)
        while True:
            with self.condition:
                while not self._waiting() and not self.closing:
                    self.condition.wait()
                if not self._waiting() and self.closing:
                    return
                batch = self._take()
                self._gauge()
            if batch:
                self._run(batch)

    def _take(self) -> list[tuple[_Work, int]]:
        """(request, sequence index) pairs of the next batch within the token budget: bulk sequences as far as bulk's
        credit goes (when interactive work waits too), then interactive ones, then bulk ones."""
        interactive, bulk = self.lines["interactive"], self.lines["bulk"]
        batch: list[tuple[_Work, int]] = []
        ahead = self._fill(bulk, batch, 0, min(self.bulk_credit, self.max_batch_tokens)) if interactive and bulk \
            else 0
        tokens = self._fill(interactive, batch, ahead, self.max_batch_tokens)
        ran_interactive = tokens - ahead
        tokens = self._fill(bulk, batch, tokens, self.max_batch_tokens)
        self.bulk_credit = self.bulk_credit - ahead + BULK_SHARE * ran_interactive if bulk else 0.0
        return batch

    def _fill(self, line: collections.deque, batch: list, tokens: int, limit: float) -> int:
        """Add sequences of ``line`` to ``batch``, one of each request in turn (a request that gave one goes to the
        back of its line), while the tokens stay within ``limit`` (an empty batch takes its first one whatever its
        length, when ``limit`` is the whole budget); returns the batch's tokens."""
        while line:
            work = line[0]
            if work.cancelled:
                line.popleft()
                continue
            length = len(work.items[work.taken].ids)
            if tokens + length > limit and (batch or limit < self.max_batch_tokens):
                break
            if work.started is None:
                work.started = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.waited(work.priority, work.started - work.arrived)
            batch.append((work, work.taken))
            tokens += length
            work.taken += 1
            line.popleft()
            if work.taken < len(work.items):
                line.append(work)
        return tokens

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
        finished = time.perf_counter()
        seconds = finished - start
        if self.metrics is not None:
            self.metrics.batch(tokens, len(batch), seconds)
        with self.condition:  # (a request's sequences may run in several instances' batches at once)
            self.tokens_per_second = 0.8 * self.tokens_per_second + 0.2 * tokens / seconds \
                if self.tokens_per_second else tokens / seconds
            for (work, i), row in zip(batch, rows):
                work.rows[i] = row
                work.done += 1
                if work.done == len(work.items) and not work.cancelled:
                    work.finished = finished
                    _resolve(work, result=work.rows)

    def _waiting(self) -> int:
        return sum(len(line) for line in self.lines.values())

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(self._waiting())


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
