"""benchmarks/gpu_check.sh, the GPU script, run in its --dry-run mode: both parts' steps on CPU with tiny shapes, so a
broken script is caught here rather than on a GPU machine; its pytest digest; and bench_kernels' ulp-aware tolerance
and its rows that record a failure instead of ending the table."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")

PART1 = ["install", "info", "smoke", "tests", "profile", "kernels-fp16", "sweep-fp16-s128", "sweep-fp16-s512"]
PART2 = ["install", "kernels-bf16", "sweep-bf16-s128", "sweep-bf16-s512", "sweep-families", "compile"]


def run_dry(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"), PYTHON=sys.executable)
    for name in ("GPU_CHECK_DRY_RUN", "GPU_CHECK_BUDGET_S"):
        env.pop(name, None)
    (tmp_path / "work").mkdir(exist_ok=True)
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def read_steps(archive: Path, folder: str) -> tuple[dict, list[str]]:
    """(the limits steps.txt opens with, {name: seconds}, checked to fit the budget; the lines of the steps run)."""
    with tarfile.open(archive) as tar:
        lines = tar.extractfile(f"{folder}/steps.txt").read().decode().splitlines()
    header = re.fullmatch(r"# limits \(s\): (.*) = (\d+); \+ (\d+) for the last pack \+ (\d+) for setup "
                          r"\(took \d+\) = (\d+) of the (\d+) s budget", lines[0])
    assert header, lines[0]
    listed, total, reserve, setup, used, budget = header.groups()
    limits = {name: int(s) for name, s in (item.rsplit(" ", 1) for item in listed.split(", "))}
    assert sum(limits.values()) == int(total)
    assert int(total) + int(reserve) + int(setup) == int(used) <= int(budget) == 540  # one 10-minute command each
    return limits, [line for line in lines[1:] if not line.startswith("install:")]


@needs_bash
def test_gpu_check_dry_run_of_both_parts(tmp_path):
    out = tmp_path / "out"
    run_dry(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]  # the device returns <= 8
    summary = (out / "summary.txt").read_text()
    limits, steps = read_steps(out / "gpu_check.tar.gz", "gpu_check")
    assert list(limits) == PART1[:1] + ["install-nocuda"] + PART1[1:]  # the retry runs only if install fails
    assert [line.split()[0] for line in steps] == PART1, steps
    for name in PART1:
        if name != "kernels-fp16":
            assert any(line.split()[:2] == [name, "ok"] for line in steps), (name, summary[:3000])
    assert "kernels-fp16     SKIPPED (dry run: needs CUDA)" in summary
    assert "smoke: 14/14 checks passed" in summary  # fp16, bf16 x (dense, packed, masked) x 2 fields + a graph
    assert re.search(r"^install: the first try .* ok$", summary, re.M)
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
        for name in ("env.txt", "steps.txt", "logs/smoke.log", "logs/tests.log", "tests/junit.xml",
                     "profile/profile.txt", "sweep/results.csv", "sweep/results.md"):
            assert f"gpu_check/{name}" in names, (name, sorted(names))
        rows = tar.extractfile("gpu_check/sweep/results.csv").read().decode().splitlines()
    # s128: b1 pad0, b2 pad0, b2 pad0.5; s512 (appended): b2 pad0, b2 pad0.5; x hf-sdpa, fastbert
    assert len(rows) == 1 + 5 * 2 and all(",fp16," in row and ",ok," in row for row in rows[1:])

    part1 = {p.name: p.read_bytes() for p in out.iterdir()}
    run_dry(tmp_path, "--part", "2")
    assert sorted(p.name for p in out.iterdir()) == sorted([*part1, "gpu_check-part2.tar.gz", "summary-part2.txt"])
    assert all((out / name).read_bytes() == data for name, data in part1.items())  # part 1's files left alone
    summary = (out / "summary-part2.txt").read_text()
    assert summary.startswith("gpu_check part 2 (dry-run)")
    limits, steps = read_steps(out / "gpu_check-part2.tar.gz", "gpu_check-part2")
    assert list(limits) == PART2[:1] + ["install-nocuda"] + PART2[1:]
    assert [line.split()[0] for line in steps] == PART2, steps
    # the install is skipped where the package already imports (as here, where the tests run), else done
    assert steps[0].split()[1] == "ok" or "SKIPPED (already installed)" in steps[0], steps[0]
    assert any(line.split()[:2] == ["sweep-bf16-s512", "ok"] for line in steps)
    assert any(line.split()[:2] == ["sweep-families", "ok"] for line in steps)
    assert "kernels-bf16     SKIPPED (dry run: needs CUDA)" in summary
    with tarfile.open(out / "gpu_check-part2.tar.gz") as tar:
        rows = tar.extractfile("gpu_check-part2/sweep/results.csv").read().decode().splitlines()
    # the bf16 sweep as part 1's, then the rotary + GLU models (gte-tiny, modernbert-tiny here): b2 pad0 and pad0.5
    # x 2 providers each
    bf16, rotary = rows[1:11], rows[11:]
    assert all(",bf16," in row and ",ok," in row for row in bf16), bf16
    assert len(rotary) == 8 and all(",ok," in row for row in rotary), rotary
    models = [row.split(",")[1] for row in rotary]
    assert models.count("gte-tiny") == models.count("modernbert-tiny") == 4, models


@needs_bash
def test_gpu_check_help_names_both_parts_and_refuses_others():
    help_text = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--part 1 (default)" in help_text and "--part 2" in help_text and "summary-part2.txt" in help_text
    bad = subprocess.run(["bash", str(SCRIPT), "--part", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--part takes 1 or 2" in bad.stderr


def run_tests_digest(log: Path) -> str:
    """The script's tests_digest function run on ``log``."""
    script = f'source <(sed -n "/^tests_digest() {{/,/^}}/p" "{SCRIPT}"); tests_digest "{log}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout


