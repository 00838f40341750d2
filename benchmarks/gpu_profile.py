#!/usr/bin/env python
"""Per-kernel profile of one forward: torch.profiler's key_averages table for each provider, per case.

    python benchmarks/gpu_profile.py --out DIR   # cuda, bert-base fp16, b64 x s128 dense and half padded, b1 x s128;
                                                 # fastbert, fastbert-graphs (a CUDA-graph replay), hf-sdpa
    python benchmarks/gpu_profile.py --device cpu --model bert-tiny --cases 4x16,4x16p0.5 --providers fastbert,hf-sdpa \
        --out DIR                                # the plumbing, on CPU

Writes DIR/profile.txt: for each provider and case, the table of the ops and kernels of ``--steps`` forwards (after
warm-up), sorted by self device time on CUDA (self CPU time on CPU), times per call divided by ``--steps`` in the
header line. Every provider's output is checked against hf-sdpa before it is profiled.
"""

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fastbench.cases import Case, make_inputs, make_lengths  # noqa: E402
from fastbench.check import REFERENCE_DTYPE, check_outputs  # noqa: E402
from fastbench.env import device_name, fastbert_backends, version  # noqa: E402
from fastbench.models import MODELS, ModelSet  # noqa: E402
from fastbench.providers import PROVIDERS  # noqa: E402


def parse_cases(text: str, pad_ratio: float = 0.0) -> list[tuple[int, int, float]]:
    """'64x128,64x128p0.5,1x128' -> [(64, 128, pad_ratio), (64, 128, 0.5), (1, 128, 0.0)]: BATCHxSEQ, with pPAD a
    fraction of padding positions (default ``pad_ratio``; batch 1 never has padding)."""
    cases = []
    for item in (i.strip().lower() for i in text.split(",")):
        if not item:
            continue
        shape, _, pad = item.partition("p")
        try:
            batch, seq = (int(v) for v in shape.split("x"))
            ratio = float(pad) if pad else pad_ratio
        except ValueError:
            raise SystemExit(f"--cases: cannot read {item!r} (BATCHxSEQ or BATCHxSEQpPAD, e.g. 64x128p0.5)") from None
        cases.append((batch, seq, ratio if batch > 1 else 0.0))
    return cases


def table(prof, device: torch.device, rows: int) -> str:
    averages = prof.key_averages()
    keys = ["self_device_time_total", "self_cuda_time_total"] if device.type == "cuda" else ["self_cpu_time_total"]
    for key in keys:
        try:
            return averages.table(sort_by=key, row_limit=rows, max_name_column_width=80)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=rows, max_name_column_width=80)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="bert-base", choices=list(MODELS))
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--cases", default="64x128,64x128p0.5,1x128",
                   help="comma list of BATCHxSEQ[pPAD] (default 64x128,64x128p0.5,1x128)")
    p.add_argument("--pad-ratio", type=float, default=0.0, help="padding of the cases that give none (default 0)")
    p.add_argument("--providers", default="fastbert,fastbert-graphs,hf-sdpa",
                   help="comma list (default fastbert,fastbert-graphs,hf-sdpa; fastbert-graphs needs cuda)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=40, help="table rows (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile.py: no CUDA device (use --device cpu for the plumbing)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    cases = parse_cases(args.cases, args.pad_ratio)
    names = [n for n in args.providers.split(",") if n]
    for name in names:
        if name not in PROVIDERS or device.type not in PROVIDERS[name].devices:
            raise SystemExit(f"--providers: {name!r} is not a provider on {device.type} (choose from "
                             f"{', '.join(n for n, p in PROVIDERS.items() if device.type in p.devices)})")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile.txt")
    ms = ModelSet(args.model, args.dtype, device, args.seed)
    forwards = {name: PROVIDERS[name].build(ms, argparse.Namespace(compile_mode="default"), print)
                for name in names}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    status = 0
    with open(path, "w") as f:
        f.write(f"# {device_name(device)}, torch {torch.__version__}, triton {version('triton')}, fastbert "
                f"{version('fastbert')}; {args.model} {args.dtype}; fastbert backends: "
                f"{fastbert_backends(device, args.dtype)}\n")
        for batch, seq, pad in cases:
            lengths = make_lengths(batch, seq, pad, args.seed)
            case = Case(args.model, args.dtype, batch, seq, tuple(lengths), f"pad_ratio={pad:g}")
            inputs = make_inputs(case, ms.config.vocab_size, ms.config.pad_token_id or 0, args.seed, device)
            hf_out = forwards["hf-sdpa"](inputs).last_hidden_state if "hf-sdpa" in forwards else None
            for name, forward in forwards.items():
                if hf_out is not None and name != "hf-sdpa":
                    with torch.inference_mode():
                        ref = ms.hf("sdpa", REFERENCE_DTYPE[args.dtype])(**inputs).last_hidden_state
                    check = check_outputs(forward(inputs).last_hidden_state, hf_out, inputs["attention_mask"],
                                          args.dtype, ref)
                    print(f"{case.label} {name}: check {'ok' if check.ok else 'FAILED'} "
                          f"({check.max_err:.2e} vs tol {check.tol:.2e})")
                    status |= not check.ok
                for _ in range(3):  # warm-up: Triton compilation and CUDA-graph capture stay out of the profile
                    forward(inputs)
                sync()
                with profile(activities=activities) as prof:
                    for _ in range(args.steps):
                        forward(inputs)
                    sync()
                f.write(f"\n## {name} {case.label} ({args.steps} forwards; divide totals by {args.steps})\n")
                f.write(table(prof, device, args.rows) + "\n")
                f.flush()
                print(f"profiled {name} {case.label}")
    print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
