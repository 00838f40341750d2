"""``fastbert.quantize(model)``: the encoder's GEMMs in int8 on the CPU, kept only where real sentences say the
embeddings stay what they were.

    quantize(model, guard=True, texts=None, tokenizer=None, show_progress_bar=None) -> model, in place

1. ``optimize(model)``, then every nn.Linear inside an encoder layer (per layer: QKV, attention output + residual,
   FFN in + activation, FFN out + residual) is chosen for int8 (``int8.py``). Embeddings, LayerNorms, attention,
   pooler and heads stay float32; the fp32 parameters stay as they are (state_dict, ``save_pretrained``).
2. The guard (``guard.py``) compares the int8 model with float32 on real sentences and climbs a ladder of recipes
   (per-call scales, SmoothQuant with per-token scales, layers kept in float32) until they agree, or leaves the
   model float32 with a warning.
3. The decision goes into the encoder's config (``config.fastbert_int8``), so a saved model (``save_pretrained``,
   ``SentenceTransformer.save``) carries it: loading it through fastbert (``optimize``, the Auto classes, a family
   class's ``from_pretrained``) runs the same int8 GEMMs without the guard, where the weights and this CPU's weight
   bits are those it was judged with (``apply_saved``). ``quantize`` on such a model reuses it too, unless given
   ``texts``.

What was decided, with the guard's figures and the layers kept in float32, is logged on the ``fastbert`` logger (INFO)
and listed in ``fastbert.info()["int8"]["models"]``.
"""

import collections
import logging
import threading

import torch
from torch import nn

from . import announce, int8, modeling
from . import guard as int8_guard
from .optimize import accelerate

logger = logging.getLogger("fastbert")

_lock = threading.Lock()
_reports = collections.deque(maxlen=32)


def quantize(model: nn.Module, *, guard: bool = True, texts: list[str] | None = None, tokenizer=None,
             show_progress_bar: bool | None = None) -> nn.Module:
    """Run the GEMMs of every encoder layer in ``model`` in int8 on this CPU; returns ``model`` (changed in place).

    ``model``: anything ``fastbert.optimize`` accepts (fastbert and transformers models and heads,
    ``SentenceTransformer``, ``CrossEncoder``, PEFT models), float32, on the CPU.
    ``guard``: check the int8 model against float32 on ``texts`` first, and keep float32 where int8 would change the
    result (``guard.py``). ``texts``: your own sentences (default: fastbert's, or the decision saved with the
    checkpoint). ``tokenizer``: the model's tokenizer, for the guard (default: a ``SentenceTransformer``'s or
    ``CrossEncoder``'s own, else the one saved with the checkpoint). ``show_progress_bar``: the guard's (default:
    when stderr is a terminal). ``FASTBERT_CPU_INT8=off`` runs the chosen GEMMs in float32 again.
    """
    encoders = _encoders(model)
    reasons = int8.unavailable_reasons()
    if reasons:
        announce.fallback(f"quantize left {type(model).__name__} in float32: int8 GEMMs do not run here "
                          f"({'; '.join(reasons)})")
        return _record(model, {"outcome": "float32", "why": "; ".join(reasons)})
    layers = [layer for encoder in encoders for layer in int8_guard.layers_of(encoder)]
    if not any(layer.linears for layer in layers):
        announce.fallback(f"quantize found nothing to quantize in {type(model).__name__}: its encoder has no layer "
                          "with a Linear (num_hidden_layers=0?); it stays float32")
        return _record(model, {"outcome": "float32", "why": "nothing to quantize: no encoder layer has a Linear"})
    bits = int8.weight_bits()
    if guard and texts is None and _apply_saved(model, encoders, announce_misfit=True):
        return model
    if not guard:
        int8_guard.choose(layers, bits)
        outcome = {"outcome": "int8", "guard": False, "recipe": int8_guard.RECIPES[0].name, "float32_layers": []}
    else:
        outcome = {**int8_guard.run(model, encoders, layers, bits, texts, tokenizer, show_progress_bar),
                   "guard": True}
    meta = {key: outcome[key] for key in ("recipe", "float32_layers", "guard") if key in outcome}
    for encoder in encoders:  # (the decision, or none where the model stayed float32, goes with the checkpoint)
        int8.to_config(encoder, bits, {**meta, "figures": {k: v for k, v in outcome.items() if "cosine" in k
                                                           or "agreement" in k}})
    return _record(model, outcome)


