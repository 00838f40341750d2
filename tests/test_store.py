"""The per-machine store of one-time measurements (fastbert/store.py): it cannot break a process, and load never
decides.

- Every malformed entry (or file) is treated as absent, measured again, rewritten and warned about, naming the file;
  forwards, ``info()`` and ``quantize`` keep working.
- A measurement taken beside busy processes is not stored: a marker is, so every process keeps the defaults until
  it expires, and then one measures again.
- Four processes starting together on an empty store agree on every choice and leave one valid file.
- The file stays bounded; a store that cannot be written is said once.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import machine_load
import pytest
import torch

import fastbert
from fastbert import cpu, dispatch, store, threads

GEMM = (cpu.gemm_measurement(torch.float32), cpu.gemm_libraries(torch.float32), cpu.GEMM_TOKENS)
OTHER = GEMM[1][-1]  # the library measured beside torch's F.linear (oneDNN, fastbert's native GEMM)
NOTHING_MEASURED = "no GEMM library but torch's runs float32 here: nothing is measured"


@pytest.fixture
def empty_store(monkeypatch, tmp_path):
    """A store folder of this test's own, nothing measured yet in this process."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_figures", {})
    return tmp_path / store.FILE_NAME


def _valid(measured: float = 100.0) -> dict:
    return {**{library: {str(t): measured for t in GEMM[2]} for library in GEMM[1]}, "measured_at": time.time()}


GOOD = {str(t): 100.0 for t in GEMM[2]}
OTHERS = {library: GOOD for library in GEMM[1][1:]}
MALFORMED = {
    "a string where figures belong": {"torch": "fast", **OTHERS},
    "a missing token key": {"torch": {str(GEMM[2][0]): 100.0}, **OTHERS},
    "NaN": {"torch": {**GOOD, str(GEMM[2][0]): math.nan}, **OTHERS},
    "negative": {"torch": GOOD, **OTHERS, OTHER: {**GOOD, str(GEMM[2][0]): -5.0}},
    "infinite": {"torch": GOOD, **OTHERS, OTHER: {**GOOD, str(GEMM[2][0]): math.inf}},
    "zero": {"torch": GOOD, **OTHERS, OTHER: {**GOOD, str(GEMM[2][0]): 0}},
    "a bool": {"torch": GOOD, **OTHERS, OTHER: {**GOOD, str(GEMM[2][0]): True}},
    "a token key that is not a number": {"torch": {**GOOD, "many": 1.0}, **OTHERS},
    "a missing library": {"torch": GOOD},
    "a list instead of an entry": [1, 2, 3],
    "a busy marker without a time": {"busy_until": "soon"},
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_a_malformed_entry_is_measured_again_rewritten_and_warned(empty_store, what, measurements_kept):
    if len(GEMM[1]) < 2:
        pytest.skip(NOTHING_MEASURED)
    key = cpu._key(GEMM[0])
    empty_store.write_text(json.dumps({key: MALFORMED[what], "another machine": _valid()}))
    with pytest.warns(RuntimeWarning, match=f"{empty_store}.*malformed entry"):
        figures = cpu.gemm_figures(torch.float32)
    assert figures["source"] == "measured" and set(figures["torch"]) == set(GEMM[2])
    stored = json.loads(empty_store.read_text())
    assert store.why_invalid(stored[key], GEMM[1], GEMM[2]) is None and "another machine" in stored
    # the repaired file is read back by the next process (here: this one, forgetting what it measured)
    cpu._figures.clear()
    assert cpu.gemm_figures(torch.float32)["source"] == str(empty_store)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_a_broken_file_is_rewritten(empty_store, content, measurements_kept):
    if len(GEMM[1]) < 2:
        pytest.skip(NOTHING_MEASURED)
    empty_store.write_text(content)
    with pytest.warns(RuntimeWarning, match=str(empty_store)):
        assert cpu.gemm_figures(torch.float32)["source"] == "measured"
    assert isinstance(json.loads(empty_store.read_text()), dict)


def test_forwards_info_and_quantize_survive_a_malformed_store(empty_store, bert_trio):
    """What broke every process before: a well-formed JSON entry of the wrong type for each measurement."""
    key, model = cpu._key, bert_trio().fast
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    empty_store.write_text(json.dumps({key(GEMM[0]): {"torch": "x"},
                                       key(cpu.attention_measurement(torch.float32, head_dim)): [],
                                       key(cpu.int8_measurement(8)): {"int8": None},
                                       key(cpu.int8_measurement(7)): 3}))
    with pytest.warns(RuntimeWarning, match="malformed entry"):
        with torch.inference_mode():
            model(torch.ones(2, 8, dtype=torch.long))
        fastbert.info()
        fastbert.quantize(model, guard=False)
    with torch.inference_mode():
        model(torch.ones(2, 8, dtype=torch.long))


def test_a_measurement_beside_busy_processes_is_not_kept(empty_store, monkeypatch):
    """As many busy processes as CPUs: the measurement sees its threads did not get the CPU; the store keeps a busy
    marker (never the figures), every choice keeps its default while it lasts, and the next measurement after it
    expires, on a quiet machine (simulated, tests/machine_load.py), is kept."""
    if len(GEMM[1]) < 2:
        pytest.skip(NOTHING_MEASURED)
    monkeypatch.setattr(store, "BUSY_SECONDS", 1.0)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(threads.affinity() + 1)]
    try:
        time.sleep(0.5)
        figures = cpu.gemm_figures(torch.float32)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert "busy" in figures and "torch" not in figures, figures
    stored = json.loads(empty_store.read_text())[cpu._key(GEMM[0])]
    assert set(stored) == {"busy_until", "busy"}
    assert "the machine was busy" in cpu.gemm_slower_reason(OTHER, torch.float32)
    assert dispatch.report(torch.device("cpu"), torch.float32)[0]["gemm"] == "torch"
    time.sleep(1.2)
    cpu._figures.clear()
    monkeypatch.setattr(threads, "sample", machine_load.Load(others=0))  # (this machine may never be quiet)
    figures = cpu.gemm_figures(torch.float32)
    assert figures["source"] == "measured" and "busy" not in figures
    assert store.why_invalid(json.loads(empty_store.read_text())[cpu._key(GEMM[0])], GEMM[1], GEMM[2]) is None


