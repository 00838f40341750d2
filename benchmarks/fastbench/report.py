"""Results: the folder they go to, the CSV schema (written whole, or row by row as cases complete), results.md, and
plot.png."""

from __future__ import annotations

import csv
import math
import os

from .providers import BASELINE
from .summary import case_groups, number, timed

# benchmarks/results/: where a run without --out writes, in a folder named for the machine and the date
RESULTS_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")

COLUMNS = [
    "provider", "model", "device", "device_name", "dtype", "batch", "seq_len", "pad_ratio", "length_dist",
    "real_tokens", "median_ms", "p20_ms", "p80_ms", "real_tokens_per_s", "speedup_vs_hf_sdpa", "peak_mem_mb",
    "host_ms", "gflop", "tflops", "pct_matmul_peak", "matmul_peak_tflops", "check_max_err", "check_tol", "status",
    "reps", "threads", "other_cpu_pct", "rss_growth_mb",
    "fastbert_backends", "torch_version", "transformers_version", "triton_version", "fastbert_version", "date",
    "command",
]
COLUMN_HELP = {
    "provider": "what ran (see --help)",
    "model": "bert-base / bert-large / bert-tiny / minilm-l6-random / xlm-roberta-base / distilbert-base / gte-base / "
             "nomic-base / modernbert-base / mpnet-base (random weights, seeded) or minilm (real weights)",
    "device": "cpu or cuda",
    "device_name": "CPU model name or GPU name",
    "dtype": "fp32 / fp16 / bf16 of weights and activations",
    "batch": "rows in the batch",
    "seq_len": "padded length: the input tensors are [batch, seq_len]",
    "pad_ratio": "achieved fraction of the batch*seq_len positions that are padding (varied shapes: over all the "
                 "timed calls' batches)",
    "length_dist": "how the real lengths were made: pad_ratio=X (the seeded distribution), explicit:L0/L1/... "
                   "(--lengths) or varied:N shapes b1-B s1-S seedK (--varied-shapes: a new batch shape every call)",
    "real_tokens": "number of real (non-padding) tokens in the batch (varied shapes: in all the timed calls)",
    "median_ms, p20_ms, p80_ms": "quantiles 0.5 / 0.2 / 0.8 of the time of one forward, ms (varied shapes: over "
                                 "calls of different sizes)",
    "real_tokens_per_s": "real_tokens / median: padding tokens are not counted (varied shapes: real_tokens / the "
                         "sum of the timed calls' times)",
    "speedup_vs_hf_sdpa": "hf-sdpa median / this provider's median, same case, same process (varied shapes: the "
                          "ratio of the summed times over the same sequence of batches)",
    "peak_mem_mb": "GPU only: max_memory_allocated during one forward minus memory_allocated before it (activations "
                   "and workspace, not weights). Blank on CPU",
    "host_ms": "GPU only: median host (CPU-side) time of one forward from an idle GPU until the Python call returns, "
               "the wait for the GPU excluded (a device read-back inside the forward does wait). Close to median_ms: "
               "host-bound (launch overhead). Blank on CPU",
    "gflop": "FLOPs of one forward on real tokens (bert_flops: 2x weights per token + attention 4*S_b*H per token "
             "and layer; biases, LayerNorm, softmax, embeddings, pooler left out), in GFLOP (varied shapes: of all "
             "the timed calls)",
    "tflops": "gflop / median (varied shapes: / the summed time): achieved TFLOP/s on real tokens",
    "pct_matmul_peak": "GPU only: tflops as % of matmul_peak_tflops",
    "matmul_peak_tflops": "GPU only: an 8192^3 torch.matmul in the row's dtype, timed with do_bench in the same run",
    "check_max_err, check_tol": "checked providers: the output check's error and tolerance (see the README)",
    "status": "ok (checked, then timed); with --keep-going also 'mismatch: ...' or 'error: ...' (not timed)",
    "reps": "CPU: timed calls per provider; GPU: do_bench rounds per provider; varied shapes: timed calls (= new "
            "shapes) per provider",
    "threads": "torch.get_num_threads()",
    "other_cpu_pct": "% of all the machine's CPU time used by OTHER processes while the case was timed (Linux "
                     "/proc/stat minus this process; blank elsewhere). Near 0: a quiet machine; CPU timings with more "
                     "than a few % are inflated by contention",
    "rss_growth_mb": "growth of the process's resident memory (RSS) during this provider's timed calls, summed over "
                     "them, MB (Linux; blank elsewhere); warm-up excluded. Varied shapes: what N new shapes cost in "
                     "memory (caches that grow per shape: oneDNN primitives, onnxruntime's arena); fixed shapes: "
                     "near 0",
    "fastbert_backends": "fastbert's backend per op for this device and dtype (fastbert.dispatch.report)",
    "*_version, date, command": "versions, the run's date (UTC) and the exact command line",
}
MD_COLUMNS = [  # (CSV column, table title); text columns are left-aligned
    ("provider", "provider"), ("model", "model"), ("dtype", "dtype"), ("threads", "threads"), ("batch", "batch"),
    ("seq_len", "seq_len"), ("pad_ratio", "pad"), ("length_dist", "lengths"), ("real_tokens", "real tok"),
    ("median_ms", "median ms"), ("p20_ms", "p20 ms"),
    ("p80_ms", "p80 ms"), ("real_tokens_per_s", "real tok/s"), ("speedup_vs_hf_sdpa", "vs hf-sdpa"),
    ("peak_mem_mb", "peak MB"), ("host_ms", "host ms"), ("tflops", "TFLOP/s"), ("pct_matmul_peak", "% mm peak"),
    ("rss_growth_mb", "RSS +MB"), ("status", "status"),
]
_MD_TEXT = ("provider", "model", "dtype", "length_dist", "status")


