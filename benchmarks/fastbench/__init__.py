"""fastbench: the benchmark harness behind ``benchmarks/bench.py`` (fastbert against Hugging Face, on real tokens).

Modules, each importable without running anything (``tests/test_bench_harness.py`` tests them):
    cases         padding (``make_lengths``), varied shapes (``varied_shapes``), FLOPs (``bert_flops``), the case
                  grid, the inputs
    check         the output check run before timing (``check_outputs``, ``OutputMismatch``)
    models        the model registry (``MODELS``) and one model's shared weights (``ModelSet``)
    providers     what is timed (``PROVIDERS``); ``ort_provider``: onnxruntime
    timing        CPU and GPU timing, host time, quantiles (``summarize``), machine load, RSS growth
    report        the results folder (``new_results_dir``), CSV schema (``COLUMNS``, ``write_csv``, ``CsvLog``),
                  results.md, plot.png
    summary       the verdict line (``verdict``) and the grouping of rows into cases
    env           device name and identity (``cpu_identity``, ``machine_slug``), versions, GPU settings, fastbert's
                  backends
    cli, run      the command line and the run (``main``)
"""

from .cases import (DTYPES, LENGTH_DISTRIBUTION, VARIED_DISTRIBUTION, Case, batch_inputs, bert_flops, make_cases,
                    make_inputs, make_lengths, pad_fraction, parse_lengths, varied_inputs, varied_shapes)
from .check import ATOL, FP32_ATOL, REFERENCE_DTYPE, Check, OutputMismatch, check_outputs
from .cli import DEFAULTS, QUICK, build_parser, resolve
from .models import MODELS, ModelSet, ModelSpec, minilm_path
from .providers import BASELINE, PROVIDERS, Provider, Unavailable
from .env import cpu_identity, machine_slug
from .report import (COLUMN_HELP, COLUMNS, MD_COLUMNS, CsvLog, fmt, new_results_dir, plot, read_csv, render_markdown,
                     write_csv)
from .run import main, run_case, write_results
from .summary import case_groups, verdict
from .timing import cpu_snapshot, other_cpu_pct, quantile, rss_mb, summarize

__all__ = [
    "ATOL", "BASELINE", "COLUMNS", "COLUMN_HELP", "Case", "Check", "CsvLog", "DEFAULTS", "DTYPES", "FP32_ATOL",
    "LENGTH_DISTRIBUTION", "MD_COLUMNS", "MODELS", "ModelSet", "ModelSpec", "OutputMismatch", "PROVIDERS", "Provider",
    "QUICK", "REFERENCE_DTYPE", "Unavailable", "VARIED_DISTRIBUTION", "batch_inputs", "bert_flops", "build_parser",
    "case_groups", "check_outputs", "cpu_identity", "cpu_snapshot", "fmt", "machine_slug", "main", "make_cases",
    "make_inputs", "make_lengths", "minilm_path", "new_results_dir", "other_cpu_pct", "pad_fraction",
    "parse_lengths", "plot", "quantile", "read_csv", "render_markdown", "resolve", "rss_mb", "run_case", "summarize",
    "varied_inputs", "varied_shapes", "verdict", "write_csv", "write_results",
]
