"""``fastbert.quantize(model)``: the encoder's GEMMs in int8 on the CPU, kept only where real sentences say the
embeddings stay what they were.

    quantize(model, guard=True, texts=None, tokenizer=None) -> model, in place

1. ``optimize(model)``, then every nn.Linear inside an encoder layer (per layer: QKV, attention output + residual,
   FFN in + activation, FFN out + residual) is chosen for int8 (``int8.py``). Embeddings, LayerNorms, attention,
   pooler and heads stay float32; the fp32 parameters stay as they are (state_dict, ``save_pretrained``).
2. The guard runs ``texts`` (default: ``data/int8_guard.txt``, sentences in several languages, code and log lines,
   5-128 tokens) through the float32 model and the int8 one and compares, per sentence, the mean-pooled embeddings
   of every encoder (cosine) and, for a classification head, its logits (argmax agreement, cosine). It passes at
   mean cosine >= 0.99, 1st percentile >= 0.98, agreement >= 99 %. It tries, in turn (``RECIPES``):
   a. one activation scale per GEMM call (bias, activation and residual in oneDNN's epilogue);
   b. SmoothQuant: each GEMM input x divided per channel by s_j = max|x_j|^0.5 / max|W_j|^0.5 (max over the
      sentences and the Linears sharing that input) and W multiplied by it, so outlier channels of the activation
      move into the weight, which has a scale per row; and one scale per token for the input of the MLP's output
      GEMM (after GELU: the heaviest tail);
   c. SmoothQuant and per-token scales for every GEMM;
   then keeps the layers whose int8 costs most (each measured alone) in float32, one at a time; and if every layer
   but one had to, leaves the model float32, with a warning.
   The figures, and the layers kept in float32, go to the ``fastbert`` logger and ``fastbert.info()["int8"]``.
"""

import collections
import inspect
import logging
import os
import threading
import typing

import torch
from torch import nn
from transformers import PreTrainedModel

from . import announce, int8, modeling, threads
from .optimize import accelerate

logger = logging.getLogger("fastbert")

# What the int8 model must keep of the float32 one on the guard's sentences.
MIN_MEAN_COSINE = 0.99
MIN_P1_COSINE = 0.98
MIN_HEAD_AGREEMENT = 0.99
SMOOTH_ALPHA = 0.5
_GUARD_TEXTS = os.path.join(os.path.dirname(__file__), "data", "int8_guard.txt")
_BATCH = 16

_lock = threading.Lock()
_reports = collections.deque(maxlen=32)


def quantize(model: nn.Module, *, guard: bool = True, texts: list[str] | None = None, tokenizer=None) -> nn.Module:
    """Run the GEMMs of every encoder layer in ``model`` in int8 on this CPU; returns ``model`` (changed in place).

    ``model``: anything ``fastbert.optimize`` accepts (fastbert and transformers models and heads,
    ``SentenceTransformer``, ``CrossEncoder``, PEFT models), float32, on the CPU.
    ``guard``: check the int8 model against float32 on ``texts`` first, and keep float32 where int8 would change the
    result (module docstring). ``texts``: your own sentences (default: fastbert's). ``tokenizer``: the model's
    tokenizer, for the guard (default: a ``SentenceTransformer``'s or ``CrossEncoder``'s own, else the one saved
    with the checkpoint). ``FASTBERT_CPU_INT8=off`` runs the chosen GEMMs in float32 again.
    """
    encoders = _encoders(model)
    reasons = int8.unavailable_reasons()
    if reasons:
        announce.fallback(f"quantize left {type(model).__name__} in float32: int8 GEMMs do not run here "
                          f"({'; '.join(reasons)})")
        return _record(model, {"outcome": "float32", "why": "; ".join(reasons)})
    layers = [layer for encoder in encoders for layer in _layers(encoder)]
    bits = int8.weight_bits()
    if not guard:
        _choose(layers, bits)
        return _record(model, {"outcome": "int8", "guard": False, "recipe": RECIPES[0].name, "float32_layers": []})
    texts = _guard_texts() if texts is None else list(texts)
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError("texts must be a non-empty list of non-empty strings")
    batches = _batches(_tokenizer(model, tokenizer, encoders), texts, encoders)
    with _evaluating(model):  # (in a thread of its own: a process forked afterwards keeps its OpenMP threads)
        outcome = threads.in_own_thread(_guarded_choice, model, encoders, layers, batches, bits)
    return _record(model, {**outcome, "guard": True, "sentences": len(texts)})


def reports() -> list[dict]:
    """What each ``quantize`` call in this process decided, with the guard's figures, latest last."""
    with _lock:
        return list(_reports)


# --- what gets quantized --------------------------------------------------------------------------------------------


