"""The ``fastbert serve`` command: its options, the checks that fail fast with one line (a folder that is not there, a
GPU that is not there, options that do not go together, a missing extra) before anything loads, and the uvicorn
server with its shutdown: SIGTERM stops accepting connections and answers what was accepted for up to
``--graceful-shutdown-seconds``, then closes what is left and exits 0; a second SIGTERM ends the process at once."""

import argparse
import logging
import os
import signal

from .. import __version__, _openmp, threads
from . import extra, loading
from .memory import allocator_advice

CPUS_PER_INSTANCE = 4  # threads of one model instance, where --instances is left to its default

DESCRIPTION = """\
Serve a sentence-embedding model (OpenAI's /v1/embeddings), a cross-encoder or classifier (/v1/rerank,
/v1/classify), a SPLADE model (TEI's /embed_sparse) or a multi-vector model (/embed_all) over HTTP, on fastbert's
padding-free path. The task follows the checkpoint."""

EPILOG = """\
examples:
  fastbert serve path/to/all-MiniLM-L6-v2               # http://127.0.0.1:8000/v1/embeddings, model "all-MiniLM-L6-v2"
  fastbert serve BAAI/bge-reranker-base --port 8001     # a cross-encoder: /v1/rerank and /v1/classify
  fastbert serve path/to/splade --port 8002             # a SparseEncoder: /embed_sparse
  fastbert serve path/to/model --calibration sample.txt # int8/uint8 ranges from your sentences (one a line)
  fastbert serve path/to/model --int8 --api-key "$KEY" --host 0.0.0.0 --instances 4

Clients name the model as --served-model-name says, or leave "model" out. A request may say "priority": "bulk" (or
send X-Priority: bulk) to go after interactive ones. docs/serving.md has the routes, limits and metrics."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number from 1 to 65535")
    return int(text)


def _at_least(lowest: int, kind=int):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number >= {lowest}")
        return value

    return parse


def default_instances(device: str = "cpu") -> int:
    """One model instance per ``CPUS_PER_INSTANCE`` CPUs this process may use (its affinity and CPU quota,
    ``threads.limit``), at least one; one on a GPU."""
    return 1 if not device.startswith("cpu") else max(1, threads.limit().threads // CPUS_PER_INSTANCE)


def parser() -> argparse.ArgumentParser:
    parse = _Parser(prog="fastbert serve", description=DESCRIPTION, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parse.add_argument("model", help="a local folder (sentence-transformers or transformers) or a Hub id")
    parse.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s, this "
                       "machine only; 0.0.0.0 for every interface)")
    parse.add_argument("--port", type=_port, default=8000, help="the port, 1-65535 (default: %(default)s)")
    parse.add_argument("--served-model-name", default=None, help="the name clients give as model (default: the "
                       "folder's name, or the Hub id)")
    parse.add_argument("--task", choices=loading.TASKS, default=None,
                       help="embeddings or scores, for a checkpoint that is not a sentence-transformers folder "
                       "(default: from its architecture; a folder's kind decides for it)")
    parse.add_argument("--calibration", default=None, metavar="FILE",
                       help="the int8/uint8 ranges of /v1/embeddings: a .npy of float embeddings [n, dim] (as "
                       "quantize_embeddings' calibration_embeddings) or a text file of sentences, one a line "
                       "(default: fastbert's 59 shipped sentences), embedded once at start")
    parse.add_argument("--dtype", default="auto", choices=("auto", *loading.DTYPES),
                       help="the model's precision (default: %(default)s: bfloat16 on a CPU with native bf16 where "
                       "a guard on real sentences passes, else float32; the start line says which)")
    parse.add_argument("--int8", action="store_true", help="int8 GEMMs on the CPU (fastbert.quantize, its accuracy "
                       "guarded at start-up; float32 only)")
    parse.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parse.add_argument("--instances", type=_at_least(1), default=None,
                       help="model instances taking batches from one queue, each with its share of the CPUs "
                       f"(default: one per {CPUS_PER_INSTANCE} CPUs this process may use, at least one: "
                       f"{default_instances()} here; one on a GPU)")
    parse.add_argument("--max-batch-tokens", type=_at_least(1), default=8192,
                       help="tokens per model batch (default: %(default)s)")
    parse.add_argument("--max-queue", type=_at_least(1), default=256,
                       help="requests waiting for the model before new ones get 429 (default: %(default)s)")
    parse.add_argument("--graceful-shutdown-seconds", type=_at_least(0, float), default=30.0,
                       help="after SIGTERM, how long accepted requests may take before their connections are "
                       "closed (default: %(default)g)")
    parse.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every route but /health "
                       "(default: the FASTBERT_API_KEY environment variable, else none)")
    parse.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="how much uvicorn and fastbert log (default: %(default)s)")
    parse.add_argument("--version", action="version", version=f"fastbert {__version__}")
    return parse


def main(argv: list[str] | None = None) -> None:
    """The ``fastbert serve`` command."""
    command = parser()
    args = command.parse_args(argv)
    try:
        extra.require()
        loading.settings(args.device, args.dtype, args.int8)
        loading.locate(args.model)
        if args.calibration is not None and not os.path.isfile(args.calibration):
            raise ValueError(f"--calibration {args.calibration}: no such file")
    except (ModuleNotFoundError, ValueError) as error:
        command.exit(1, f"{command.prog}: error: {error}\n")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    logger = logging.getLogger("fastbert")
    try:
        served = loading.load(args.model, device=args.device, dtype=args.dtype, int8=args.int8, task=args.task,
                              name=args.served_model_name, calibration=args.calibration)
    except (OSError, ValueError) as error:  # (transformers' messages span lines: one line here)
        command.exit(1, f"{command.prog}: error: {' '.join(str(error).split())}\n")
    from .app import create_app  # (the serve extra: checked above)

    instances = args.instances or default_instances(args.device)
    app = create_app(served, max_batch_tokens=args.max_batch_tokens, max_queue=args.max_queue,
                     api_key=args.api_key or os.environ.get("FASTBERT_API_KEY") or None, instances=instances)
    logger.info("fastbert serve: %s (%s) on http://%s:%d, %d model instance(s), %s", served.name, served.task,
                args.host, args.port, instances, served.precision)
    if spinning := _openmp.describe():
        logger.info(spinning)
    if advice := allocator_advice():
        logger.warning(advice)
    _serve(app, args, logger)


def _serve(app, args, logger) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                logger.info("SIGTERM: answering the accepted requests for up to %g s (a second SIGTERM ends the "
                            "process at once)", args.graceful_shutdown_seconds)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: a no-op one, so that a
    # drained server exits 0 (the default handler would end it with -SIGTERM).
    signal.signal(signal.SIGTERM, lambda *_: None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_shutdown_seconds)
    Server(config).run()
