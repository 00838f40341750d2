"""Int8 choices: which Linears (and attentions) run in int8, what the guard records of their inputs, and whether int8
runs on this CPU at all. ``fastbert.quantize`` (``quantize.py``) chooses the Linears; the GEMM op's ``int8`` backend
(``ops/gemm.py``) runs them, where this module says int8 runs.

- A Linear chosen for int8 carries a ``Choice`` (weight bits, SmoothQuant divisor) in its ``__dict__``: no parameter
  or buffer, so state_dict, ``save_pretrained`` and the fp32 weights are untouched. Its quantized weight is a cache
  derived from the fp32 weight (``derived.py``): rebuilt after any write to it, empty in copies and pickles.
- The activation range of each GEMM is taken over the rows that are real tokens (``run.real_rows``): packed batches
  carry spare rows after them, dense batches with ``unpad=False`` carry padding. So padding never widens it, and a
  sentence's embedding does not depend on its batch beyond the range its batch mates set.
- Int8 runs where the CPU runs its int8 GEMM (fastbert's own with 7-bit weights, oneDNN's with 8), it measures
  faster than the fp32 GEMM that would run otherwise (``cpu.int8_figures``, once per machine, like the fp32 GEMM
  choice; ``FASTBERT_CPU_INT8=on`` skips that test, ``off`` keeps float32), the model is float32 on the CPU and no
  gradient is needed: training runs the fp32 GEMMs, said once.
"""

import base64
import hashlib

import torch
from torch import nn

from .. import cpu, derived, dispatch, plan, run
from . import linear as int8_linear

ATTRIBUTE = "_fastbert_int8"  # on a chosen nn.Linear: its Choice
ATTENTION = "_fastbert_int8_attention"  # on a module whose attention runs in int8 (ops/attention_int8.py): up to
# how many tokens
CONFIG_KEY = "fastbert_int8"  # in an encoder's config: its Choices, saved and loaded with the checkpoint
CONFIG_VERSION = 1

# CPUs that sum u8 x s8 products in int32 (VNNI, AMX) multiply 8-bit weights exactly; the others saturate (module
# docstring of linear.py) and get 7-bit weights.
_INT32_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
# Int8 replaces the fp32 GEMM only when at least this much faster at every measured size (as cpu.GEMM_MARGIN).
INT8_MARGIN = 1.1


class Choice:
    """How one Linear runs in int8: ``bits`` of weight, ``smooth`` [in] (the SmoothQuant divisor) or None, and
    whether its input gets one scale per token (``per_token``), one per call, or the fixed (scale, zero point)
    ``static`` that the guard calibrated (of x / smooth)."""

    __slots__ = ("bits", "smooth", "per_token", "static")

    def __init__(self, bits: int, smooth: torch.Tensor | None = None, per_token: bool = False,
                 static: tuple[float, int] | None = None):
        if per_token and static is not None:
            raise ValueError("an input is quantized per token or with a static scale, not both")
        if static is not None:
            int8_linear.check_static(*static)
        self.bits, self.smooth, self.per_token, self.static = bits, smooth, per_token, static


def choose(linear: nn.Linear, choice: Choice | None) -> None:
    """Run ``linear`` in int8 as ``choice`` says (None: in fp32); its quantized weight is rebuilt, and the next
    forward of every model decides its ops again."""
    if choice is None:
        linear.__dict__.pop(ATTRIBUTE, None)
    else:
        linear.__dict__[ATTRIBUTE] = choice
    derived.clear(linear)
    plan.converted()


def chosen(linear: nn.Module) -> Choice | None:
    return linear.__dict__.get(ATTRIBUTE)


def choose_attention(module: nn.Module, longest: int | None) -> None:
    """Run the attention of ``module`` (a fused module whose class has ``quantizable_attention``) in int8 for batches
    whose sequences have at most ``longest`` tokens (the longest the guard judged it on), or always in float32
    (None); the next forward of every model decides its ops again."""
    if longest is not None and (isinstance(longest, bool) or not isinstance(longest, int) or longest < 1):
        raise ValueError(f"longest must be None or a token count >= 1, got {longest!r}")
    if attention_chosen(module) != longest:
        if longest is None:
            module.__dict__.pop(ATTENTION, None)
        else:
            module.__dict__[ATTENTION] = longest
        plan.converted()


def attention_chosen(module: nn.Module) -> int | None:
    """The longest sequence whose attention ``module`` runs in int8, or None (float32)."""
    return module.__dict__.get(ATTENTION)


