"""Results: the CSV schema (written whole, or row by row as cases complete), results.md, and plot.png."""

from __future__ import annotations

import csv
import math
import os

COLUMNS = [
    "provider", "model", "device", "device_name", "dtype", "batch", "seq_len", "pad_ratio", "length_dist",
    "real_tokens", "median_ms", "p20_ms", "p80_ms", "real_tokens_per_s", "speedup_vs_hf_sdpa", "peak_mem_mb",
    "host_ms", "gflop", "tflops", "pct_matmul_peak", "matmul_peak_tflops", "check_max_err", "check_tol", "status",
    "reps", "threads", "other_cpu_pct",
    "fastbert_backends", "torch_version", "transformers_version", "triton_version", "fastbert_version", "date",
    "command",
]
COLUMN_HELP = {
    "provider": "what ran (see --help)",
    "model": "bert-base / bert-large / bert-tiny / minilm-l6-random / xlm-roberta-base / distilbert-base (random "
             "weights, seeded) or minilm (real weights)",
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
    "host_ms": "GPU only: median host (CPU-side) time of one forward from an idle GPU until the Python call returns, "
               "the wait for the GPU excluded (a device read-back inside the forward does wait). Close to median_ms: "
               "host-bound (launch overhead). Blank on CPU",
    "gflop": "FLOPs of one forward on real tokens (bert_flops: 2x weights per token + attention 4*S_b*H per token "
             "and layer; biases, LayerNorm, softmax, embeddings, pooler left out), in GFLOP",
    "tflops": "gflop / median: achieved TFLOP/s on real tokens",
    "pct_matmul_peak": "GPU only: tflops as % of matmul_peak_tflops",
    "matmul_peak_tflops": "GPU only: an 8192^3 torch.matmul in the row's dtype, timed with do_bench in the same run",
    "check_max_err, check_tol": "checked providers: the output check's error and tolerance (see the README)",
    "status": "ok (checked, then timed); with --keep-going also 'mismatch: ...' or 'error: ...' (not timed)",
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
    ("peak_mem_mb", "peak MB"), ("host_ms", "host ms"), ("tflops", "TFLOP/s"), ("pct_matmul_peak", "% mm peak"),
    ("status", "status"),
]
_MD_TEXT = ("provider", "model", "dtype", "length_dist", "status")


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


def _writer(f) -> csv.DictWriter:
    return csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="raise")


def write_csv(rows: list[dict], path) -> None:
    """Write ``rows`` with exactly COLUMNS as the header (missing cells blank, unknown keys rejected)."""
    with open(path, "w", newline="") as f:
        writer = _writer(f)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: fmt(v) for k, v in row.items()})


def read_csv(path) -> list[dict]:
    """Rows of a results.csv as strings, in COLUMNS (columns an older file lacks read as '')."""
    with open(path, newline="") as f:
        return [{c: row.get(c, "") or "" for c in COLUMNS} for row in csv.DictReader(f)]


class CsvLog:
    """results.csv written as the run goes: each case's rows appended and flushed as soon as the case completes, so
    a run that is killed keeps what it measured. ``append``: keep the rows already in ``path`` (re-written in the
    current schema first)."""

    def __init__(self, path, append: bool = False):
        self.path = path
        old = read_csv(path) if append and os.path.exists(path) else []
        write_csv(old, path)

    def add(self, rows: list[dict]) -> None:
        with open(self.path, "a", newline="") as f:
            writer = _writer(f)
            for row in rows:
                writer.writerow({k: fmt(v) for k, v in row.items()})
            f.flush()
            os.fsync(f.fileno())


def render_markdown(rows: list[dict], meta: dict[str, str], notes: list[str] = ()) -> str:
    """results.md: a header (``meta`` as a list, the notes, the commands that made the rows) and one table row per
    row."""
    lines = ["# fastbert benchmark results", ""]
    lines += [f"- **{k}**: {v}" for k, v in meta.items()]
    if notes:
        lines += ["- **notes**:"] + [f"  - {n}" for n in notes]
    commands = list(dict.fromkeys(str(r.get("command", "")) for r in rows if r.get("command")))
    if commands:
        lines += ["- **commands**:"] + [f"  - `{c}`" for c in commands]
    lines += ["", "| " + " | ".join(title for _, title in MD_COLUMNS) + " |",
              "|" + "|".join("---" if key in _MD_TEXT else "---:" for key, _ in MD_COLUMNS) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(key)).replace("|", "/") for key, _ in MD_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path, title: str) -> bool:
    """Grouped bars of real tokens/s: one group per case, one bar per provider (log scale). False without matplotlib.
    Rows without a time (a mismatch recorded by --keep-going) are left out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def case_key(r):
        return (r["model"], r["dtype"], r["device"], str(r["threads"]), str(r["batch"]), str(r["seq_len"]),
                f"{float(r['pad_ratio']):.2f}")

    rows = [r for r in rows if r.get("real_tokens_per_s") not in (None, "")]
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
    if providers:
        ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