def new_results_dir(name: str) -> str:
    """RESULTS_ROOT/name, or name-2, name-3, ... when that already exists: an earlier run is never overwritten."""
    path, n = os.path.join(RESULTS_ROOT, name), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(RESULTS_ROOT, f"{name}-{n}")
    return path


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


def _case_label(row: dict, show: tuple[str, ...]) -> str:
    """Two or three short lines naming a case: model and dtype, the shape, device and threads when they vary."""
    if str(row.get("length_dist", "")).startswith("varied:"):
        shape = f"{row['reps']} varied shapes, b<={row['batch']}, s<={row['seq_len']}"
    else:
        shape = f"b{row['batch']} x {row['seq_len']}, pad {number(row['pad_ratio']) or 0.0:.2f}"
        if str(row.get("length_dist", "")).startswith("explicit:"):
            shape += " (lengths given)"
    lines = [f"{row['model']} {row['dtype']}", shape]
    if show:
        lines.append(" ".join(f"{row[k]}" + (" threads" if k == "threads" else "") for k in show))
    return "\n".join(lines)


def plot(rows: list[dict], path, title: str) -> bool:
    """Horizontal grouped bars, one group per case: each provider's real tokens/s relative to hf-sdpa's
    (speedup_vs_hf_sdpa) on a linear axis, hf-sdpa's 1.0 a vertical line, each bar labelled with its ratio. A
    provider not timed in a case (a mismatch or error recorded by --keep-going) is marked there. False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    groups = case_groups(rows)
    providers = [p for p in dict.fromkeys(r["provider"] for r in rows) if p != BASELINE]
    show = tuple(k for k in ("device", "threads") if len({str(r.get(k)) for r in rows}) > 1)
    slot = 0.8 / max(len(providers), 1)
    ratios = [number(r.get("speedup_vs_hf_sdpa")) for r in rows if timed(r)]
    right = max([1.0] + [r for r in ratios if r is not None]) * 1.18
    fig, ax = plt.subplots(figsize=(10.0, 1.2 + len(groups) * (0.35 + 0.22 * len(providers))))
    for i, provider in enumerate(providers):
        ys, xs = [], []
        for c, group in enumerate(groups):
            row = next((r for r in group if r["provider"] == provider), None)
            y = c + (i - (len(providers) - 1) / 2) * slot
            if row is None:
                continue
            if not timed(row):
                ax.text(0.01 * right, y, f"{provider}: not timed ({str(row.get('status')).split(':')[0]})",
                        va="center", fontsize=7, color="firebrick")
                continue
            ys.append(y)
            xs.append(number(row["speedup_vs_hf_sdpa"]))
        ax.barh(ys, xs, slot * 0.9, label=provider)
        for y, x in zip(ys, xs):
            ax.text(x + 0.01 * right, y, f"{x:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1.2, label=f"{BASELINE} = 1.0")
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([_case_label(g[0], show) for g in groups], fontsize=8)
    ax.set_ylim(len(groups) - 0.5, -0.5)  # the first case on top
    ax.set_xlim(0, right)
    ax.set_xlabel(f"real tokens/s relative to {BASELINE} (> 1: faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a bar
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
