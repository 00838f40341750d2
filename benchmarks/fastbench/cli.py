"""The command line: flags, the --quick preset, defaults, and their resolution into one options namespace."""

from __future__ import annotations

import argparse
import copy

import torch

from .cases import DTYPES, LENGTH_DISTRIBUTION, VARIED_DISTRIBUTION, parse_lengths
from .check import ATOL, FP32_ATOL
from .models import MODELS
from .providers import BASELINE, PROVIDERS, provider_missing

QUICK = dict(models="bert-base,minilm", dtype="fp32", batch="1,8", seq_len="128", pad_ratio="0,0.5",
             providers="hf-eager,hf-sdpa,fastbert,ort", reps=5, warmup=1, varied_shapes=20)
DEFAULTS = dict(models="bert-base,bert-large,minilm", batch="1,8,32", seq_len="128,512", pad_ratio="0,0.5",
                reps=None, warmup=2, varied_shapes=0)


def _csv_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    def provider_line(p):
        why = provider_missing(p.name)
        return f"  {p.name:<16} {p.help}" + (f"\n  {'':<16} [unavailable here: {why}]" if why else "")

    providers = "\n".join(provider_line(p) for p in PROVIDERS.values())
    models = "\n".join(f"  {name:<17} {spec.help}" for name, spec in MODELS.items())
    epilog = (
        f"providers:\n{providers}\n\nmodels:\n{models}\n\n"
        f"padding (pad_ratio):\n  {LENGTH_DISTRIBUTION}\n\n"
        f"varied shapes:\n  {VARIED_DISTRIBUTION} Timed with time.perf_counter per call (synchronized on a GPU); "
        "rss_growth_mb: what the process's resident memory gained during each provider's timed calls.\n\n"
        f"output check: before timing, every provider's last_hidden_state must match {BASELINE} on real tokens: "
        f"fp32 max abs diff <= {FP32_ATOL:g}, else (and for fp16/bf16) max|out-ref| <= 2*max|hf-ref| + atol "
        f"(atol {ATOL}) with ref = HF in fp64 (fp32 runs) or fp32 (fp16/bf16 runs); a mismatch exits non-zero "
        "(with --keep-going: recorded in the status column, the run goes on, exit status 1 at the end).\n\n"
        "timing: CPU time.perf_counter, median of --reps calls after --warmup; GPU triton do_bench (L2 flushed), "
        "--reps rounds, plus host_ms (CPU-side time of one forward); providers interleaved round-robin in one "
        "process.\n\n"
        f"--quick = --models {QUICK['models']} --dtype fp32 --batch 1,8 --seq-len 128 --pad-ratio 0,0.5 "
        f"--providers {QUICK['providers']} --reps 5 --warmup 1 --varied-shapes {QUICK['varied_shapes']} (explicit "
        "flags override; providers that do not run on the device are dropped with a note).\n\n"
        "output: results.csv, results.md and plot.png in --out, by default a new folder "
        "benchmarks/results/<machine>-<UTC date>/ (e.g. cpu-amd-epyc-2core-2026-11-24; -2, -3, ... when it exists); "
        "the last line printed is the verdict: fastbert's real tok/s ratio to each other provider (range over the "
        "cases, cases where it was slower; where only its variants ran, such as fastbert-int8, the first of them "
        "speaks) and whether every output matched HF.\n\n"
        "acceptance cases (see benchmarks/README.md):\n"
        "  --device cpu --models bert-base --dtype fp32 --batch 8 --seq-len 128 --pad-ratio 0 --providers "
        "hf-sdpa,fastbert\n"
        "  --device cpu --models bert-base --dtype fp32 --lengths 256,200,150,110,80,60,40,24 --providers "
        "hf-sdpa,fastbert"
    )
    p = argparse.ArgumentParser(prog="bench.py", description="fastbert vs Hugging Face BERT inference benchmark.",
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CPU-friendly subset (a few minutes on 2 cores), see below")
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
    p.add_argument("--varied-shapes", type=int, metavar="N",
                   help="add a varied-shapes case per model and dtype: N timed calls, each a new batch shape drawn "
                   "with batch <= max --batch and lengths <= max --seq-len (see below; default 0 = none, --quick "
                   f"{QUICK['varied_shapes']})")
    p.add_argument("--gpu-rep-ms", type=int, default=100, help="do_bench window per round, ms (default 100)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="weights, token ids and lengths (default 0)")
    p.add_argument("--out", help="directory for results.csv, results.md, plot.png (default: a new folder "
                   "benchmarks/results/<machine>-<UTC date>/, suffixed -2, -3, ... when that exists)")
    p.add_argument("--append", action="store_true", help="add to the rows already in --out/results.csv (needs --out)")
    p.add_argument("--keep-going", action="store_true",
                   help="record an output mismatch or a provider error in the status column and go on (exit status "
                   "1 at the end); with --out, results.csv gets each case's rows as soon as the case completes")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def resolve(ns: argparse.Namespace, log=print) -> argparse.Namespace:
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
    if ns.providers is not None:
        o.providers = _csv_list(ns.providers)
    elif "providers" in preset:  # a preset's providers that do not run on this device are dropped, not an error
        o.providers = _csv_list(preset["providers"])
        dropped = [n for n in o.providers if o.device not in PROVIDERS[n].devices]
        if dropped:
            log(f"note: --quick on {o.device}: {', '.join(dropped)} dropped (not a provider for {o.device})")
        o.providers = [n for n in o.providers if n not in dropped]
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
    o.varied_shapes = pick("varied_shapes") or 0
    if o.varied_shapes < 0:
        raise SystemExit(f"--varied-shapes must be >= 0, got {o.varied_shapes}")
    o.reps = pick("reps") or (5 if o.device == "cuda" else 10)
    o.warmup = pick("warmup") if pick("warmup") is not None else 2
    if o.reps < 1 or o.warmup < 0:
        raise SystemExit("--reps must be >= 1 and --warmup >= 0")
    if o.reps < 5:
        log(f"note: --reps {o.reps} < 5: medians of so few runs are for smoke tests, not for results")
    if o.append and not o.out:
        raise SystemExit("--append needs --out")
    return o
