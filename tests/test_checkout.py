"""Importing fastbert where a user stands after the README's install: the repository root, whose source folder
``fastbert/`` comes first on ``sys.path`` for ``python -c`` and ``python -m`` but lacks ``fastbert.kernels`` and the
compiled extension. The installed package must be what they get (fastbert/_checkout.py), installed normally or
editable."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (ROOT / "setup.py").exists() or not (ROOT / "fastbert").is_dir(),
                                reason="needs the source checkout the tests came from")


def _in_root(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})


def test_import_from_the_repository_root_gets_the_installed_package():
    done = _in_root("-c", "import fastbert, fastbert.kernels, fastbert._C; print(fastbert.BertModel.__module__)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "fastbert.models.bert"


def test_info_runs_from_the_repository_root():
    done = _in_root("-m", "fastbert.info")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fastbert" in done.stdout
