"""fastbert: drop-in, faster BERT-family encoders for transformers.

    from fastbert import BertModel          # instead of: from transformers import BertModel
                                            # (also RobertaModel, XLMRobertaModel, CamembertModel, ElectraModel,
                                            #  DistilBertModel, GteModel, NomicBertModel,
                                            #  ModernBertModel, MPNetModel)
    fastbert.optimize(hf_model)             # or swap the encoders inside an existing HF model, in place
    fastbert.AutoModelForSequenceClassification.from_pretrained(path)   # transformers' Auto classes, accelerated
    fastbert.quantize(model)                # CPU: int8 GEMMs, checked against float32 on real sentences first
    fastbert.cuda_graphs(model)             # GPU: replay the encoder from CUDA graphs, one per shape bucket
    fastbert.corpus.Embedder(path).embed(texts)   # a corpus, SentenceTransformer.encode's vectors, in any engine
    fastbert.info()                         # what runs here, and why
"""

import importlib

from . import _checkout, _openmp

__version__ = "0.1.0"

if _checkout.shadowed(__file__):
    # The repository's source folder, found first from the checkout's root: the installed package replaces it.
    _checkout.load_installed(__name__, __file__)
else:
    _openmp.prepare()  # (fastbert serve's process: before torch loads GNU OpenMP, which reads its settings once)
    _checkout.bind_kernels(__name__, __file__)  # (an editable install: fastbert.kernels is the checkout's kernels/)
    from .auto import (
        AutoModel,
        AutoModelForMaskedLM,
        AutoModelForMultipleChoice,
        AutoModelForPreTraining,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )
    from .derived import clear as clear_caches
    from .graphs import cuda_graphs
    from .models import (
        BertModel,
        CamembertModel,
        DistilBertModel,
        ElectraModel,
        RobertaModel,
        XLMRobertaModel,
    )
    from .models import UNAVAILABLE as _UNAVAILABLE
    from .optimize import optimize
    from . import sparse as _sparse  # noqa: F401 - the SPLADE head; its op (splade_pool) registers, for info()
    from .int8.quantize import quantize
    from .validation import set_input_checks

    # fastbert.corpus.Embedder works after a plain `import fastbert` (about 1 ms more: its imports are loaded by then).
    from . import corpus

    __all__ = [
        "BertModel", "RobertaModel", "XLMRobertaModel", "CamembertModel", "ElectraModel", "DistilBertModel",
        "AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
        "AutoModelForQuestionAnswering", "AutoModelForMultipleChoice", "AutoModelForPreTraining",
        "optimize", "quantize", "cuda_graphs", "info", "corpus", "set_input_checks", "clear_caches", "__version__",
    ]
    # (families of newer transformers: see fastbert.models)
    for _name in ("GteModel", "NomicBertModel", "ModernBertModel", "MPNetModel", "DebertaV2Model", "DebertaModel"):
        if _name not in _UNAVAILABLE:
            globals()[_name] = getattr(importlib.import_module(".models", __name__), _name)
            __all__.append(_name)

    def __getattr__(name):
        # ``info`` is imported on first use, so that ``python -m fastbert.info`` runs the module fresh.
        if name == "info":
            return importlib.import_module(".info", __name__)
        if name in _UNAVAILABLE:
            raise AttributeError(f"fastbert.{name} is not available: {_UNAVAILABLE[name]}")
        raise AttributeError(f"module 'fastbert' has no attribute {name!r}")
