#!/usr/bin/env python
"""Run transformers' own model tests of the BERT family three times -- plain transformers, fastbert's classes
rebound in as ``transformers.BertModel``, ``RobertaModel``, ..., and every such model passed through
``fastbert.optimize()`` -- and list every test that passes with plain transformers but not with fastbert.

    python tests/hf_suite/run.py                                   # transformers sdist from PyPI (see README.md)
    TRANSFORMERS_TESTS=/path/to/transformers python tests/hf_suite/run.py
    python tests/hf_suite/run.py -k "attention or hidden_states"   # a subset
    python tests/hf_suite/run.py --modes rebind                    # reuse the last baseline (same selection)
    python tests/hf_suite/run.py --compare-only                    # re-read the last results, run nothing

Exit status: 0 when every test that passed with plain transformers also passed in each fastbert mode, 1 when some
did not (or a stand-in was not active), 2 when the suite could not be set up, the baseline passed nothing, or a
mode's results are not comparable with the baseline's (another selection of tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("none", "rebind", "optimize")
# transformers' per-model test files, run when the tree has them (a checkout; the sdist does not ship them)
MODEL_TESTS = tuple(f"tests/models/{family}/test_modeling_{family}.py"
                    for family in ("bert", "roberta", "xlm_roberta", "camembert", "electra", "distilbert", "gte", "nomic_bert",
                                   "modernbert", "mpnet", "deberta_v2", "deberta"))
OWN_SUITES = ("bert_common_suite.py", "family_common_suite.py")
FAILING = ("failed", "error")

# Support modules transformers' tests/test_modeling_common.py, test_configuration_common.py and test_pipeline_mixin.py
# import, which the PyPI sdist does not ship (it has only the top-level tests/*.py). When a checkout lacks one, the
# prepared copy gets this minimal stand-in; the tests the real module would add (generate, export) then do not run.
SHIMS = {
    "tests/__init__.py": "",
    "tests/generation/__init__.py": "",
    "tests/generation/test_utils.py": (
        "# Written by fastbert's tests/hf_suite/run.py: this transformers checkout has no tests/generation/test_utils.py\n"
        "# (the PyPI sdist ships only tests/*.py), so transformers' generate() tests are not run.\n\n\n"
        "class GenerationTesterMixin:\n    pass\n"
    ),
    "tests/exporters/__init__.py": "",
    "tests/exporters/test_export.py": (
        "# Written by fastbert's tests/hf_suite/run.py: this transformers checkout has no tests/exporters/test_export.py\n"
        "# (the PyPI sdist ships only tests/*.py), so transformers' export tests are not run.\n\n\n"
        "class ExportTesterMixin:\n    pass\n"
    ),
    "tests/utils/__init__.py": "",
    "tests/utils/test_configuration_utils.py": (
        "# Written by fastbert's tests/hf_suite/run.py: this transformers checkout has no\n"
        "# tests/utils/test_configuration_utils.py. Only ConfigTester reads this; fastbert does not touch configs.\n"
        "config_common_kwargs = {}\n"
    ),
    "tests/utils/tiny_model_summary.json": "{}\n",
}


_LOG: list[str] = []


def log(msg: str = "") -> None:
    _LOG.append(msg)
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------------------
# Getting transformers' tests
# --------------------------------------------------------------------------------------------------------------


def installed_transformers_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


def download_sdist(version: str, workdir: Path) -> Path:
    """transformers' sdist for ``version`` from PyPI, unpacked under workdir (cached). Returns the source root."""
    root = workdir / f"transformers-{version}"
    if (root / "tests" / "test_modeling_common.py").exists():
        return root
    dl = workdir / "download"
    dl.mkdir(parents=True, exist_ok=True)
    archive = dl / f"transformers-{version}.tar.gz"
    if not archive.exists():
        log(f"downloading the transformers {version} sdist from PyPI ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"transformers=={version}", "-d", str(dl)],
            check=True,
        )
        found = sorted(dl.glob(f"transformers-{version}.tar.gz"))
        if not found:
            raise SystemExit(f"pip download left no transformers-{version}.tar.gz in {dl}")
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    if not (root / "tests" / "test_modeling_common.py").exists():
        raise SystemExit(f"{archive} has no tests/test_modeling_common.py")
    return root