# --- choices that travel with the checkpoint ------------------------------------------------------------------------
# An encoder's choices go into its config (``config.fastbert_int8``), which every way of saving a model writes
# (``save_pretrained`` of the encoder or of a head around it, ``SentenceTransformer.save``, the Hub) and transformers
# reads back as an attribute it ignores. The fp32 weights stay the checkpoint's; the config holds, per Linear (by
# its name under the encoder), the per-token flag and the SmoothQuant divisor (float32, base64), the weight bits, a
# digest of the weights the guard judged, so a decision is never applied to other weights, and the modules whose
# attention runs in int8, with the longest sequence it was judged on.


def weights_digest(linears: dict[str, nn.Linear]) -> str:
    """A digest of sampled words of each Linear's weight (as ``derived.state`` samples them), by name."""
    digest = hashlib.sha256()
    for name in sorted(linears):
        digest.update(name.encode() + bytes(derived._sampled(linears[name].weight.detach().float().contiguous())))
    return digest.hexdigest()[:32]


def to_config(encoder: nn.Module, bits: int, meta: dict) -> None:
    """Write the choices of ``encoder``'s Linears, with ``meta`` (recipe, guard figures), into its config."""
    linears, entries, attention = {}, {}, {}
    for name, module in encoder.named_modules():
        if attention_chosen(module) is not None:
            attention[name] = attention_chosen(module)
        choice = chosen(module)
        if choice is None:
            continue
        linears[name] = module
        entry = {"per_token": choice.per_token}
        if choice.static is not None:
            entry["static"] = [float(choice.static[0]), int(choice.static[1])]
        if choice.smooth is not None:
            entry["smooth"] = base64.b64encode(choice.smooth.float().contiguous().numpy().tobytes()).decode("ascii")
        entries[name] = entry
    if not entries:
        encoder.config.__dict__.pop(CONFIG_KEY, None)
        return
    setattr(encoder.config, CONFIG_KEY, {"version": CONFIG_VERSION, **meta, "weight_bits": bits,
                                         "weights": weights_digest(linears), "linears": entries,
                                         "attention": attention})


def from_config(encoder: nn.Module, bits: int) -> tuple[dict[nn.Module, Choice | int] | None, str]:
    """(the Linears and Choices ``encoder``'s config holds, and the modules whose attention runs in int8 with the
    longest sequence it was judged on, or None; why not, when there is a saved decision that does not fit this model
    or CPU)."""
    saved = getattr(encoder.config, CONFIG_KEY, None)
    if saved is None:
        return None, ""
    modules = dict(encoder.named_modules())
    try:
        if saved["version"] != CONFIG_VERSION:
            return None, f"it was saved by another fastbert (format {saved['version']})"
        if saved["weight_bits"] != bits:
            return None, (f"it was judged with {saved['weight_bits']}-bit weights and this CPU runs {bits}-bit ones "
                          "(run fastbert.quantize(model) again here)")
        choices, named = {}, {}
        for name, entry in saved["linears"].items():
            linear = modules.get(name)
            if type(linear) is not nn.Linear:
                return None, f"the model has no nn.Linear {name!r}"
            smooth = None
            if "smooth" in entry:
                smooth = torch.frombuffer(bytearray(base64.b64decode(entry["smooth"])), dtype=torch.float32)
                if smooth.shape != (linear.in_features,):
                    return None, f"the divisor of {name!r} has {smooth.numel()} values, not {linear.in_features}"
            static = None
            if "static" in entry:  # (anything but a valid pair raises ValueError or TypeError: Choice checks it)
                scale, zero_point = entry["static"]
                static = (float(scale), zero_point)
            choices[linear], named[name] = Choice(bits, smooth, bool(entry["per_token"]), static), linear
        if weights_digest(named) != saved["weights"]:
            return None, "the weights differ from those it was judged on (run fastbert.quantize(model) again)"
        for name, longest in saved.get("attention", {}).items():  # (saved before int8 attention: none)
            module = modules.get(name)
            if not getattr(module, "quantizable_attention", False):
                return None, f"the model has no module {name!r} whose attention can run in int8"
            if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
                return None, f"the longest sequence judged for {name!r} is not a token count: {longest!r}"
            choices[module] = longest
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        return None, f"it cannot be read ({type(error).__name__}: {error})"
    return choices, ""


# --- the CPU --------------------------------------------------------------------------------------------------------