def _encoders(model: nn.Module) -> list[modeling.FusedModel]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    off_cpu = sorted({str(p.device) for p in params if p.device.type != "cpu"})
    if off_cpu:
        raise ValueError(f"fastbert.quantize runs int8 GEMMs on the CPU; model has parameters on {', '.join(off_cpu)}"
                         " (move it with model.to('cpu') first, or use fastbert.optimize on the GPU)")
    accelerate(model)
    encoders = [m for m in model.modules() if isinstance(m, modeling.FusedModel)]
    if not encoders:
        raise ValueError(f"model ({type(model).__name__}) holds no encoder fastbert accelerates: nothing to quantize")
    for encoder in encoders:
        dtype = encoder.get_input_embeddings().weight.dtype
        if dtype != torch.float32:
            raise ValueError(f"fastbert.quantize takes a float32 model, got {dtype} ({type(encoder).__name__})")
    return encoders


class _Layer(typing.NamedTuple):
    name: str
    linears: list[nn.Linear]  # every nn.Linear of the layer
    mlp_out: list[nn.Linear]  # those reading the MLP's activation (input width != hidden): the heaviest-tailed input


def _layers(encoder: modeling.FusedModel) -> list[_Layer]:
    """The encoder's layers: the module list holding ``num_hidden_layers`` of them, whatever the family calls it."""
    count, hidden = encoder.config.num_hidden_layers, encoder.config.hidden_size
    for name, module in encoder.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            layers = []
            for i, layer in enumerate(module):
                linears = [m for m in layer.modules() if type(m) is nn.Linear]
                mlp_out = [m for m in linears if m.in_features != hidden]
                layers.append(_Layer(f"{type(encoder).__name__}.{name}.{i}", linears, mlp_out))
            return layers
    raise ValueError(f"no list of {count} layers found in {type(encoder).__name__}")


class _Recipe(typing.NamedTuple):
    name: str
    smooth: bool  # SmoothQuant divisors from the first int8 run's activation ranges
    per_token: str  # which inputs get one scale per token: "none", "mlp_out" or "all"


# Tried in turn until the guard passes, cheapest first: one scale per GEMM call keeps bias, activation and residual
# in oneDNN's epilogue; per-token scales cost an elementwise pass or two after the GEMM. (all-MiniLM-L6-v2 on the
# guard's sentences, 8-bit weights: per call 0.9916 mean / 0.9604 1st-percentile cosine; with SmoothQuant and per-token
# scales on the MLP's output GEMM 0.9982 / 0.9903; per token everywhere 0.9985 / 0.9910.)
RECIPES = (
    _Recipe("per-call activation scales", False, "none"),
    _Recipe("SmoothQuant, per-token scales into the MLP's output GEMM", True, "mlp_out"),
    _Recipe("SmoothQuant, per-token scales everywhere", True, "all"),
)


def _choose(layers: list[_Layer], bits: int | None, recipe: _Recipe = RECIPES[0], smooth: dict | None = None,
            float32: frozenset = frozenset()) -> None:
    """Every Linear of ``layers`` in int8 with ``bits`` as ``recipe`` says (None: all float32), ``smooth[linear]`` its
    divisor, the layers named in ``float32`` left out."""
    for layer in layers:
        for linear in layer.linears:
            choice = None
            if bits is not None and layer.name not in float32:
                per_token = recipe.per_token == "all" or (recipe.per_token == "mlp_out" and linear in layer.mlp_out)
                choice = int8.Choice(bits, (smooth or {}).get(linear) if recipe.smooth else None, per_token)
            int8.choose(linear, choice)


# --- the guard -------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def _guarded_choice(model, encoders, layers: list[_Layer], batches, bits) -> dict:
    """The first of ``RECIPES`` the guard passes with, else the last one with the costliest layers in float32 until
    it passes; the guard's figures and what was chosen."""
    _choose(layers, None)
    reference = _outputs(model, encoders, batches)
    smooth = None
    for recipe in RECIPES:
        _choose(layers, bits, recipe, smooth)
        with int8.recording() as absmax:  # (the GEMM inputs' ranges, for SmoothQuant)
            figures = _compare(reference, _outputs(model, encoders, batches))
        smooth = smooth or _smoothing(layers, absmax)
        if _passes(figures):
            return {"outcome": "int8", "recipe": recipe.name, "float32_layers": [], **figures}
    float32, costs = [], {}
    names = [layer.name for layer in layers]
    for name in names:  # each layer alone in int8: what it costs
        _choose(layers, bits, recipe, smooth, frozenset(n for n in names if n != name))
        costs[name] = 1.0 - _compare(reference, _outputs(model, encoders, batches))["mean_cosine"]
    for name in sorted(costs, key=costs.get, reverse=True)[:-1]:
        float32.append(name)
        _choose(layers, bits, recipe, smooth, frozenset(float32))
        figures = _compare(reference, _outputs(model, encoders, batches))
        if _passes(figures):
            return {"outcome": "int8", "recipe": recipe.name, "float32_layers": float32, **figures}
    _choose(layers, None)
    announce.fallback(f"quantize left {type(model).__name__} in float32: int8 GEMMs changed its embeddings beyond "
                      "the guard's limits (SmoothQuant and per-token scales included) unless every layer but one "
                      "stayed float32")
    return {"outcome": "float32", "why": "the guard failed", "recipe": recipe.name, **figures}


