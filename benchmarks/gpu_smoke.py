#!/usr/bin/env python
"""End-to-end smoke test: fastbert against HF in the same dtype and against HF references in fp32 and fp64, on each
path a padded or unpadded batch can take, and one CUDA-graph replay, at S=512 on the GPU. Exit status 1 if any check
fails.

    python benchmarks/gpu_smoke.py                                               # cuda, bert-base, 4 x 512
    python benchmarks/gpu_smoke.py --device cpu --model bert-tiny --seq-len 32   # the plumbing, on CPU

Rule (the benchmark's, flash-attention's): on real tokens, max |fastbert - ref| <= 2 * max |HF - ref| + atol[dtype],
for ref = HF sdpa in fp32 and ref = HF eager in fp64, on the same weights; pooler_output likewise. The paths:
    dense    no padding (every row full)
    packed   half the positions padded, unpad=True: fastbert runs padding-free (varlen attention)
    masked   the same padded batch with unpad=False: the dense masked path (padding mask and key bounds), which is
             also what a CUDA graph runs
    graph    the padded batch replayed from ``fastbert.cuda_graphs`` (one bucket of exactly this shape), against the
             eager masked output: max |graph - eager| within the tolerance the eager output is held to vs fp32
             (on CPU no graph is captured and the call runs eagerly: plumbing only)
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fastbench.cases import Case, make_inputs, make_lengths  # noqa: E402
from fastbench.check import ATOL  # noqa: E402
from fastbench.env import device_name, fastbert_backends, version  # noqa: E402
from fastbench.models import MODELS, ModelSet, is_fastbert  # noqa: E402

# (name, pad ratio, fastbert's unpad)
LAYOUTS = (("dense", 0.0, True), ("packed", 0.5, True), ("masked", 0.5, False))


def max_err(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a - b| on the real positions (mask != 0), in fp64."""
    real = mask.bool().to(b.device)
    return (a.double() - b.double())[real].abs().max().item()


def rule(out, hf, ref, mask, dtype) -> tuple[bool, str]:
    """max |out - ref| <= 2 * max |hf - ref| + ATOL[dtype] on the real positions, as (ok, 'err <= tol')."""
    err, tol = max_err(out, ref, mask), 2 * max_err(hf, ref, mask) + ATOL[dtype]
    ok = err <= tol  # False for NaN
    return ok, f"{err:.2e} {'<=' if ok else '>'} {tol:.2e}"


def check_layout(label: str, outs: dict, mask: torch.Tensor, batch: int, dtype: str) -> list[str]:
    """The rule for fastbert's last_hidden_state and pooler_output against both references; the labels that fail."""
    failures = []
    for field, field_mask in (("last_hidden_state", mask), ("pooler_output", torch.ones(batch))):
        if getattr(outs["hf"], field, None) is None:
            continue
        got = {name: getattr(o, field) for name, o in outs.items()}
        finite = bool(torch.isfinite(got["fastbert"][field_mask.bool().to(got["hf"].device)]).all())
        results = [rule(got["fastbert"], got["hf"], got[ref], field_mask, dtype) for ref in ("fp32", "fp64")]
        ok = finite and all(r[0] for r in results)
        print(f"{'ok  ' if ok else 'FAIL'} {label} {field}: vs fp32 ref {results[0][1]}, vs fp64 ref "
              f"{results[1][1]}{'' if finite else ', NON-FINITE values'}")
        if not ok:
            failures.append(f"{label} {field}")
    return failures


def check_graph(label: str, fast, inputs: dict, eager, hf, ref32, mask, dtype: str) -> list[str]:
    """One CUDA-graph replay of ``inputs`` against the eager masked output ``eager``; the labels that fail."""
    import fastbert

    fastbert.cuda_graphs(fast, batch_sizes=(inputs["input_ids"].shape[0],), seq_lens=(inputs["input_ids"].shape[1],))
    try:
        with torch.inference_mode():
            graph = fast(**inputs).last_hidden_state
        captured = any(g is not None for g in fast._graphs.graphs.values())
    finally:
        fastbert.cuda_graphs(fast, enabled=False)
    err, tol = max_err(graph, eager, mask), 2 * max_err(hf, ref32, mask) + ATOL[dtype]
    on_gpu = graph.device.type == "cuda"
    ok = err <= tol and (captured or not on_gpu)
    how = "replayed from a CUDA graph" if captured else "NO GRAPH CAPTURED" if on_gpu else "eager (CPU: no graph)"
    print(f"{'ok  ' if ok else 'FAIL'} {label} last_hidden_state, {how}: vs eager masked {err:.2e} "
          f"{'<=' if err <= tol else '>'} {tol:.2e} (2 x HF's error vs fp32 + atol)")
    return [] if ok else [f"{label} cuda graph"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="bert-base", choices=list(MODELS))
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke.py: no CUDA device (use --device cpu for the plumbing)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    print(f"device {device_name(device)}; torch {torch.__version__}, transformers {version('transformers')}, "
          f"triton {version('triton')}, fastbert {version('fastbert')}")
    failures, total = [], 0
    for dtype in args.dtypes.split(","):
        print(f"fastbert backends ({device.type}, {dtype}): {fastbert_backends(device, dtype)}")
        ms = ModelSet(args.model, dtype, device, args.seed)
        fast, warned = ms.fastbert()
        for w in warned:
            print(f"  fastbert warned: {w}")
        if not is_fastbert(fast) or not hasattr(fast, "unpad"):
            print(f"FAIL {args.model} {dtype}: fastbert.optimize left the model unchanged")
            failures.append(f"{dtype}: not accelerated")
            continue
        models = {"fastbert": fast, "hf": ms.hf("sdpa"), "fp32": ms.hf("sdpa", "fp32"), "fp64": ms.hf("eager", "fp64")}
        hf_outs = {}  # by pad ratio: the padded batch's HF outputs serve packed and masked alike
        for layout, pad, unpad in LAYOUTS:
            lengths = make_lengths(args.batch, args.seq_len, pad, args.seed)
            case = Case(args.model, dtype, args.batch, args.seq_len, tuple(lengths), f"pad_ratio={pad:g}")
            inputs = make_inputs(case, ms.config.vocab_size, ms.config.pad_token_id or 0, args.seed, device)
            fast.unpad = unpad
            t0 = time.perf_counter()
            with torch.inference_mode():
                if pad not in hf_outs:
                    hf_outs[pad] = {name: models[name](**inputs) for name in ("hf", "fp32", "fp64")}
                outs = {"fastbert": fast(**inputs), **hf_outs[pad]}
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"{layout} (unpad={unpad}) b{args.batch}x{args.seq_len}, lengths {lengths}: forwards in "
                  f"{time.perf_counter() - t0:.2f} s")
            label = f"{args.model} {dtype} {layout} b{args.batch}x{args.seq_len}"
            fields = 2 if getattr(outs["hf"], "pooler_output", None) is not None else 1
            total += fields
            failures += check_layout(label, outs, inputs["attention_mask"], args.batch, dtype)
            if layout == "masked":
                total += 1
                last = {name: o.last_hidden_state for name, o in outs.items()}
                failures += check_graph(f"{args.model} {dtype} graph b{args.batch}x{args.seq_len}", fast, inputs,
                                        last["fastbert"], last["hf"], last["fp32"], inputs["attention_mask"], dtype)
        fast.unpad = True
        del ms, models, fast, hf_outs
    print(f"smoke: {total - len(failures)}/{total} checks passed" + (f"; failed: {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
