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
    done = _in_root("-c", "import transformers, fastbert, fastbert.kernels.attention, fastbert._C; "
                          "print(fastbert.BertModel.__module__)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "fastbert.models.bert"


def test_info_runs_from_the_repository_root():
    done = _in_root("-m", "fastbert.info")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fastbert" in done.stdout


def test_serve_help_runs_from_the_repository_root():
    done = _in_root("-m", "fastbert", "serve", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage" in done.stdout


def test_the_kernels_folder_never_shadows_pypi_kernels():
    # transformers >= 5.25 imports the PyPI package `kernels` from transformers.modeling_utils: from the repository
    # root, our kernels/ (installed as fastbert.kernels) must lose to it, and where it is absent transformers must
    # still find no `kernels` distribution (it checks the metadata too).
    assert not (ROOT / "kernels" / "__init__.py").exists(), "kernels/ must stay a namespace candidate only"
    probe = """
import importlib.metadata, importlib.util, os, sys
import transformers, transformers.modeling_utils, transformers.utils, fastbert
try:
    importlib.metadata.version("kernels")
    installed = True
except importlib.metadata.PackageNotFoundError:
    installed = False
if installed:
    import kernels
    where = os.path.abspath(kernels.__file__)
    assert not where.startswith(sys.argv[1] + os.sep), where
else:  # (transformers before 4.54 has no hub kernels at all)
    assert not getattr(transformers.utils, "is_kernels_available", lambda: False)()
print("installed" if installed else "absent")
"""
    done = _in_root("-c", probe, str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() in ("installed", "absent")



def test_the_installed_package_has_every_module_of_the_source():
    # A subpackage left out of setup.py installs a wheel that fails at `import fastbert` (an editable install hides
    # it): every module of the source, kernels/ being installed as fastbert.kernels, is found outside the checkout.
    def names(folder: Path, package: str) -> list[str]:
        return sorted(".".join([package, *path.relative_to(folder).with_suffix("").parts]).removesuffix(".__init__")
                      for path in folder.rglob("*.py"))

    wanted = names(ROOT / "fastbert", "fastbert") + names(ROOT / "kernels", "fastbert.kernels")
    # (finding a module imports its parents: one whose optional dependency is absent, as fastbert.serve without the
    # serve extra, says nothing about the install)
    find = """
import importlib.util, sys
missing = []
for name in sys.argv[1:]:
    try:
        if importlib.util.find_spec(name) is None:
            missing.append(name)
    except ModuleNotFoundError as error:
        if (error.name or "").startswith("fastbert"):
            missing.append(name)
print(missing)
"""
    done = subprocess.run([sys.executable, "-c", find, *wanted], cwd=ROOT.parent, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"not installed: {done.stdout.strip()}"