def _smoothing(layers: list[_Layer], absmax: dict) -> dict:
    """{linear: s [in]}: SmoothQuant's s_j = max|x_j|^a / max|W_j|^(1 - a), shared by Linears reading one input (q,
    k and v; up and gate), which the stacked GEMMs quantize once."""
    smooth = {}
    for layer in layers:
        groups = collections.defaultdict(list)
        for linear in layer.linears:
            if linear in absmax:  # (Linears reading one tensor saw the very same values)
                groups[tuple(absmax[linear].tolist())].append(linear)
        for members in groups.values():
            x_max = absmax[members[0]].float()
            w_max = torch.stack([m.weight.detach().abs().amax(dim=0).float() for m in members]).amax(dim=0)
            s = x_max.clamp_min(1e-5) ** SMOOTH_ALPHA / w_max.clamp_min(1e-5) ** (1 - SMOOTH_ALPHA)
            s = torch.where(x_max > 0, s, torch.ones_like(s)).clamp(1e-3, 1e3)
            smooth.update({m: s for m in members})
    return smooth


def _outputs(model, encoders, batches) -> dict[str, torch.Tensor]:
    """{"embeddings": [sentences, sum of widths] mean-pooled, per encoder side by side; "logits": a classification
    head's logits at what it classifies, [items, labels]} (no "logits" without such a head)."""
    head = _classification_head(model, encoders)
    pooled, logits = [], []
    for batch in batches:
        mask = batch["attention_mask"].unsqueeze(-1).float()  # [B, S, 1]
        states = [e(**_accepted(e, batch)).last_hidden_state for e in encoders]  # [B, S, H] each
        pooled.append(torch.cat([(s * mask).sum(1) / mask.sum(1).clamp_min(1) for s in states], dim=-1))
        if head is not None:
            out = head(**_accepted(head, batch)).logits
            logits.append(out if out.dim() == 2 else out[batch["attention_mask"].bool()])  # [items, labels]
    outputs = {"embeddings": torch.cat(pooled)}
    if logits:
        outputs["logits"] = torch.cat(logits)
    return outputs


def _classification_head(model, encoders):
    """The outermost transformers head above the encoders whose logits are labels (sequence, token, multiple
    choice classification), or None."""
    for module in model.modules():
        if (isinstance(module, PreTrainedModel) and not isinstance(module, modeling.FusedModel)
                and any(e is m for m in module.modules() for e in encoders)
                and type(module).__name__.endswith(("ForSequenceClassification", "ForTokenClassification"))):
            return module
    return None


def _accepted(module: nn.Module, batch: dict) -> dict:
    names = getattr(module, "_hf_parameters", None) or inspect.signature(module.forward).parameters
    return {k: v for k, v in batch.items() if k in names}


def _compare(reference: dict, quantized: dict) -> dict:
    cosine = torch.nn.functional.cosine_similarity(reference["embeddings"], quantized["embeddings"], dim=-1)
    figures = {"mean_cosine": round(cosine.mean().item(), 5), "p1_cosine": round(cosine.quantile(0.01).item(), 5),
               "min_cosine": round(cosine.min().item(), 5)}
    if "logits" in reference:
        agree = (reference["logits"].argmax(-1) == quantized["logits"].argmax(-1)).float().mean()
        head_cosine = torch.nn.functional.cosine_similarity(reference["logits"], quantized["logits"], dim=-1)
        figures.update(head_agreement=round(agree.item(), 5), head_cosine=round(head_cosine.mean().item(), 5))
    return figures


def _passes(figures: dict) -> bool:
    return (figures["mean_cosine"] >= MIN_MEAN_COSINE and figures["p1_cosine"] >= MIN_P1_COSINE
            and figures.get("head_agreement", 1.0) >= MIN_HEAD_AGREEMENT)


# --- inputs --------------------------------------------------------------------------------------------------------


def _guard_texts() -> list[str]:
    with open(_GUARD_TEXTS, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _tokenizer(model, tokenizer, encoders):
    if tokenizer is not None:
        return tokenizer
    own = getattr(model, "tokenizer", None)  # SentenceTransformer, CrossEncoder
    if own is not None and callable(own):
        return own
    path = encoders[0].config._name_or_path
    if path:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            pass
    raise ValueError("fastbert.quantize checks int8 against float32 on real sentences and needs the model's "
                     "tokenizer: pass tokenizer=..., or guard=False to skip the check")


def _batches(tokenizer, texts: list[str], encoders) -> list[dict]:
    limit = min([128] + [e.config.max_position_embeddings for e in encoders
                         if getattr(e.config, "max_position_embeddings", None)])
    return [dict(tokenizer(texts[i:i + _BATCH], padding=True, truncation=True, max_length=limit,
                           return_tensors="pt"))
            for i in range(0, len(texts), _BATCH)]


class _evaluating:
    """Every module in eval mode inside (dropout would blur the comparison), as it was after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.training = {m: m.training for m in self.model.modules()}
        self.model.eval()

    def __exit__(self, *exc):
        for module, training in self.training.items():
            module.training = training


def _record(model, report: dict) -> nn.Module:
    report = {"model": type(model).__name__, "isa": int8.isa_path(), "weight_bits": int8.weight_bits(), **report}
    with _lock:
        _reports.append(report)
    logger.info("fastbert.quantize: %s", report)
    return model
