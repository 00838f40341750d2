"""The machine's GEMM peak per precision, and a bert-base forward's share of it.

    python benchmarks/gemm_peak.py [--times fp32:1x128=89.8,bf16:8x128=145.3,...]

Peak: the best GFLOP/s of oneDNN's prepacked linear (``fastbert/cpu_gemm.py``; int8: ``fastbert/int8/linear.py``,
with this CPU's weight bits: fastbert's own int8 GEMM for 7, oneDNN's for 8)
on bert-base's FFN GEMM, [1024, 768] x [768, 3072], torch's thread count, best of 20 calls after warm-up. A forward's
work: bert-base's GEMMs (2 x tokens x (4 H^2 + 2 H I) per layer) and attention (4 x tokens x S x H per layer, S the
padded length: an upper bound) over its real tokens; its share of the peak is that work over (time x that peak).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fastbench.env import cpu_identity  # noqa: E402

H, I, LAYERS = 768, 3072, 12


def peak(dtype: str) -> float:
    from fastbert import cpu_gemm
    from fastbert.int8 import choices as int8, linear as int8_linear

    x = torch.randn(1024, H)
    w = torch.randn(I, H)
    if dtype == "int8":
        packed = int8_linear.quantize_weight(w, int8.weight_bits())  # (the int8 GEMM fastbert runs here)
        q = int8_linear.quantize_static(x, 0.05, 128)

        def call():
            int8_linear.linear(q, packed, None, static=(0.05, 128))
    else:
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        x, packed = x.to(torch_dtype), cpu_gemm.pack(w.to(torch_dtype))

        def call():
            cpu_gemm.linear(x, packed, None)
    for _ in range(5):
        call()
    best = min(_timed(call) for _ in range(20))
    return 2 * 1024 * H * I / best / 1e9


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def work(batch: int, seq: int, tokens: int | None = None) -> float:
    """GFLOP of a bert-base forward over ``tokens`` real tokens (default batch x seq) of sequences of ``seq``."""
    tokens = batch * seq if tokens is None else tokens
    return LAYERS * (2 * tokens * (4 * H * H + 2 * H * I) + 4 * tokens * seq * H) / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", default="", help="precision:BxS[/tokens]=ms,... the forwards to rate")
    args = parser.parse_args(argv)
    peaks = {dtype: peak(dtype) for dtype in ("fp32", "bf16", "int8")}
    print(f"CPU: {cpu_identity()}, {torch.get_num_threads()} threads")
    for dtype, gflops in peaks.items():
        print(f"peak {dtype}: {gflops:.0f} G{'OP' if dtype == 'int8' else 'FLOP'}/s")
    for item in filter(None, args.times.split(",")):
        case, ms = item.split("=")
        dtype, shape = case.split(":")
        shape, _, tokens = shape.partition("/")
        batch, seq = (int(v) for v in shape.split("x"))
        share = work(batch, seq, int(tokens) if tokens else None) / (float(ms) / 1e3) / peaks[dtype]
        print(f"{case}: {float(ms):.1f} ms, {share:.0%} of the {dtype} peak")


if __name__ == "__main__":
    main()
