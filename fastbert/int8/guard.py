"""The accuracy guard of ``fastbert.quantize``: int8 against float32 on real sentences, and the ladder of recipes it
climbs until they agree.

The guard runs its texts (default: ``data/int8_guard.txt``, 59 sentences in several languages, code and log lines,
5-128 tokens; sentences mostly unknown to the tokenizer are left out, and texts that are mostly unknown tokens are
refused: they would compare nothing but the unknown token's embedding) through the float32 model and the int8 one
and compares, per sentence, the mean-pooled embeddings of every encoder (cosine) and, for a classification head, its
logits (argmax agreement, cosine). It passes at mean cosine >= 0.99, 1st percentile >= 0.98, agreement >= 99 %. It
tries, in turn (``RECIPES``):

a. one activation scale per GEMM call (bias, activation and residual in the GEMM's epilogue);
b. SmoothQuant: each GEMM input x divided per channel by s_j = max|x_j|^0.5 / max|W_j|^0.5 (max over the sentences
   and the Linears sharing that input) and W multiplied by it, so outlier channels of the activation move into the
   weight, which has a scale per row; and one scale per token for the input of the MLP's output GEMM (after GELU:
   the heaviest tail);
c. SmoothQuant and per-token scales for every GEMM;

then keeps the layers whose int8 costs most (each measured alone) in float32, one at a time; and if every layer but
one had to, leaves the model float32, with a warning.

Where a recipe passes, the inputs it scales per call get static scales instead, calibrated on half of the sentences
(every other batch: the range of x / smooth over their real tokens, recorded in the first int8 run) and judged on all
of them, so that the other half shows what values past the calibrated range do: no range is taken at run time. In
every layer if the guard still passes; else in the layers where static scales cost least (each measured alone), as
many as keep it passing; the others keep their per-call scales.

Then, where the int8 attention runs (``ops/attention_int8.py``: AVX-512 VNNI) and ``quantize`` was not told
``attention=False``, the attention of every such layer with a quantizable one (no window or position terms) runs q k^T
and p v in int8 too, on sequences no longer than the longest the guard ran, if the guard still passes with it; else
none does. Besides its sentences (up to 128 tokens) the guard runs them back to back in up to two inputs of up to 512
tokens (or the model's limit): long inputs are judged too.
"""

import collections
import contextlib
import inspect
import sys
import typing

import torch
from torch import nn
from transformers import PreTrainedModel

from .. import announce, modeling, threads
from ..ops import attention_int8
from ..run import Run
from . import choices as int8
from .guard_inputs import batches_of, longest_input, tokenizer_of, usable_texts

# What the int8 model must keep of the float32 one on the guard's sentences.
MIN_MEAN_COSINE = 0.99
MIN_P1_COSINE = 0.98
MIN_HEAD_AGREEMENT = 0.99
SMOOTH_ALPHA = 0.5


class _Layer(typing.NamedTuple):
    name: str
    linears: list[nn.Linear]  # every nn.Linear of the layer
    mlp_out: list[nn.Linear]  # those reading the MLP's activation (input width != hidden): the heaviest-tailed input
    attention: list[nn.Module]  # its modules whose attention can run in int8 (``quantizable_attention``)


def layers_of(encoder: modeling.FusedModel) -> list[_Layer]:
    """The encoder's layers: the module list holding ``num_hidden_layers`` of them, whatever the family calls it."""
    count, hidden = encoder.config.num_hidden_layers, encoder.config.hidden_size
    for name, module in encoder.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            layers = []
            for i, layer in enumerate(module):
                # (a Linear the fused path runs on other rows than the tokens, in float32, is not chosen: DeBERTa's
                # position projections, ``Fused.float32_linears``)
                float32 = {id(getattr(m, name, None)) for m in layer.modules()
                           for name in getattr(m, "float32_linears", ())}
                linears = [m for m in layer.modules() if type(m) is nn.Linear and id(m) not in float32]
                mlp_out = [m for m in linears if m.in_features != hidden]
                attention = [m for m in layer.modules() if getattr(m, "quantizable_attention", False)]
                layers.append(_Layer(f"{type(encoder).__name__}.{name}.{i}", linears, mlp_out, attention))
            return layers
    raise ValueError(f"no list of {count} layers found in {type(encoder).__name__}")


