"""The int8 decisions of ``fastbert.quantize``: applied again from a checkpoint's config, and reported.

``quantize`` writes its decision into each encoder's config (``int8.to_config``); loading that checkpoint through
fastbert (``optimize``, the Auto classes, a family class's ``from_pretrained``) calls ``apply_saved``, which chooses
the same Linears again where the weights and this CPU's weight bits are those the guard judged. Every decision,
taken or applied, is recorded here: logged on the ``fastbert`` logger (INFO) and listed in
``fastbert.info()["int8"]["models"]``.
"""

import collections
import logging
import threading

import torch
from torch import nn

from .. import announce
from ..ops import attention_int8
from . import choices as int8

logger = logging.getLogger("fastbert")

_lock = threading.Lock()
_reports = collections.deque(maxlen=32)


def has_saved(encoder: nn.Module) -> bool:
    """Whether ``encoder``'s config holds a decision saved by ``quantize``."""
    return getattr(encoder.config, int8.CONFIG_KEY, None) is not None


def apply_saved(model: nn.Module, encoders: list[nn.Module]) -> bool:
    """Choose int8 for the Linears of ``encoders`` (the fastbert encoders inside ``model``) as the decisions saved in
    their configs say; whether every encoder had one that fits (then all are applied, else none). A decision that does
    not fit the weights or this CPU is said and left unapplied."""
    if not encoders:
        return False
    bits = int8.weight_bits()
    found = []
    for encoder in encoders:
        choices, why = int8.from_config(encoder, bits)
        if choices is None:
            if why:
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
    attention = not attention_int8.unavailable_reasons()
    saved_attention = any(isinstance(choice, int) for _, choices in found for choice in choices.values())
    if saved_attention and not attention:
        announce.note(f"the int8 attention saved with {type(model).__name__}'s checkpoint does not run here "
                      f"({'; '.join(attention_int8.unavailable_reasons())}): its attention runs in float32")
    for encoder, choices in found:
        for module in encoder.modules():
            if type(module) is nn.Linear:
                int8.choose(module, choices.get(module))
            longest = choices.get(module)
            int8.choose_attention(module, longest if attention and isinstance(longest, int) else None)
    saved = getattr(encoders[0].config, int8.CONFIG_KEY)
    record(model, {"outcome": "int8", "guard": saved.get("guard", False), "recipe": saved.get("recipe"),
                   "float32_layers": saved.get("float32_layers", []),
                   "static_layers": saved.get("static_layers", []),
                   "attention_layers": saved.get("attention_layers", []) if attention else [],
                   **saved.get("figures", {}),
                   "from": "the decision saved with the checkpoint"})
    return True


def reports() -> list[dict]:
    """What each ``quantize`` call in this process decided, with the guard's figures, latest last."""
    with _lock:
        return list(_reports)


def record(model, report: dict) -> nn.Module:
    """Keep and log what was decided for ``model``; returns ``model``."""
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
    static = report.get("static_layers") or []
    if static:
        text += f", static activation scales in {len(static)} layer{'s' if len(static) > 1 else ''}"
    attention = report.get("attention_layers") or []
    if attention:
        text += f", int8 attention in {len(attention)} layer{'s' if len(attention) > 1 else ''}"
    if report.get("from"):
        text += f", {report['from']}"
    if "mean_cosine" in report:
        longest = f" (inputs of up to {report['longest_input']} tokens)" if "longest_input" in report else ""
        text += (f"; guard on {report.get('sentences', 'its')} sentences{longest}: mean cosine "
                 f"{report['mean_cosine']:.4f}, "
                 f"1st percentile {report['p1_cosine']:.4f}")
        if "head_agreement" in report:
            text += f", head agreement {report['head_agreement']:.1%}"
    elif not report.get("guard", True):
        text += "; not checked (guard=False)"
    return text + (f"; kept in float32: {', '.join(kept)}" if kept else "")
