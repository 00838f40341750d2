"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own so that several apps can live in one
process: requests by route and status, their latency and where it goes (waiting for the model, then answering),
the batches' tokens, sequences and time, the queue's depth."""

import prometheus_client as prometheus

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    content_type = prometheus.CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = prometheus.CollectorRegistry()
        self.requests = prometheus.Counter("fastbert_requests", "HTTP requests answered", ["route", "status"],
                                           registry=self.registry)
        self.latency = prometheus.Histogram(
            "fastbert_request_seconds", "time from a request's arrival to its answer", ["route"],
            buckets=_SECONDS, registry=self.registry)
        self.queue_wait = prometheus.Histogram(
            "fastbert_queue_wait_seconds", "time from a request's arrival (parsing and tokenizing included) to the "
            "start of the first model batch running its sequences", ["priority"], buckets=_SECONDS,
            registry=self.registry)
        self.answer = prometheus.Histogram(
            "fastbert_response_seconds", "time from the end of the last model batch running a request's sequences "
            "to its answer", ["route"], buckets=_SECONDS, registry=self.registry)
        self.batch_tokens = prometheus.Histogram(
            "fastbert_batch_tokens", "tokens per model batch (no padding: real tokens)",
            buckets=(16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768), registry=self.registry)
        self.batch_sequences = prometheus.Histogram(
            "fastbert_batch_sequences", "sequences per model batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry)
        self.batch_seconds = prometheus.Histogram(
            "fastbert_batch_seconds", "model time per batch", buckets=_SECONDS, registry=self.registry)
        self.tokens = prometheus.Counter("fastbert_tokens", "tokens run by the model", registry=self.registry)
        self.queue_depth = prometheus.Gauge("fastbert_queue_requests", "requests waiting for the model",
                                            registry=self.registry)

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def waited(self, priority: str, seconds: float) -> None:
        self.queue_wait.labels(priority).observe(seconds)

    def answered(self, route: str, seconds: float) -> None:
        self.answer.labels(route).observe(seconds)

    def batch(self, tokens: int, sequences: int, seconds: float) -> None:
        self.batch_tokens.observe(tokens)
        self.batch_sequences.observe(sequences)
        self.batch_seconds.observe(seconds)
        self.tokens.inc(tokens)

    def queue(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def render(self) -> bytes:
        return prometheus.generate_latest(self.registry)
