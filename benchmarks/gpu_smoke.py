#!/usr/bin/env python
"""End-to-end smoke test: fastbert against HF in the same dtype and against HF references in fp32 and fp64, dense
and packed (padded) batches, fp16 and bf16, at S=512 on the GPU. Exit status 1 if any check fails.

    python benchmarks/gpu_smoke.py                                               # cuda, bert-base, 4 x 512
    python benchmarks/gpu_smoke.py --device cpu --model bert-tiny --seq-len 32   # the plumbing, on CPU

Rule (the benchmark's, flash-attention's): on real tokens, max |fastbert - ref| <= 2 * max |HF - ref| + atol[dtype],
for ref = HF sdpa in fp32 and ref = HF eager in fp64, on the same weights; pooler_output likewise. "dense" has no
padding (every row full); "packed" has half the positions padded, so fastbert runs padding-free.
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


def rule(out, hf, ref, mask, dtype) -> tuple[bool, str]:
    """max |out - ref| <= 2 * max |hf - ref| + ATOL[dtype] on the real positions, as (ok, 'err <= tol')."""
    real = mask.bool().to(hf.device)
    err, hf_err = ((x.double() - ref.double())[real].abs().max().item() for x in (out, hf))
    tol = 2 * hf_err + ATOL[dtype]
    ok = err <= tol  # False for NaN
    return ok, f"{err:.2e} {'<=' if ok else '>'} {tol:.2e}"


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
        if not is_fastbert(fast):
            print(f"FAIL {args.model} {dtype}: fastbert.optimize left the model unchanged")
            failures.append(f"{dtype}: not accelerated")
            continue
        models = {"fastbert": fast, "hf": ms.hf("sdpa"), "fp32": ms.hf("sdpa", "fp32"), "fp64": ms.hf("eager", "fp64")}
        for layout, pad in (("dense", 0.0), ("packed", 0.5)):
            lengths = make_lengths(args.batch, args.seq_len, pad, args.seed)
            case = Case(args.model, dtype, args.batch, args.seq_len, tuple(lengths), f"pad_ratio={pad:g}")
            inputs = make_inputs(case, ms.config.vocab_size, ms.config.pad_token_id or 0, args.seed, device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                outs = {name: m(**inputs) for name, m in models.items()}
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"{layout} b{args.batch}x{args.seq_len}, lengths {lengths}: fastbert, HF, HF fp32, HF fp64 "
                  f"forwards in {time.perf_counter() - t0:.2f} s")
            mask = inputs["attention_mask"]
            for field, field_mask in (("last_hidden_state", mask), ("pooler_output", torch.ones(args.batch))):
                if getattr(outs["hf"], field, None) is None:
                    continue
                got = {name: getattr(o, field) for name, o in outs.items()}
                finite = bool(torch.isfinite(got["fastbert"][field_mask.bool().to(device)]).all())
                results = [rule(got["fastbert"], got["hf"], got[ref], field_mask, dtype) for ref in ("fp32", "fp64")]
                ok = finite and all(r[0] for r in results)
                total += 1
                label = f"{args.model} {dtype} {layout} b{args.batch}x{args.seq_len} {field}"
                print(f"{'ok  ' if ok else 'FAIL'} {label}: vs fp32 ref {results[0][1]}, vs fp64 ref {results[1][1]}"
                      f"{'' if finite else ', NON-FINITE values'}")
                if not ok:
                    failures.append(label)
        del ms, models, fast
    print(f"smoke: {total - len(failures)}/{total} checks passed" + (f"; failed: {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
