"""benchmarks/gpu_check.sh, the one-call GPU script, run in its --dry-run mode: the same steps on CPU with tiny shapes,
so a broken script is caught here rather than on a GPU machine; and bench_kernels' ulp-aware tolerance."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_check_dry_run_packs_every_step(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, OUT=str(out), GPU_CHECK_WORK=str(work), PYTHON=sys.executable)
    env.pop("GPU_CHECK_DRY_RUN", None)
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]  # the device returns <= 8

    summary = (out / "summary.txt").read_text()
    for name in ("install", "info", "smoke", "tests", "profile", "sweep-s128", "sweep-s512"):
        assert any(line.split()[:2] == [name, "ok"] for line in summary.splitlines()), (name, summary[:3000])
    assert "kernels-f16  SKIPPED (dry run: needs CUDA)" in summary
    assert "smoke: 14/14 checks passed" in summary  # fp16, bf16 x (dense, packed, masked) x 2 fields + a graph

    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
        for name in ("env.txt", "steps.txt", "logs/smoke.log", "logs/tests.log", "tests/junit.xml",
                     "profile/profile.txt", "sweep/results.csv", "sweep/results.md"):
            assert f"gpu_check/{name}" in names, (name, sorted(names))
        rows = tar.extractfile("gpu_check/sweep/results.csv").read().decode().splitlines()
    # s128: b1 pad0, b2 pad0, b2 pad0.5; s512 (appended): b2 pad0, b2 pad0.5; x hf-sdpa, fastbert
    assert len(rows) == 1 + 5 * 2 and all(",ok," in row for row in rows[1:])


def test_bench_kernels_tolerance_is_in_ulps_of_the_output():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_kernels

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