def test_four_processes_starting_together_agree(tmp_path):
    """Four processes on an empty store, started at once: one measures (or finds the machine busy), the others wait
    for it; they make the same choice for every op and leave one file of valid entries."""
    script = textwrap.dedent("""
        import json, torch, fastbert
        from fastbert import cpu, dispatch
        from fastbert.int8 import choices as int8
        from fastbert.ops.attention_cpu import attention_cpu
        backends, _ = dispatch.report(torch.device("cpu"), torch.float32)
        print(json.dumps(dict(gemm=backends["gemm"], int8=not int8.unavailable_reasons(),
                              attention=cpu.attention_slower_reason(attention_cpu, torch.float32, 64) is None)))
    """)
    environment = {**{k: v for k, v in os.environ.items() if k != "FASTBERT_NUM_THREADS"},
                   "FASTBERT_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=environment, cwd=tmp_path) for _ in range(4)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in outputs]
    choices = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert all(choice == choices[0] for choice in choices), choices
    stored = json.loads((tmp_path / store.FILE_NAME).read_text())
    assert stored and all(isinstance(entry, dict) and ("busy_until" in entry or "measured_at" in entry)
                          for entry in stored.values())
    assert not list(tmp_path.glob("*.tmp"))


def test_the_store_is_bounded(empty_store):
    if len(GEMM[1]) < 2:
        pytest.skip(NOTHING_MEASURED)
    old = {f"machine {i}": {**_valid(), "measured_at": 1000.0 + i} for i in range(store.MAX_ENTRIES + 10)}
    empty_store.write_text(json.dumps(old))
    cpu.gemm_figures(torch.float32)
    stored = json.loads(empty_store.read_text())
    assert len(stored) == store.MAX_ENTRIES and cpu._key(GEMM[0]) in stored
    assert "machine 0" not in stored and f"machine {store.MAX_ENTRIES + 9}" in stored


def test_a_store_that_cannot_be_written_is_said_once(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(blocker / "store"))  # (a folder under a file: never writable)
    monkeypatch.setattr(cpu, "_figures", {})
    monkeypatch.setattr(store, "_read_only_said", False)
    with pytest.warns(UserWarning, match="cannot be written") as said:
        cpu.gemm_figures(torch.float32)
        cpu._figures.clear()
        cpu.gemm_figures(torch.float32)
    assert sum("cannot be written" in str(w.message) for w in said) == 1