def find_root(path: Path) -> Path:
    """The transformers source root for a path to it or to its tests/ folder."""
    path = path.expanduser().resolve()
    for candidate in (path, path.parent):
        if (candidate / "tests" / "test_modeling_common.py").exists():
            return candidate
    raise SystemExit(f"{path}: no tests/test_modeling_common.py here or in its parent (want a transformers source tree)")


def prepare_tree(root: Path, workdir: Path) -> tuple[Path, list[str]]:
    """The tree the tests run in, under workdir: tests/ holds symlinks to the entries of ``root``/tests (so ``root``
    is never written to), stand-ins for the support modules ``root`` lacks, and fastbert's own suite in
    tests/fastbert_suite/. src/ links to ``root``/src (transformers' test_pipeline_mixin imports it by path).
    Returns (tree, stand-ins written)."""
    if not (root / "src" / "transformers" / "__init__.py").exists():
        raise SystemExit(f"{root}: no src/transformers/__init__.py (want a transformers source tree or sdist)")
    key = hashlib.sha1(str(root).encode()).hexdigest()[:10]
    tree = workdir / f"tree-{root.name}-{key}"
    if tree.exists():
        shutil.rmtree(tree)
    (tree / "tests").mkdir(parents=True)
    for entry in sorted((root / "tests").iterdir()):
        (tree / "tests" / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (tree / "src").symlink_to(root / "src", target_is_directory=True)
    for name in ("pyproject.toml", "conftest.py", "setup.cfg"):
        if (root / name).exists():
            shutil.copy2(root / name, tree / name)
    missing = [rel for rel in SHIMS if not (root / rel).exists()]
    for rel in missing:
        write_in_tree(tree, rel, SHIMS[rel])
    suite = tree / "tests" / "fastbert_suite"
    suite.mkdir()
    (suite / "__init__.py").write_text("")
    for name in OWN_SUITES:
        shutil.copy2(HERE / name, suite / name)
    return tree, missing


def write_in_tree(tree: Path, rel: str, text: str) -> None:
    """Write tree/rel, first turning any symlinked folder on the way into a real folder of symlinks."""
    current = tree
    for part in Path(rel).parts[:-1]:
        current = current / part
        if current.is_symlink():
            target = current.resolve()
            current.unlink()
            current.mkdir()
            for entry in sorted(target.iterdir()):
                (current / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
        current.mkdir(exist_ok=True)
    (tree / rel).write_text(text)


# --------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------


def pytest_command(tree: Path, files: list[str], args, workdir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *files, "-p", "fastbert_standin", "-p", "no:cacheprovider", "-q",
           "--rootdir", str(tree), "-o", "addopts=", "-o", "log_cli=false", f"--tb={args.tb}"]
    inifile = tree / "pyproject.toml"
    if not inifile.exists():
        inifile = workdir / "pytest.ini"
        inifile.write_text("[pytest]\n")
    cmd += ["-c", str(inifile)]
    if args.k:
        cmd += ["-k", args.k]
    if args.m:
        cmd += ["-m", args.m]
    return cmd + list(args.pytest_args)


def run_mode(mode: str, cmd: list[str], tree: Path, workdir: Path, args) -> Path:
    results = workdir / "results" / f"{mode}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    if results.exists():
        results.unlink()
    logfile = workdir / "results" / f"{mode}.log"
    env = dict(os.environ)
    env.update(
        FASTBERT_STANDIN=mode,
        FASTBERT_STANDIN_REPORT=str(results),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(tree), str(HERE), env.get("PYTHONPATH", "")])),
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log(f"[{mode}] running: {' '.join(cmd[1:])}")
    log(f"[{mode}] log: {logfile}")
    start = time.time()
    with open(logfile, "w") as out:
        out.write(f"# FASTBERT_STANDIN={mode}\n# {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.mode_timeout or None)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.time() - start
    last = [line for line in logfile.read_text(errors="replace").splitlines() if line.strip()]
    tail = [line for line in last[-6:] if "passed" in line or "failed" in line or "error" in line or "stand-in" in line]
    log(f"[{mode}] exit {rc} after {seconds:.0f} s" + (f": {tail[-1].strip()}" if tail else ""))
    if results.exists():
        data = json.loads(results.read_text())
        data["info"]["wall_seconds"] = round(seconds, 1)
        data["info"]["pytest_exit"] = rc
        data["info"]["command"] = cmd
        results.write_text(json.dumps(data, indent=1, sort_keys=True))
    else:
        log(f"[{mode}] wrote no results (see {logfile})")
    return results


# --------------------------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------------------------


def short(nodeid: str) -> str:
    """tests/models/bert/test_modeling_bert.py::X::y -> test_modeling_bert.py::X::y."""
    path, sep, rest = nodeid.partition("::")
    return f"{Path(path).name}{sep}{rest}"


def counts(results: dict) -> dict:
    c: dict[str, int] = {}
    for r in results.values():
        c[r["outcome"]] = c.get(r["outcome"], 0) + 1
    return c


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def compare(workdir: Path, modes: list[str], strict_skips: bool = False, show_fallbacks: bool = False) -> int:
    base = load(workdir / "results" / "none.json")
    if base is None:
        log("no baseline results (results/none.json): run with --modes none first")
        return 2
    runs = {"none": base}
    for mode in modes:
        if mode != "none":
            data = load(workdir / "results" / f"{mode}.json")
            if data is None:
                log(f"[{mode}] no results")
            runs[mode] = data

    log("")
    log("mode      wall s  passed  failed  error  skipped  xfail  | BERT models built / running fastbert")
    for mode, data in runs.items():
        if data is None:
            log(f"{mode:9s} (no results)")
            continue
        info, c = data["info"], counts(data["results"])
        log(f"{mode:9s} {info.get('wall_seconds', info.get('seconds', 0)):6.0f}  {c.get('passed', 0):6d}  "
            f"{c.get('failed', 0):6d}  {c.get('error', 0):5d}  {c.get('skipped', 0):7d}  "
            f"{c.get('xfailed', 0) + c.get('xpassed', 0):5d}  | {info.get('bert_models_built', 0)} / "
            f"{info.get('with_fastbert', 0)}")

    base_results = base["results"]
    passed = {n for n, r in base_results.items() if r["outcome"] in ("passed", "xpassed")}
    if not passed:
        log("\nthe baseline (plain transformers) passed no test: nothing to compare (see results/none.log)")
        return 2
    status = 0
    for mode, data in runs.items():
        if mode == "none":
            continue
        log("")
        if data is None:
            log(f"== {mode}: no results")
            status = 1
            continue
        results, info = data["results"], data["info"]
        if info.get("command") != base["info"].get("command"):
            log(f"== {mode}: not comparable: the baseline ran a different selection of tests (files, -k, -m or "
                f"pytest arguments differ); run this mode and 'none' together")
            status = max(status, 2)
            continue
        if info.get("bert_models_built", 0) and not info.get("with_fastbert", 0):
            log(f"== {mode}: the stand-in was NOT active: {info['bert_models_built']} BERT models built, none ran "
                f"fastbert modules")
            status = 1
        broken, missing, skipped_only = [], [], []
        for nodeid in sorted(passed):
            r = results.get(nodeid)
            if r is None:
                missing.append(nodeid)
            elif r["outcome"] in FAILING:
                broken.append((nodeid, r))
            elif r["outcome"] in ("skipped", "xfailed"):
                skipped_only.append((nodeid, r))
        collect_errors = [(n, r) for n, r in results.items()
                          if r["reason"].startswith("[collect]") and n not in base_results]
        fixed = [n for n, r in base_results.items() if r["outcome"] in FAILING
                 and results.get(n, {}).get("outcome") == "passed"]
        bad = len(broken) + len(missing) + (len(skipped_only) if strict_skips else 0)
        log(f"== {mode}: {bad} test(s) pass with plain transformers but not with fastbert"
            + (f"; {len(skipped_only)} skipped only with fastbert" if skipped_only else "")
            + (f"; {len(fixed)} fail with plain transformers but pass with fastbert" if fixed else ""))
        for nodeid, r in collect_errors:
            log(f"  COLLECTION ERROR {short(nodeid)}: {r['reason']}")
        for nodeid, r in broken:
            log(f"  {r['outcome'].upper():6s} {short(nodeid)}")
            log(f"         {r['reason']}")
        for nodeid in missing:
            log(f"  MISSING {short(nodeid)} (not run: see the collection errors in results/{mode}.log)")
        for nodeid, r in skipped_only:
            log(f"  {'SKIPPED' if strict_skips else '(skipped)'} {short(nodeid)}: {r['reason']}")
        both = [n for n in passed if results.get(n, {}).get("outcome") == "passed"]
        fell_back = [n for n in both if results[n].get("fallbacks")]
        totals = info.get("fastbert_fallbacks") or {}
        if totals:
            log(f"  {len(fell_back)} of the {len(both)} tests passing in both met a fastbert fallback (transformers' "
                f"forward, or torch reference ops instead of a fused kernel); fastbert's reasons, with counts:")
            for reason, n in sorted(totals.items(), key=lambda kv: -kv[1])[:12]:
                log(f"    {n:6d}  {reason[:160]}")
            if len(totals) > 12:
                log(f"    ... {len(totals) - 12} more reasons in results/{mode}.json")
        if show_fallbacks:
            for nodeid in sorted(fell_back):
                log(f"    fallback in {short(nodeid)}: {'; '.join(results[nodeid]['fallback_reasons'])[:200]}")
        if bad:
            status = 1
    log("")
    log("OK: every test that passes with plain transformers passes with fastbert" if status == 0 else
        "FAIL: see the lists above; full tracebacks in " + str(workdir / "results" / "<mode>.log") if status == 1
        else "NOT COMPARED: see above")
    (workdir / "results" / "summary.txt").write_text("\n".join(_LOG) + "\n")
    return status


# --------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformers-tests", default=os.environ.get("TRANSFORMERS_TESTS"),
                        help="a transformers source tree (git checkout or unpacked sdist), or its tests/ folder; "
                             "default: $TRANSFORMERS_TESTS, else the sdist of the installed version from PyPI")
    parser.add_argument("--workdir", default=os.environ.get("FASTBERT_HF_SUITE_WORKDIR",
                                                            str(Path.home() / ".cache" / "fastbert-hf-suite")),
                        help="downloads, prepared trees, logs and results (default: %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated, run in order (default: %(default)s); without 'none' the last "
                             "baseline results are reused")
    parser.add_argument("--files", nargs="+", metavar="PATH",
                        help="test files relative to the transformers root (default: the family's per-model test files "
                             f"the tree has, and fastbert's {', '.join(OWN_SUITES)})")
    parser.add_argument("--no-own-suite", action="store_true", help=f"do not add {', '.join(OWN_SUITES)}")
    parser.add_argument("-k", help="pytest -k expression (a subset of tests)")
    parser.add_argument("-m", help="pytest -m marker expression")
    parser.add_argument("--tb", default="short", help="pytest --tb style in the logs (default: %(default)s)")
    parser.add_argument("--mode-timeout", type=float, default=0, help="seconds allowed per mode (default: none)")
    parser.add_argument("--compare-only", action="store_true", help="compare the last results, run nothing")
    parser.add_argument("--strict-skips", action="store_true",
                        help="a test that passes with plain transformers but is skipped with fastbert fails the run")
    parser.add_argument("--show-fallbacks", action="store_true",
                        help="list each passing test in which fastbert left a forward to transformers")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest as they are")
    args = parser.parse_args(argv)

    workdir = Path(args.workdir).expanduser().resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}")
    if args.compare_only:
        return compare(workdir, modes, args.strict_skips, args.show_fallbacks)

    missing = [m for m in ("pytest", "parameterized", "transformers", "fastbert")
               # (from another directory: a checkout's fastbert/ folder must not shadow the installed package)
               if subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True,
                                 cwd=tempfile.gettempdir()).returncode]
    if missing:
        raise SystemExit(f"{sys.executable} cannot import {', '.join(missing)} (transformers' tests need "
                         f"parameterized: pip install parameterized)")
    if args.transformers_tests:
        root = find_root(Path(args.transformers_tests))
    else:
        root = download_sdist(installed_transformers_version(), workdir)
    tree, shims = prepare_tree(root, workdir)
    log(f"transformers tests: {root} (run in {tree})")
    stand_ins = [s for s in shims if s.endswith((".py", ".json")) and not s.endswith("__init__.py")]
    if stand_ins:
        log("  not in that tree, replaced by stand-ins: " + ", ".join(stand_ins))

    files = list(args.files or [])
    if not files:
        files += [test for test in MODEL_TESTS if (tree / test).exists()]
        if not files:
            log(f"  transformers' per-model test files are not in that tree: only fastbert's {', '.join(OWN_SUITES)} "
                "run, against transformers' common tests (see README.md for getting the full tests)")
    if not args.no_own_suite:
        files += [f"tests/fastbert_suite/{name}" for name in OWN_SUITES]
    if not files:
        parser.error("no test files")

    cmd = pytest_command(tree, files, args, workdir)
    for mode in modes:
        run_mode(mode, cmd, tree, workdir, args)
    return compare(workdir, modes, args.strict_skips, args.show_fallbacks)


if __name__ == "__main__":
    sys.exit(main())