@needs_bash
def test_tests_digest_lists_failures_of_a_run_cut_short(tmp_path):
    """pytest -v with xdist, killed by its timeout before any summary: the failures, counts and the test that hung."""
    log = tmp_path / "tests.log"
    log.write_text("created: 2/2 workers\n"
                   "tests/a.py::test_ok[cuda] \n"
                   "[gw0] [ 12%] PASSED tests/a.py::test_ok[cuda] \n"
                   "tests/a.py::test_bad[cuda-a b] \n"
                   "[gw1] [ 25%] FAILED tests/a.py::test_bad[cuda-a b] \n"
                   "[gw0] [ 37%] ERROR tests/a.py::test_setup[cuda] \n"
                   "tests/b.py::test_hangs[cuda] \n")
    digest = run_tests_digest(log)
    assert digest.splitlines() == [
        "FAILED tests/a.py::test_bad[cuda-a b]",
        "ERROR tests/a.py::test_setup[cuda]",
        "no pytest summary (cut short); the -v lines so far: 1 passed, 1 failed, 1 errors, 0 skipped",
        "running when cut short: tests/b.py::test_hangs[cuda]",
    ]
    # finished, one process: the reasons come from the short summary, the counts from pytest's last line
    log.write_text("tests/a.py::test_ok[cuda] PASSED                        [ 50%]\n"
                   "tests/a.py::test_bad[cuda-a b] FAILED                   [100%]\n"
                   "=========================== short test summary info ============================\n"
                   "FAILED tests/a.py::test_bad[cuda-a b] - AssertionError: off by 3 ulps\n"
                   "========================= 1 failed, 1 passed in 0.10s ==========================\n")
    digest = run_tests_digest(log)
    assert digest.splitlines() == [
        "FAILED tests/a.py::test_bad[cuda-a b] - AssertionError: off by 3 ulps",
        "========================= 1 failed, 1 passed in 0.10s ==========================",
    ]


def _bench_kernels():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_kernels

    return bench_kernels


def test_bench_kernels_tolerance_is_in_ulps_of_the_output():
    bench_kernels = _bench_kernels()
    ref = torch.tensor([16.0, -3.0, 0.5], dtype=torch.bfloat16)
    assert bench_kernels.ulp_tolerance(ref, 2) == 2 * 2**-7 * 16  # bf16 eps = 2^-7, at max |ref| = 16
    half = torch.tensor([1.0, -0.25], dtype=torch.float16)
    assert bench_kernels.ulp_tolerance(half, 2) == 2 * 2**-10
    assert bench_kernels.ulp_tolerance(half * 0, 2) == torch.finfo(torch.float16).tiny
    # one bf16 ulp of rounding at the largest output passes; an error of 3 ulps does not
    exact = torch.tensor([15.97, 0.1])
    rounded = exact.to(torch.bfloat16)
    assert (rounded.float() - exact).abs().max() <= bench_kernels.ulp_tolerance(rounded, 2)
    assert 3 * 2**-7 * 16 > bench_kernels.ulp_tolerance(rounded, 2)


def test_bench_kernels_records_a_failing_row_and_goes_on(tmp_path):
    """A wrong kernel or one that raises gives a row with its status and no timings (nothing is timed, so no CUDA
    is needed here); the tables are written with those rows."""
    bench_kernels = _bench_kernels()
    x = torch.randn(4, 8, dtype=torch.float16)

    def raises():
        raise RuntimeError("launch failed | on purpose")

    never = lambda: pytest.fail("a failed case must not be timed")  # noqa: E731
    wrong = bench_kernels._case("wrong", "4x8", 128, 64, lambda: x + 1, never, lambda: x, 2)
    broken = bench_kernels._case("broken", "4x8", 128, 64, raises, never, lambda: x, 2)
    assert wrong["status"].startswith("mismatch: max abs error 1 > tol ")
    assert broken["status"] == "error: RuntimeError: launch failed | on purpose"
    for row in (wrong, broken):
        assert row["fastbert_ms"] is None and row["torch_ms"] is None and row["speedup"] is None
    lines = bench_kernels.write_tables(tmp_path, [wrong, broken], "# test", 1000.0)
    assert (tmp_path / "kernels.md").read_text().splitlines() == lines
    assert lines[-1].startswith("| broken | 4x8 | error: RuntimeError: launch failed \\| on purpose |")
    csv_rows = (tmp_path / "kernels.csv").read_text().splitlines()
    assert csv_rows[0].split(",") == bench_kernels.FIELDS and len(csv_rows) == 3
