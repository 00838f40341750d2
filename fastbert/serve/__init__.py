"""``fastbert serve``: an OpenAI-compatible embeddings, rerank and classify server on the padding-free path.

    fastbert serve MODEL [options]                   # the command (cli.py); fastbert serve --help lists the options
    python -m fastbert serve MODEL ...

    from fastbert.serve import create_app, load
    app = create_app(load("path/to/model"))          # an ASGI app: mount it, or run it with any ASGI server

MODEL is a local folder or a Hub id. The task follows the model (``loading.py``): a sentence-transformers folder or
a plain encoder serves embeddings (its pooling, normalization and ``max_seq_length``; ``engine.py``), in float,
base64 or quantized formats (``formats.py``); a cross-encoder or any ``*ForSequenceClassification`` checkpoint
serves rerank and classify (``heads.py``); a SparseEncoder (SPLADE) folder serves sparse embeddings and a
MultiVectorEncoder (ColBERT-style) folder token embeddings (``retrieval.py``). Texts are cut to bounded prefixes and
tokenized off the event loop (``tokens.py``), their token ids run back to back in batches under a token budget,
interactive requests first, by one or more model instances (``batcher.py``), and the routes (``handlers.py``, on the
app of ``app.py``, with ``protocol.py``'s checks and errors) answer in OpenAI's and TEI's shapes, with Prometheus
metrics (``metrics.py``); a large request gives the memory it freed back (``memory.py``). Binds to 127.0.0.1 unless
told otherwise; SIGTERM answers what was accepted within a grace period, then exits 0.

``create_app`` needs the ``serve`` extra (``extra.py``); ``load``, the engines and the command's ``--help`` do not.
"""

from . import extra
from .cli import main
from .engine import Embeddings, Scores
from .loading import load
from .memory import allocator_advice
from .retrieval import MultiVectors, SparseEmbeddings

__all__ = ["create_app", "load", "Embeddings", "Scores", "SparseEmbeddings", "MultiVectors", "main",
           "allocator_advice"]


def __getattr__(name):
    # (create_app is imported on first use: it needs the serve extra, which the rest of the package does not)
    if name == "create_app":
        extra.require()
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
