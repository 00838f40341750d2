"""``fastbert.quantize(model)``: the encoder's GEMMs in int8 on the CPU, kept only where real sentences say the
embeddings stay what they were.

    quantize(model, guard=True, texts=None, tokenizer=None, show_progress_bar=None, attention=True) -> model, in place

1. ``optimize(model)``, then every nn.Linear inside an encoder layer (per layer: QKV, attention output + residual,
   FFN in + activation, FFN out + residual) is chosen for int8 (``choices.py``). Embeddings, LayerNorms, pooler and
   heads stay float32; the fp32 parameters stay as they are (state_dict, ``save_pretrained``).
2. The guard (``guard.py``) compares the int8 model with float32 on real sentences and climbs a ladder of recipes
   (per-call scales, SmoothQuant with per-token scales, layers kept in float32) until they agree, or leaves the
   model float32 with a warning; where they agree, static activation scales calibrated on those sentences replace
   the per-call ones in the layers where the guard still passes, and the attention's two matmuls run in int8 too
   (``ops/attention_int8.py``, on CPUs with AVX-512 VNNI) if it still passes with them.
3. The decision goes into the encoder's config (``config.fastbert_int8``), so a saved model (``save_pretrained``,
   ``SentenceTransformer.save``) carries it: loading it through fastbert (``optimize``, the Auto classes, a family
   class's ``from_pretrained``) runs the same int8 GEMMs without the guard, where the weights and this CPU's weight
   bits are those it was judged with (``apply_saved``). ``quantize`` on such a model reuses it too, unless given
   ``texts``.

What was decided, with the guard's figures and the layers kept in float32, is logged on the ``fastbert`` logger (INFO)
and listed in ``fastbert.info()["int8"]["models"]`` (``decisions.py``).
"""

import torch
from torch import nn

from .. import announce, modeling
from ..optimize import accelerate
from . import choices as int8
from . import guard as int8_guard
from .decisions import apply_saved, record


def quantize(model: nn.Module, *, guard: bool = True, texts: list[str] | None = None, tokenizer=None,
             show_progress_bar: bool | None = None, attention: bool = True) -> nn.Module:
    """Run the GEMMs of every encoder layer in ``model`` in int8 on this CPU; returns ``model`` (changed in place).

    ``model``: anything ``fastbert.optimize`` accepts (fastbert and transformers models and heads,
    ``SentenceTransformer``, ``CrossEncoder``, PEFT models), float32, on the CPU.
    ``guard``: check the int8 model against float32 on ``texts`` first, and keep float32 where int8 would change the
    result (``guard.py``). ``texts``: your own sentences (default: fastbert's, or the decision saved with the
    checkpoint). ``tokenizer``: the model's tokenizer, for the guard (default: a ``SentenceTransformer``'s or
    ``CrossEncoder``'s own, else the one saved with the checkpoint). ``show_progress_bar``: the guard's (default:
    when stderr is a terminal). ``attention``: let the guard run the attention's q k^T and p v in int8 too where it
    passes with them (never without the guard). ``FASTBERT_CPU_INT8=off`` runs the chosen GEMMs and attention in
    float32 again.
    """
    if not isinstance(attention, bool):
        raise TypeError(f"attention must be True or False, got {attention!r}")
    encoders = _encoders(model)
    reasons = int8.unavailable_reasons()
    if reasons:
        announce.fallback(f"quantize left {type(model).__name__} in float32: int8 GEMMs do not run here "
                          f"({'; '.join(reasons)})")
        return record(model, {"outcome": "float32", "why": "; ".join(reasons)})
    layers = [layer for encoder in encoders for layer in int8_guard.layers_of(encoder)]
    if not any(layer.linears for layer in layers):
        announce.fallback(f"quantize found nothing to quantize in {type(model).__name__}: its encoder has no layer "
                          "with a Linear (num_hidden_layers=0?); it stays float32")
        return record(model, {"outcome": "float32", "why": "nothing to quantize: no encoder layer has a Linear"})
    bits = int8.weight_bits()
    if guard and texts is None and attention and apply_saved(model, encoders):
        return model
    if not guard:
        int8_guard.choose(layers, bits)
        outcome = {"outcome": "int8", "guard": False, "recipe": int8_guard.RECIPES[0].name, "float32_layers": []}
    else:
        outcome = {**int8_guard.run(model, encoders, layers, bits, texts, tokenizer, show_progress_bar, attention),
                   "guard": True}
    meta = {key: outcome[key] for key in ("recipe", "float32_layers", "static_layers", "attention_layers", "guard")
            if key in outcome}
    for encoder in encoders:  # (the decision, or none where the model stayed float32, goes with the checkpoint)
        int8.to_config(encoder, bits, {**meta, "figures": {k: v for k, v in outcome.items() if "cosine" in k
                                                           or "agreement" in k}})
    return record(model, outcome)


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