def isa_path() -> str:
    """The instruction set the int8 GEMMs run on here, as ``fastbert.info()`` names it."""
    flags = cpu.identity()["flags"]
    for flag in _INT32_DOT_FLAGS:
        if flags[flag]:
            return f"{flag} (8-bit weights)"
    return "avx2 without VNNI (7-bit weights, exact u8 x s8 products)" if flags["avx2"] else "no AVX2 (7-bit weights)"


def weight_bits() -> int:
    flags = cpu.identity()["flags"]
    return 8 if any(flags[flag] for flag in _INT32_DOT_FLAGS) else 7


def unavailable_reasons() -> list[str]:
    """Why int8 GEMMs do not run on this machine with these settings (empty: they do)."""
    if dispatch.settings().cpu_int8 == "off":
        return [f"{dispatch.ENV_CPU_INT8}=off"]
    reasons = int8_linear.unavailable_reasons(weight_bits())
    if not reasons and dispatch.settings().cpu_int8 == "auto":  # ("on": wherever it runs, measured or not)
        slower = cpu.int8_slower_reason(weight_bits(), INT8_MARGIN)
        reasons += [slower] if slower else []
    return reasons


def runs_in(model: nn.Module) -> bool:
    """Whether some Linear of ``model`` runs its GEMM in int8 here (chosen by ``fastbert.quantize``, int8 available)."""
    return any(chosen(m) is not None for m in model.modules()) and not unavailable_reasons()


# --- what the GEMM inputs hold: SmoothQuant's divisors and the static scales are computed from it ---------------------
# (the activation range of each GEMM is taken over the real tokens only: ``run.real_rows``, from the forward's layout)


class recording:
    """``with recording() as ranges:`` the int8 GEMMs run here (in the forwards inside it) keep, per Linear, the
    smallest and largest value of each input channel over the real tokens, ``ranges[linear] = (low [in], high [in])``
    (what ``fastbert.quantize`` smooths by and calibrates static scales with): a ``run.Run`` watching those forwards
    (they run op by op, in float32 between the GEMMs: see ``ops/mlp.py``, ``replay/``)."""

    def __enter__(self) -> dict:
        self.watch = run.Run(ranges={})
        return self.watch.__enter__().ranges

    def __exit__(self, *exc):
        self.watch.__exit__(*exc)


def is_recording() -> bool:
    """Whether the forward running here is recorded (``recording``)."""
    current = run.current()
    return current is not None and current.ranges is not None


def record(linears: tuple[nn.Module, ...], x: torch.Tensor) -> None:
    """While ``recording``: the smallest and largest value of each input channel over the real tokens, per Linear."""
    current = run.current()
    if current is None or current.ranges is None:
        return
    rows = current.real_rows(x)
    low, high = torch.aminmax(x[:rows] if isinstance(rows, int) else x.index_select(0, rows), dim=0)  # [in] each
    merge_ranges({linear: (low, high) for linear in linears}, current.ranges)


def merge_ranges(ranges: dict, into: dict | None = None) -> None:
    """Widen ``into`` (default: the ``recording`` around this call, if any) by ``ranges``."""
    if into is None:
        current = run.current()
        into = None if current is None else current.ranges
    if into is None:
        return
    for linear, (low, high) in ranges.items():
        if linear in into:
            low, high = torch.minimum(into[linear][0], low), torch.maximum(into[linear][1], high)
        into[linear] = (low, high)


def static_qparams(low: torch.Tensor, high: torch.Tensor, smooth: torch.Tensor | None) -> tuple[float, int]:
    """The (scale, zero point) of u8 covering every recorded value of x / smooth (per-channel ``low`` and ``high``
    [in]: dividing by a positive divisor keeps each channel's extremes)."""
    if smooth is not None:
        low, high = low / smooth, high / smooth
    return int8_linear.qparams(float(low.min()), float(high.max()))


def report() -> dict:
    """``fastbert.info()["int8"]``: whether int8 runs here, why not, on which ISA path and GEMM ("native":
    fastbert._C's, "onednn"), what was measured."""
    reasons = unavailable_reasons()
    return {
        "available": not reasons,
        "reasons": reasons,
        "requested": dispatch.settings().cpu_int8,
        "isa": isa_path(),
        "weight_bits": weight_bits(),
        "gemm": int8_linear.gemm_library(weight_bits()),
        "margin": INT8_MARGIN,
        "measured_gflops": cpu.int8_figures_so_far(),
    }
