#!/usr/bin/env python
"""Host time per forward: what one forward costs the CPU beyond its arithmetic, fastbert against HF.

    python benchmarks/host_time.py                 # bert-base and MiniLM structure, batch 1 x 8 tokens
    python benchmarks/host_time.py --profile       # plus cProfile's top entries for fastbert
    python benchmarks/host_time.py --precisions fp32,bf16,int8 --gemm auto --threads 2   # as a CPU forward runs

A GPU forward of a small batch is bound by this time (Python, module calls, checks, op dispatch), not by the GPU:
bert-base bs1 x 128 has ~0.4 ms of GPU work. To see it on any machine, the models keep the real structure (layers,
heads, activation, pooler) at a width where the arithmetic is negligible (hidden = 4 x heads, 8 tokens), and each
forward runs on the CPU: the wall time per call is then the host time, plus a small bounded amount of CPU kernel time,
an upper bound. Providers are interleaved, medians of ``--rounds`` rounds of ``--calls`` calls each. fastbert's GEMMs
are ``F.linear`` by default (``--gemm torch``), as on a GPU; ``--gemm auto`` times what this CPU would run (oneDNN
adds a fixed ~30 us per GEMM call, which only pays off at real widths). ``--precisions``: fp32 (default), bf16
(both sides' models in bfloat16) and int8 (fastbert: ``fastbert.quantize(guard=False)``, every GEMM int8; HF in
float32), one table each.
"""

import argparse
import os
import copy
import cProfile
import itertools
import pstats
import statistics
import sys
import time

import torch
import transformers

import fastbert

# name -> (layers, heads): the structure of bert-base-uncased and all-MiniLM-L6-v2
STRUCTURES = {"bert-base": (12, 12), "minilm": (6, 12)}


def build(layers: int, heads: int, precision: str = "fp32") -> dict:
    def config(attention):
        return transformers.BertConfig(vocab_size=128, hidden_size=4 * heads, num_attention_heads=heads,
                                       num_hidden_layers=layers, intermediate_size=16 * heads,
                                       max_position_embeddings=64, attn_implementation=attention)

    torch.manual_seed(0)
    hf = transformers.BertModel(config("sdpa")).eval()
    eager = transformers.BertModel(config("eager")).eval()
    eager.load_state_dict(hf.state_dict())
    fast = fastbert.optimize(copy.deepcopy(hf))
    if precision == "int8":
        fast = fastbert.quantize(fast, guard=False)
    elif precision == "bf16":
        hf, eager, fast = (m.to(torch.bfloat16) for m in (hf, eager, fast))
    return {"hf-eager": eager, "hf-sdpa": hf, "fastbert": fast}


def time_per_call(models: dict, inputs: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of the mean ms per call; providers interleaved round by round."""
    samples = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():
            for _ in range(10):
                model(**inputs)
        for _ in range(rounds):
            for name, model in models.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    model(**inputs)
                samples[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: no pool wake-ups)")
    p.add_argument("--gemm", default="torch", choices=("torch", "auto", "onednn", "native"),
                   help="fastbert's CPU GEMM library, FASTBERT_CPU_GEMM (default torch: F.linear, as on a GPU)")
    p.add_argument("--profile", action="store_true", help="cProfile fastbert's bert-base forward")
    p.add_argument("--precisions", default="fp32", help="comma list of fp32, bf16, int8 (int8: fastbert's GEMMs "
                   "quantized, HF in float32)")
    args = p.parse_args(argv)
    os.environ["FASTBERT_CPU_GEMM"] = args.gemm
    torch.set_num_threads(args.threads)
    ids = torch.randint(1, 128, (1, args.tokens))
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    cases = {"no mask": {"input_ids": ids}, "mask": {"input_ids": ids, "attention_mask": padded}}
    print(f"host time per forward, ms (batch 1 x {args.tokens} tokens, {args.threads} thread(s); "
          f"torch {torch.__version__}, transformers {transformers.__version__}, fastbert {fastbert.__version__})")
    print(f"{'precision':9s} {'structure':10s} {'inputs':8s} {'hf-eager':>9s} {'hf-sdpa':>9s} {'fastbert':>9s} "
          f"{'vs hf-sdpa':>10s}")
    for precision, (structure, (layers, heads)) in itertools.product(args.precisions.split(","),
                                                                       STRUCTURES.items()):
        models = build(layers, heads, precision)
        for case, inputs in cases.items():
            ms = time_per_call(models, inputs, args.rounds, args.calls)
            print(f"{precision:9s} {structure:10s} {case:8s} {ms['hf-eager']:9.3f} {ms['hf-sdpa']:9.3f} "
                  f"{ms['fastbert']:9.3f} {ms['hf-sdpa'] / ms['fastbert']:9.2f}x")
        if args.profile and structure == "bert-base":
            profiler = cProfile.Profile()
            with torch.inference_mode():
                profiler.enable()
                for _ in range(args.calls):
                    models["fastbert"](**cases["mask"])
                profiler.disable()
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
