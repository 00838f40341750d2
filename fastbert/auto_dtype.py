"""``dtype="auto"``: where bits are not compared (``Embedder``, ``fastbert serve``), the CPU's fastest units.

On a CPU that multiplies bf16 in hardware (AVX512_BF16 or AMX: ``cpu.native_bf16``), bf16 GEMMs run 2x (AVX512_BF16)
to 6-8x (AMX) the float32 rate; OpenVINO, which users compare with, runs bf16 there by default. So ``auto`` picks
bf16 where:

- the model runs on the CPU in float32 (a GPU or a model loaded in another dtype keeps its dtype),
- this CPU has native bf16 and oneDNN's bf16 linear runs here (``cpu_gemm.unavailable_reasons``),
- and a guard passes: the model's token states, mean-pooled per sentence over fastbert's shipped sentences (the int8
  guard's, ``int8/guard_inputs.py``), have a cosine to float32's of at least ``MEAN_COSINE`` on average and
  ``WORST_COSINE`` for every sentence (OpenVINO's bf16 gives ~0.99999 / 0.99994 on the real all-MiniLM-L6-v2).

Elsewhere float32. ``choose`` returns the model to run (a bf16 copy, or the float32 model unchanged) and says what
it chose and why, once, and in ``fastbert.info()["auto_dtype"]``. The drop-in classes never change dtype: they stay
float32-exact unless the user asks torch for reduced-precision float32 matmuls
(``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``), which fastbert's oneDNN GEMMs follow as torch's do.
"""

import collections
import copy
import threading

import torch

from . import announce, cpu, cpu_gemm, threads
from .int8.guard_inputs import batches_of, usable_texts

MEAN_COSINE = 0.9999
WORST_COSINE = 0.999
NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_lock = threading.Lock()
_choices = collections.deque(maxlen=32)  # the latest choices, for fastbert.info()


def parse(dtype) -> torch.dtype | str:
    """A dtype argument (``"auto"``, a name in ``NAMES`` or a torch.dtype) -> "auto" or the torch.dtype; ValueError
    naming the argument otherwise."""
    if dtype == "auto" or dtype in NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in NAMES:
        return NAMES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r}: expected \"auto\" or one of {', '.join(NAMES)}")


def why_not_bf16(device: torch.device) -> str | None:
    """Why ``auto`` keeps float32 on ``device`` without judging (None: bf16 is judged by the guard)."""
    if device.type != "cpu":
        return f"auto picks bf16 on the CPU only (the model runs on {device.type})"
    if not cpu.native_bf16():
        return "this CPU has no native bf16 (no AVX512_BF16 or AMX): bf16 would be emulated, slower than float32"
    reasons = cpu_gemm.unavailable_reasons(torch.bfloat16)
    return f"oneDNN's bf16 linear does not run here ({reasons[0]})" if reasons else None


def choose(model: torch.nn.Module, tokenizer, name: str) -> tuple[torch.nn.Module, str]:
    """``model`` (float32, eval) in the dtype ``auto`` picks: (the model to run, what was chosen and why). ``name``:
    what the report calls it (a folder). The float32 model is dropped by the caller where a bf16 copy is returned."""
    weight = next(model.parameters(), None)
    if weight is None or weight.dtype != torch.float32:
        return model, _said(name, "float32" if weight is None else str(weight.dtype).removeprefix("torch."),
                            "the model is not float32: auto keeps its dtype")
    why = why_not_bf16(weight.device)
    if why is not None:
        return model, _said(name, "float32", why)
    try:
        texts, _ = usable_texts(tokenizer, None)
    except ValueError as error:  # (a vocabulary that reads fastbert's sentences as unknown tokens: nothing to judge)
        return model, _said(name, "float32", f"the bf16 guard cannot judge this model: {error}")
    encoder = getattr(model, "base_model", model)
    batches = batches_of(tokenizer, texts, [encoder])
    # (in a short-lived thread: one-time work leaves the caller's thread without an OpenMP pool, ``threads.py``)
    reference = threads.in_own_thread(_pooled, encoder, batches)
    candidate = copy.deepcopy(model).to(torch.bfloat16)
    pooled = threads.in_own_thread(_pooled, getattr(candidate, "base_model", candidate), batches)
    cosines = torch.nn.functional.cosine_similarity(pooled, reference, dim=-1)
    mean, worst = float(cosines.mean()), float(cosines.min())
    figures = f"cosine to float32 on {len(cosines)} sentences: mean {mean:.6f}, worst {worst:.6f}"
    if mean >= MEAN_COSINE and worst >= WORST_COSINE:
        return candidate, _said(name, "bfloat16", f"this CPU has native bf16 and the guard passed ({figures})")
    return model, _said(name, "float32", f"the bf16 guard failed ({figures}; it needs a mean of {MEAN_COSINE} and "
                                         f"{WORST_COSINE} at worst)")


@torch.inference_mode()
def _pooled(encoder: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    """[sentences, hidden] float32: each sentence's last hidden state, mean-pooled over its real tokens."""
    pooled = []
    for batch in batches:
        accepted = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        states = encoder(**accepted).last_hidden_state.float()  # [B, S, H]
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled.append((states * mask).sum(1) / mask.sum(1).clamp_min(1))
    return torch.cat(pooled)


def _said(name: str, chosen: str, why: str) -> str:
    report = f"{name}: dtype=auto runs {chosen}: {why}"
    with _lock:
        _choices.append(report)
    announce.note(report)
    return report


def report() -> dict:
    """``fastbert.info()["auto_dtype"]``: what ``auto`` would judge on this CPU, and what it chose so far."""
    why = why_not_bf16(torch.device("cpu"))
    with _lock:
        chosen = list(_choices)
    return {"cpu": "bfloat16 where its guard passes" if why is None else f"float32 ({why})", "chosen": chosen}
