"""What fastbert runs here: versions, the native extension's build, the CPU and its threads, and the backend of each
op with the reasons faster ones were skipped. ``fastbert.info()`` returns it as a dict; ``python -m fastbert.info``
prints a short summary of it (``--json``: the dict).
"""

import argparse
import importlib.metadata
import json
import platform
import sys
import types

import torch

from . import __version__, _extension, announce, auto_dtype, cpu, dispatch, models, replay, threads, token_indices
from . import validation
from .int8 import choices as int8
from .int8 import decisions as int8_decisions
from .ops import attention_cpu, attention_int8
from .optimize import reports as optimize_reports

GEMM_NAMES = {"native": "fastbert's int8 GEMM", "onednn": "oneDNN's int8 GEMM"}  # (int8.report()'s "gemm")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def info() -> dict:
    ext = _extension.build_info()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    backends, reasons = dispatch.report(device, dtype)
    return {
        "versions": {
            "fastbert": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "triton": _version("triton"),
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "ext_cpu": bool(ext.get("cpu")),
        "ext_openmp": bool(ext.get("openmp")),
        "ext_cuda": bool(ext.get("cuda")),
        "ext_cuda_version": ext.get("cuda_version"),
        "cuda_archs": list(ext.get("archs", [])),
        "cuda_ptx": ext.get("ptx"),
        "ext_cuda_skipped_because": ext.get("cuda_skip_reason"),
        "ext_error": ext.get("error"),
        "requested_backend": dispatch.settings().backend,
        "triton_interpret": dispatch.settings().interpreter,
        "input_checks": validation.input_checks_enabled(),
        # Why inputs on the host are not prepared in one native pass (token_indices.py) but op by op; empty: they are.
        "native_inputs_unavailable": list(token_indices.unavailable_reasons()),
        # The CPU: its name, the instruction sets that decide the fast paths, whether bf16 is native here.
        "cpu": {**cpu.identity(), "native_bf16": cpu.native_bf16()},
        # The threads a CPU forward runs: torch's count within the affinity mask, the cgroup quota and the load.
        "threads": threads.report(),
        # The C++ CPU attention (float32 and bfloat16 inference): the instruction sets it runs with here, or why it
        # does not, and its GFLOP/s against torch's SDPA as measured on this CPU (once per machine, dtype and head
        # dim, at the first CPU forward of a model with them), under "<dtype>, head_dim <d>".
        "cpu_attention": {"isas": attention_cpu.attention_cpu_isas(),
                          "unavailable": attention_cpu.attention_cpu_unavailable_reasons(),
                          "measured_gflops": cpu.attention_figures_so_far()},
        # CPU GEMM library: FASTBERT_CPU_GEMM, and what was measured on this CPU (GFLOP/s per token count, once per
        # machine and dtype; "source": measured now, or the file that holds this machine's figures).
        "cpu_gemm": {
            "requested": dispatch.settings().cpu_gemm,
            "margin": cpu.GEMM_MARGIN,
            "measured_gflops": {str(d).removeprefix("torch."): g for d, g in cpu.gemm_figures_so_far().items()},
        },
        # CPU int8 (fastbert.quantize): whether it runs here and on which ISA path, the measured GFLOP/s, why the int8
        # attention cannot run here (empty: it can), and what each quantize() call decided, with its guard's
        # figures, the layers it kept in float32 and those whose attention runs in int8.
        # dtype="auto" (Embedder, fastbert serve): what it picks on this CPU, and what it chose for each model so far.
        "auto_dtype": auto_dtype.report(),
        "int8": {**int8.report(),
                 "attention_unavailable": int8.unavailable_reasons() + attention_int8.unavailable_reasons(),
                 "models": int8_decisions.reports()},
        # CPU replay (replay/): FASTBERT_CPU_REPLAY, the encoder forwards captured and replayed in this process, and
        # why captures were dropped (those shapes run op by op).
        "replay": {"requested": dispatch.settings().cpu_replay, **replay.report()},
        "backends": backends,
        "reasons": reasons,
        # Calls a chosen backend declined at run time, which the next backend ran ("op: backend declined (why)" ->
        # calls): what really ran, beside what was decided.
        "declined": dispatch.declines(),
        # What this process has fallen back from so far (reason -> times): dtypes without a kernel, gradients,
        # options run by transformers' implementation, wrapped modules called as modules.
        "fallbacks": announce.seen(),
        # What this process was told besides (note -> times): outputs that differ from transformers', slow settings.
        "notes": announce.notes(),
        # What fastbert.optimize (and the Auto classes) accelerated in this process, latest last.
        "optimized": optimize_reports(),
        # The families: fastbert's model class -> "accelerated", or why the installed transformers rules it out.
        "families": {**{model.__name__: "accelerated" for model in models.MODELS}, **models.UNAVAILABLE},
    }


def summary(report: dict) -> str:
    """``info()``'s dict as a few lines a person reads."""
    versions = report["versions"]
    cpu_info, threads_info = report["cpu"], report["threads"]
    flags = [flag for flag, present in cpu_info["flags"].items() if present]
    last_forward = "" if threads_info["last_forward"] is None else (
        f"; the last CPU forward ran {threads_info['last_forward']}" + (
            f", other processes keeping about {threads_info['others_cpus']:g} CPUs busy"
            if threads_info["adapts_to_load"] else ""))
    lines = [f"fastbert {versions['fastbert']}: torch {versions['torch']}, transformers {versions['transformers']}, "
             f"triton {versions['triton'] or 'not installed'}, Python {versions['python']}",
             f"CPU: {cpu_info['model']}, {cpu_info['cores']} CPUs ({' '.join(flags) or 'no AVX2'})",
             f"threads: {threads_info['limit']} ({threads_info['why']}; torch's: {threads_info['torch']})"
             + ("; fewer while other processes keep the CPUs busy" if threads_info["adapts_to_load"] else "")
             + last_forward]
    if report["ext_error"]:
        lines.append(f"extension: not loaded: {report['ext_error']}")
    else:
        cuda = (f"CUDA {report['ext_cuda_version']} kernels for {', '.join(report['cuda_archs'])}"
                if report["ext_cuda"] else f"no CUDA kernels ({report['ext_cuda_skipped_because']})")
        lines.append(f"extension fastbert._C: CPU kernels{' with OpenMP' if report['ext_openmp'] else ''}; {cuda}")
    lines.append(f"GPU: {report['device']}" if report["device"] != "cpu" else "GPU: none (torch sees no CUDA device)")
    lines.append("families: " + ", ".join(name.removesuffix("Model") + ("" if state == "accelerated" else " (no: "
                                                                        + state + ")")
                                          for name, state in report["families"].items()))
    lines.append(f"backends for {report['device']} {report['dtype']}"
                 + (f" (FASTBERT_BACKEND={report['requested_backend']})" if report["requested_backend"] != "auto"
                    else "") + ":")
    width = max(len(op) for op in report["backends"])
    for op, backend in report["backends"].items():
        skipped = [r for r in report["reasons"][op] if not r.startswith("triton: on CPU")]
        lines.append(f"  {op:<{width}}  {backend}" + (f"  ({'; '.join(skipped)})" if skipped else ""))
    if report["device"] == "cpu" and not report["triton_interpret"]:
        lines.append("  (Triton kernels run on GPUs; on the CPU torch's ops and fastbert's C++ kernels are the "
                     "fast path)")
    lines.append(f"dtype=auto (Embedder, fastbert serve): {report['auto_dtype']['cpu']}")
    lines += [f"  {chosen}" for chosen in report["auto_dtype"]["chosen"]]
    int8_report = report["int8"]
    lines.append(f"int8 (fastbert.quantize): {'runs' if int8_report['available'] else 'does not run'} here, "
                 f"{int8_report['isa']}, {GEMM_NAMES[int8_report['gemm']]}" + ("" if int8_report["available"] else
                                            f" ({'; '.join(int8_report['reasons'])})"))
    unavailable = int8_report["attention_unavailable"]
    lines.append("  its attention in int8 (where the guard passes): "
                 + (f"does not run here ({'; '.join(unavailable)})" if unavailable else "runs here"))
    replayed = report["replay"]
    lines.append(f"CPU replay (FASTBERT_CPU_REPLAY={replayed['requested']}): {replayed['captured']} encoder forwards "
                 f"captured, {replayed['replayed']} replayed" + "".join(
                     f"; dropped: {why} (x{n})" for why, n in replayed["dropped"].items()))
    for title, key in (("fallbacks so far", "fallbacks"), ("notes so far", "notes"),
                       ("declined at run time (the next backend ran them)", "declined")):
        if report[key]:
            lines.append(f"{title}:")
            lines += [f"  - {message} (x{count})" for message, count in report[key].items()]
    if report["optimized"]:
        lines.append("optimized: " + "; ".join(report["optimized"]))
    lines.append("details: python -m fastbert.info --json")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fastbert.info", description="What fastbert runs here, and why.")
    parser.add_argument("--json", action="store_true", help="the whole report as JSON (fastbert.info()'s dict)")
    args = parser.parse_args(argv)
    report = info()
    print(json.dumps(report, indent=2) if args.json else summary(report))


class _CallableModule(types.ModuleType):
    """Lets ``fastbert.info()`` call this module, which ``python -m fastbert.info`` runs."""

    def __call__(self) -> dict:
        return info()


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
