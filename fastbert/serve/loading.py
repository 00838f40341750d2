"""Loading what the server serves: the checks that fail fast (a folder that is not there, a device or precision that
does not go together), then the checkpoint made into its engine (``engine.py``, ``retrieval.py``), the task chosen
from the folder.
"""

import os

import numpy as np
import torch

from .. import announce, auto_dtype, cpu
from ..auto import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification
from ..int8.quantize import quantize
from ..sentence import Sentence
from .engine import Embeddings, Scores
from .retrieval import MultiVectors, SparseEmbeddings, sparse_routes

TASKS = ("embeddings", "scores")  # what --task may force on a checkpoint that is not a retrieval folder
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def locate(model: str) -> str:
    """``model`` when it is a local folder or can be a Hub id; a clear error, at once, for a path that names no
    folder (transformers would first look for it on the Hub)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"{model} is a file: give the model's folder")
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ValueError(f"{model}: no such folder") from None
    return model


def served_name(model: str) -> str:
    """The name clients give a model by default: a local folder's own name, or the Hub id."""
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


def settings(device: str = "cpu", dtype: str = "auto", int8: bool = False) -> tuple[torch.device, torch.dtype | None]:
    """The device and dtype a model is served in, checked before anything loads (a clear error naming the option);
    None for ``auto`` without int8 (chosen once the float32 model is loaded: ``auto_dtype.choose``; int8 quantizes a
    float32 model, so ``auto`` with int8 is float32)."""
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N") from None
    if where.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA GPU torch can use")
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if dtype == "auto":
        if int8 and where.type != "cpu":
            raise ValueError("int8 runs on the CPU (its int8 GEMMs are CPU kernels): use --device cpu, or drop --int8")
        return where, torch.float32 if int8 else None
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype {dtype!r}: expected auto, {', '.join(DTYPES)}")
    if int8 and where.type != "cpu":
        raise ValueError("int8 runs on the CPU (its int8 GEMMs are CPU kernels): use --device cpu, or drop --int8")
    if int8 and torch_dtype != torch.float32:
        raise ValueError(f"int8 quantizes a float32 model: use --dtype float32 (not {dtype}) with --int8")
    if torch_dtype == torch.bfloat16 and where.type == "cpu" and not cpu.native_bf16():
        announce.note("this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 is emulated, slower than float32")
    return where, torch_dtype


def load(model: str, *, device: str = "cpu", dtype: str = "auto", int8: bool = False, task: str | None = None,
         name: str | None = None, calibration: str | None = None):
    """The engine of ``model`` (a local folder or a Hub id), in ``dtype`` on ``device``, with int8 GEMMs
    (``fastbert.quantize`` and its guard) when ``int8``; clients call it ``name`` (default: the folder's name, or the
    Hub id). The engine follows the folder as ``fastbert.corpus.Embedder(model).kind`` reads it: ``SparseEmbeddings``
    for a SparseEncoder, ``MultiVectors`` for a MultiVectorEncoder; else ``Embeddings`` or ``Scores`` by its
    architecture (``task`` forces one of those two). ``calibration``: the int8/uint8 calibration of embeddings, a
    ``.npy`` file of float embeddings [n, dim] or a text file of one sentence a line (``calibration_of``)."""
    import transformers

    if task not in (None, *TASKS):
        raise ValueError(f"task={task!r}: expected one of {', '.join(TASKS)}")
    model = locate(os.fspath(model))
    where, torch_dtype = settings(device, dtype, int8)
    sentence, refused, lookups = Sentence.read(model), {}, {}
    if sentence.kind != "dense" and task is not None:
        raise ValueError(f"task={task!r}: {model} is a {sentence.kind} model (config_sentence_transformers.json), "
                         f"served as one whatever the task")
    if sentence.kind != "dense" and calibration is not None:
        raise ValueError(f"calibration: {model} is a {sentence.kind} model; the calibration is of sentence "
                         "embeddings' int8/uint8 outputs (/v1/embeddings)")
    if sentence.kind == "sparse":
        sentence, refused, lookups = sparse_routes(model)
    config = transformers.AutoConfig.from_pretrained(sentence.transformer)
    scores = task == "scores" or (task is None and not sentence.sentence_transformers and any(
        a.endswith("ForSequenceClassification") for a in (config.architectures or [])))
    if scores and calibration is not None:
        raise ValueError(f"calibration: {model} scores (rerank, classify); the calibration is of sentence embeddings' "
                         "int8/uint8 outputs (/v1/embeddings)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(sentence.transformer)
    # (transformers 5 names the argument dtype; 4.x torch_dtype)
    dtype_argument = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype":
                      torch_dtype or torch.float32}
    auto = AutoModelForSequenceClassification if scores else AutoModelForMaskedLM if sentence.kind == "sparse" \
        else AutoModel
    loaded = auto.from_pretrained(sentence.transformer, **dtype_argument).to(where).eval()
    why = f"--dtype {dtype}"
    if torch_dtype is None:  # (auto: bf16 where the CPU has it natively and the guard passes, said once)
        loaded, why = auto_dtype.choose(loaded, tokenizer, served_name(model))
    if int8:
        quantize(loaded, tokenizer=tokenizer)
    name = name or served_name(model)
    if scores:
        served = Scores(loaded, tokenizer, name, _cross_encoder_activation(config))
    elif sentence.kind == "sparse":
        served = SparseEmbeddings(loaded, tokenizer, name, sentence, refused, lookups)
    elif sentence.kind == "multi_vector":
        served = MultiVectors(loaded, tokenizer, name, sentence)
    else:
        served = Embeddings(loaded, tokenizer, name, sentence, calibration_of(calibration))
    served.precision = f"{served.precision}{' with int8 GEMMs' if int8 else ''} ({why})"
    return served


def calibration_of(path: str | None) -> np.ndarray | list[str] | None:
    """A calibration file's contents: a ``.npy`` file's float embeddings [n, dim] (as sentence-transformers'
    ``quantize_embeddings`` takes them), or a text file's sentences (one a line, blank lines skipped)."""
    if path is None:
        return None
    if path.endswith(".npy"):
        return np.load(path, allow_pickle=False)
    with open(path, encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
    if len(texts) < 2:
        raise ValueError(f"calibration {path}: has {len(texts)} sentence(s); int8/uint8 ranges need at least 2")
    return texts


def _cross_encoder_activation(config) -> str:
    """The activation ``CrossEncoder.predict`` applies to this checkpoint's logits: the one its config names, else
    sigmoid for one label and none for more."""
    saved = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") or ""
    if "Sigmoid" in saved:
        return "sigmoid"
    if "Identity" in saved:
        return "identity"
    return "sigmoid" if config.num_labels == 1 else "identity"