def apply_saved(model: nn.Module) -> None:
    """Choose int8 for the Linears of every encoder in ``model`` whose config holds a decision saved by
    ``quantize`` (``optimize`` and fastbert's loaders call this); a decision that does not fit the weights or this CPU
    is said and left unapplied."""
    encoders = [m for m in model.modules() if isinstance(m, modeling.FusedModel)
                and getattr(m.config, int8.CONFIG_KEY, None) is not None]
    if encoders:
        _apply_saved(model, encoders, announce_misfit=True)


def _apply_saved(model: nn.Module, encoders: list, announce_misfit: bool) -> bool:
    """Apply the decisions saved in ``encoders``' configs; whether every encoder had one that fits."""
    bits = int8.weight_bits()
    found = []
    for encoder in encoders:
        choices, why = int8.from_config(encoder, bits)
        if choices is None:
            if why and announce_misfit:
                announce.note(f"the int8 decision saved with {type(encoder).__name__}'s checkpoint is not applied: "
                              f"{why}")
            return False
        found.append((encoder, choices))
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        return False
    reasons = int8.unavailable_reasons()
    if reasons:
        announce.fallback(f"the int8 decision saved with {type(model).__name__}'s checkpoint is not applied: int8 "
                          f"GEMMs do not run here ({'; '.join(reasons)})")
        return False
    for encoder, choices in found:
        for module in encoder.modules():
            if type(module) is nn.Linear:
                int8.choose(module, choices.get(module))
    saved = getattr(encoders[0].config, int8.CONFIG_KEY)
    _record(model, {"outcome": "int8", "guard": saved.get("guard", False), "recipe": saved.get("recipe"),
                    "float32_layers": saved.get("float32_layers", []), **saved.get("figures", {}),
                    "from": "the decision saved with the checkpoint"})
    return True


def reports() -> list[dict]:
    """What each ``quantize`` call in this process decided, with the guard's figures, latest last."""
    with _lock:
        return list(_reports)


def _encoders(model: nn.Module) -> list[modeling.FusedModel]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    off_cpu = sorted({str(p.device) for p in params if p.device.type != "cpu"})
    if off_cpu:
        raise ValueError(f"fastbert.quantize runs int8 GEMMs on the CPU; model has parameters on {', '.join(off_cpu)}"
                         " (move it with model.to('cpu') first, or use fastbert.optimize on the GPU)")
    accelerate(model, apply_saved_int8=False)
    encoders = [m for m in model.modules() if isinstance(m, modeling.FusedModel)]
    if not encoders:
        raise ValueError(f"model ({type(model).__name__}) holds no encoder fastbert accelerates: nothing to quantize")
    for encoder in encoders:
        dtype = encoder.get_input_embeddings().weight.dtype
        if dtype != torch.float32:
            raise ValueError(f"fastbert.quantize takes a float32 model, got {dtype} ({type(encoder).__name__})")
    return encoders


def _record(model, report: dict) -> nn.Module:
    report = {"model": type(model).__name__, "isa": int8.isa_path(), "weight_bits": int8.weight_bits(), **report}
    with _lock:
        _reports.append(report)
    logger.info("fastbert.quantize: %s", describe(report))
    return model


def describe(report: dict) -> str:
    """One readable sentence of a ``quantize`` decision."""
    if report["outcome"] != "int8":
        return f"{report['model']} stays float32: {report.get('why', 'the guard failed')}"
    kept = report.get("float32_layers") or []
    text = (f"{report['model']} runs its encoder GEMMs in int8 ({report['weight_bits']}-bit weights, {report['isa']})"
            f" with {report['recipe']}")
    if report.get("from"):
        text += f", {report['from']}"
    if "mean_cosine" in report:
        text += (f"; guard on {report.get('sentences', 'its')} sentences: mean cosine {report['mean_cosine']:.4f}, "
                 f"1st percentile {report['p1_cosine']:.4f}")
        if "head_agreement" in report:
            text += f", head agreement {report['head_agreement']:.1%}"
    elif not report.get("guard", True):
        text += "; not checked (guard=False)"
    return text + (f"; kept in float32: {', '.join(kept)}" if kept else "")