class _Recipe(typing.NamedTuple):
    name: str
    smooth: bool  # SmoothQuant divisors from the first int8 run's activation ranges
    per_token: str  # which inputs get one scale per token: "none", "mlp_out" or "all"


# Tried in turn until the guard passes, cheapest first: one scale per GEMM call keeps bias, activation and residual
# in the GEMM's epilogue; per-token scales cost an elementwise pass or two after oneDNN's GEMM (fastbert's own GEMM
# scales each row in its epilogue). (all-MiniLM-L6-v2 on the guard's sentences, 8-bit weights: per call 0.9916 mean /
# 0.9604 1st-percentile cosine; with SmoothQuant and per-token scales on the MLP's output GEMM 0.9982 / 0.9903; per
# token everywhere 0.9985 / 0.9910.)
RECIPES = (
    _Recipe("per-call activation scales", False, "none"),
    _Recipe("SmoothQuant, per-token scales into the MLP's output GEMM", True, "mlp_out"),
    _Recipe("SmoothQuant, per-token scales everywhere", True, "all"),
)


def choose(layers: list[_Layer], bits: int | None, recipe: _Recipe = RECIPES[0], smooth: dict | None = None,
            float32: frozenset = frozenset(), static: dict | None = None) -> None:
    """Every Linear of ``layers`` in int8 with ``bits`` as ``recipe`` says (None: all float32), ``smooth[linear]`` its
    divisor, the layers named in ``float32`` left out; ``static`` {linear: (scale, zero point)}: those inputs'
    fixed scales (where the recipe does not scale them per token). Every attention float32 (``_int8_attention``
    chooses it after)."""
    for layer in layers:
        for module in layer.attention:
            int8.choose_attention(module, None)
        for linear in layer.linears:
            choice = None
            if bits is not None and layer.name not in float32:
                per_token = _per_token(recipe, layer, linear)
                fixed = None if per_token else (static or {}).get(linear)
                choice = int8.Choice(bits, (smooth or {}).get(linear) if recipe.smooth else None, per_token, fixed)
            int8.choose(linear, choice)


def _per_token(recipe: _Recipe, layer: _Layer, linear: nn.Linear) -> bool:
    """Whether ``recipe`` gives ``linear``'s input one scale per token."""
    return recipe.per_token == "all" or (recipe.per_token == "mlp_out" and linear in layer.mlp_out)


# --- the guard -------------------------------------------------------------------------------------------------------


def run(model, encoders, layers: list[_Layer], bits: int, texts: list[str] | None, tokenizer,
        show_progress_bar: bool | None, attention: bool = True) -> dict:
    """Choose int8 for ``layers`` as the guard allows (module docstring), in a thread of its own (a process forked
    afterwards keeps its OpenMP threads); returns what was chosen, with the guard's figures."""
    tokenizer = tokenizer_of(model, tokenizer, encoders)
    texts, left_out = usable_texts(tokenizer, texts)
    batches = batches_of(tokenizer, texts, encoders)
    if show_progress_bar is None:
        show_progress_bar = sys.stderr.isatty()
    with _evaluating(model), _Progress(show_progress_bar, len(batches)) as progress:
        outcome = threads.in_own_thread(_ladder, model, encoders, layers, batches, bits, progress,
                                        longest_input(batches) if attention else None)
    return {**outcome, "sentences": len(texts), "longest_input": longest_input(batches),
            **({"left_out_unknown": left_out} if left_out else {})}


