"""fastbert: a drop-in, faster ``transformers.BertModel``.

    from fastbert import BertModel          # instead of: from transformers import BertModel
    fastbert.optimize(hf_model)             # or swap the encoder inside an existing HF model, in place
    fastbert.info()                         # what runs here, and why
"""

import importlib

__version__ = "0.1.0"

from .derived import clear as clear_caches  # noqa: E402
from .modeling import BertModel  # noqa: E402
from .optimize import optimize  # noqa: E402
from .validation import set_input_checks  # noqa: E402

__all__ = ["BertModel", "optimize", "info", "set_input_checks", "clear_caches", "__version__"]


def __getattr__(name):
    # ``info`` is imported on first use, so that ``python -m fastbert.info`` runs the module fresh.
    if name == "info":
        return importlib.import_module(".info", __name__)
    raise AttributeError(f"module 'fastbert' has no attribute {name!r}")