@torch.inference_mode()
def _ladder(model, encoders, layers: list[_Layer], batches, bits, progress, attention: int | None) -> dict:
    """The first of ``RECIPES`` the guard passes with, else the last one with the costliest layers in float32 until
    it passes (then with int8 attention up to ``attention`` tokens, the longest input of ``batches``, where it still
    passes; None: never); the guard's figures and what was chosen."""
    def outputs(calibration: dict | None = None):
        return _outputs(model, encoders, batches, progress, calibration)

    choose(layers, None)
    reference = outputs()
    smooth = ranges = None
    for recipe in RECIPES:
        choose(layers, bits, recipe, smooth)
        calibration = {} if ranges is None else None
        with int8.recording() as seen:  # (the GEMM inputs' ranges: SmoothQuant's divisors, static scales)
            figures = _compare(reference, outputs(calibration))
        if ranges is None:
            ranges, smooth = calibration, _smoothing(layers, seen)
        if _passes(figures):
            static, figures = _static_where_it_passes(layers, bits, recipe, smooth, ranges, figures,
                                                      lambda: _compare(reference, outputs()), progress)
            quantized, figures = _int8_attention(layers, attention, figures, lambda: _compare(reference, outputs()),
                                                 progress) if attention else ([], figures)
            return {"outcome": "int8", "recipe": recipe.name, "float32_layers": [], "static_layers": static,
                    "attention_layers": quantized, **figures}
    float32, costs = [], {}
    names = [layer.name for layer in layers]
    progress.more(2 * len(names) - 1)
    for name in names:  # each layer alone in int8: what it costs
        choose(layers, bits, recipe, smooth, frozenset(n for n in names if n != name))
        costs[name] = 1.0 - _compare(reference, outputs())["mean_cosine"]
    for name in sorted(costs, key=costs.get, reverse=True)[:-1]:
        float32.append(name)
        choose(layers, bits, recipe, smooth, frozenset(float32))
        figures = _compare(reference, outputs())
        if _passes(figures):
            return {"outcome": "int8", "recipe": recipe.name, "float32_layers": float32, **figures}
    choose(layers, None)
    announce.fallback(f"quantize left {type(model).__name__} in float32: int8 GEMMs changed its embeddings beyond "
                      "the guard's limits (SmoothQuant and per-token scales included) unless every layer but one "
                      "stayed float32")
    return {"outcome": "float32", "why": "the guard failed", "recipe": recipe.name, **figures}


def _static_where_it_passes(layers: list[_Layer], bits: int, recipe: _Recipe, smooth: dict, ranges: dict,
                            figures: dict, judge, progress) -> tuple[list[str], dict]:
    """Static scales for ``recipe`` (passing with per-call ones, ``figures``) where the guard still passes (module
    docstring): (the names of the layers given them, the guard's figures with them)."""
    static = {linear: int8.static_qparams(*ranges[linear], smooth.get(linear) if recipe.smooth else None)
              for layer in layers for linear in layer.linears
              if linear in ranges and not _per_token(recipe, layer, linear)}
    names = [layer.name for layer in layers if any(linear in static for linear in layer.linears)]
    if not names:  # (every input scaled per token)
        return [], figures
    progress.more(1)
    choose(layers, bits, recipe, smooth, static=static)
    everywhere = judge()
    if _passes(everywhere):
        return names, everywhere

    def only(chosen, judged: bool = True) -> dict | None:  # static scales in the layers named in ``chosen``
        choose(layers, bits, recipe, smooth, static={m: q for layer in layers if layer.name in chosen
                                                     for m in layer.linears if (q := static.get(m)) is not None})
        return judge() if judged else None

    progress.more(len(names) + max(1, len(names).bit_length()))
    costs = {name: 1.0 - only([name])["mean_cosine"] for name in names}
    order = sorted(names, key=costs.get)
    # the longest prefix of the cheapest layers that passes (its first layer alone, none at all: both may fail)
    best, best_figures, low, high = 0, figures, 1, len(order) - 1
    while low <= high:
        middle = (low + high) // 2
        tried = only(order[:middle])
        if _passes(tried):
            best, best_figures, low = middle, tried, middle + 1
        else:
            high = middle - 1
    only(order[:best], judged=False)
    return order[:best], best_figures


def _int8_attention(layers: list[_Layer], longest: int, figures: dict, judge, progress) -> tuple[list[str], dict]:
    """The attention of every layer that has a quantizable one in int8 on sequences of up to ``longest`` tokens (the
    longest the guard runs), where the kernel runs here, if the guard still passes (module docstring) having run it:
    (the names of those layers, the guard's figures with it); else none, and ``figures``."""
    candidates = [layer for layer in layers if layer.attention]
    if not candidates or attention_int8.unavailable_reasons():
        return [], figures
    progress.more(1)
    for layer in candidates:
        for module in layer.attention:
            int8.choose_attention(module, longest)
    with Run(tally=collections.Counter()) as watch:
        quantized = judge()
    # (only if every attention of the judged forwards ran the kernel: a dense batch with padding under unpad=False
    # runs torch's float32 SDPA, FASTBERT_BACKEND=torch never the kernel)
    ran, fell_back = watch.tally[attention_int8.LAUNCHED], watch.tally[attention_int8.DECLINED]
    if ran and not fell_back and _passes(quantized):
        return [layer.name for layer in candidates], quantized
    for layer in candidates:
        for module in layer.attention:
            int8.choose_attention(module, None)
    return [], figures


def _smoothing(layers: list[_Layer], ranges: dict) -> dict:
    """{linear: s [in]}: SmoothQuant's s_j = max|x_j|^a / max|W_j|^(1 - a), shared by Linears reading one input (q,
    k and v; up and gate), which the stacked GEMMs quantize once."""
    absmax = {linear: torch.maximum(-low, high) for linear, (low, high) in ranges.items()}
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


def _outputs(model, encoders, batches, progress, calibration: dict | None = None) -> dict[str, torch.Tensor]:
    """{"embeddings": [sentences, sum of widths] mean-pooled, per encoder side by side; "logits": a classification
    head's logits at what it classifies, [items, labels]} (no "logits" without such a head). ``calibration``: also
    keeps the int8 GEMM inputs' ranges of every other batch there (``int8.recording``, which sees all of them)."""
    head = _classification_head(model, encoders)
    pooled, logits = [], []
    for index, batch in enumerate(batches):
        mask = batch["attention_mask"].unsqueeze(-1).float()  # [B, S, 1]
        calibrating = calibration is not None and index % 2 == 0
        with int8.recording() if calibrating else contextlib.nullcontext() as seen:
            states = [e(**_accepted(e, batch)).last_hidden_state for e in encoders]  # [B, S, H] each
        if calibrating:
            int8.merge_ranges(seen)  # (into the recording around this call, if any)
            int8.merge_ranges(seen, calibration)
        pooled.append(torch.cat([(s * mask).sum(1) / mask.sum(1).clamp_min(1) for s in states], dim=-1))
        if head is not None:
            out = head(**_accepted(head, batch)).logits
            logits.append(out if out.dim() == 2 else out[batch["attention_mask"].bool()])  # [items, labels]
        progress.update()
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


class _Progress:
    """A tqdm bar over the guard's forward batches (or nothing), its total grown when the ladder climbs."""

    def __init__(self, shown: bool, batches: int):
        self.bar, self.batches = None, batches
        if shown:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=batches * (1 + len(RECIPES)), desc="fastbert.quantize guard", unit="batch")

    def update(self):
        if self.bar is not None:
            self.bar.update()

    def more(self, passes: int):
        if self.bar is not None:
            self.bar.total += passes * self.batches
            self.bar.refresh()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


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
