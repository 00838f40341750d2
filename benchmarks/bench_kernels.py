"""Each fused kernel against its torch equivalent, on a CUDA GPU, with the working shown.

For every kernel: the fewest bytes it must move and the FLOPs it must do, the time of the fastbert kernel and of the
torch ops it replaces (median of ``triton.testing.do_bench``, after warm-up, on random data), and the achieved
bandwidth next to the copy bandwidth measured in the same run. Correctness is checked against the reference first,
with a tolerance in units of the dtype's epsilon at the output's magnitude (``ulp_tolerance``).

    python benchmarks/bench_kernels.py --out DIR      # writes kernels.csv and kernels.md
"""

import argparse
import csv
import datetime
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def _do_bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth_gbs(numel: int = 64 * 2**20) -> float:
    """Device-to-device copy of 128 MiB of fp16: read + write, the bandwidth any memory-bound kernel can hope for."""
    src = torch.randn(numel, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = _do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


# Tolerance of a kernel's output against its reference (the same math in fp32 from the same inputs, rounded to the
# I/O dtype), in units of the dtype's machine epsilon at the output's largest magnitude:
#     tol = ULPS * eps(dtype) * max |ref|
# An fp16/bf16 result rounded once from fp32 is within half an ulp of the exact value, so kernel and reference differ
# by at most one ulp of the element, and one ulp of any element is <= eps * max |ref|. 2 leaves room for fp32 sums
# taken in another order; attention gets 4: its probabilities are rounded to the I/O dtype before P @ V (as in flash
# attention), which adds up to half an ulp of |V| spread over the keys. A fixed atol cannot serve both dtypes and every
# magnitude: bf16's ulp at |y| = 16 is 0.125 (a correct kernel fails atol 0.02), while 0.02 is 20 ulps of fp16 at 1.
ULPS = {"elementwise": 2, "attention": 4}


def ulp_tolerance(ref: torch.Tensor, ulps: float, dtype: torch.dtype | None = None) -> float:
    """``ulps * eps(dtype) * max |ref|`` (dtype: ref's own by default); at least the dtype's smallest normal."""
    finfo = torch.finfo(dtype or ref.dtype)
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    return max(ulps * finfo.eps * scale, finfo.tiny)


def _case(name, shape, nbytes, flops, fastbert_fn, torch_fn, ref_fn, ulps):
    got, want = fastbert_fn(), ref_fn()
    err = (got.float() - want.float()).abs().max().item()
    tol = ulp_tolerance(want, ulps, got.dtype)
    if not err <= tol:
        raise AssertionError(f"{name} {shape}: max |error| {err:.3g} > {tol:.3g} ({ulps} x eps({got.dtype}) x "
                             f"max|ref| {want.float().abs().max().item():.3g}): not timing a wrong kernel")
    ours, theirs = _do_bench(fastbert_fn), _do_bench(torch_fn)
    return {
        "kernel": name, "shape": shape, "bytes": nbytes, "flops": flops, "max_abs_err": err, "tol": tol,
        "fastbert_ms": ours, "torch_ms": theirs, "speedup": theirs / ours,
        "fastbert_gbs": nbytes / ours / 1e6, "torch_gbs": nbytes / theirs / 1e6,
    }


def kernel_cases(dtype: torch.dtype) -> list[dict]:
    from fastbert import _extension
    from fastbert.kernels import activation, attention, embedding, layer_norm

    dev, size = "cuda", torch.finfo(dtype).bits // 8
    rows = []
    for tokens, hidden in ((4096, 768), (4096, 3072)):
        x, res = (torch.randn(tokens, hidden, device=dev, dtype=dtype) for _ in range(2))
        w, b, bias = (torch.randn(hidden, device=dev, dtype=dtype) for _ in range(3))
        # x and residual read, output written: 3 tensors of tokens x hidden; parameters are negligible.
        rows.append(_case(
            "bias_residual_layer_norm", f"{tokens}x{hidden}", 3 * tokens * hidden * size, 8 * tokens * hidden,
            lambda: layer_norm.layer_norm(x, w, b, 1e-12, bias=bias, residual=res),
            lambda: F.layer_norm(x + bias + res, (hidden,), w, b, 1e-12),
            lambda: layer_norm.layer_norm_ref(x, w, b, 1e-12, bias=bias, residual=res, upcast=True),
            ULPS["elementwise"]))
        # x read, output written.
        rows.append(_case(
            "bias_gelu", f"{tokens}x{hidden}", 2 * tokens * hidden * size, 20 * tokens * hidden,
            lambda: activation.bias_act(x, bias, "gelu"),
            lambda: F.gelu(x + bias),
            lambda: activation.bias_act_ref(x, bias, "gelu", upcast=True), ULPS["elementwise"]))
        rows.append(_case(
            "gelu_layer_norm", f"{tokens}x{hidden}", 2 * tokens * hidden * size, 28 * tokens * hidden,
            lambda: layer_norm.layer_norm(x, w, b, 1e-12, bias=bias, activation="gelu"),
            lambda: F.layer_norm(F.gelu(x + bias), (hidden,), w, b, 1e-12),
            lambda: layer_norm.layer_norm_ref(x, w, b, 1e-12, bias=bias, activation="gelu", upcast=True),
            ULPS["elementwise"]))

    tokens, hidden, vocab = 32 * 512, 768, 30522
    ids = torch.randint(0, vocab, (tokens,), device=dev)
    pos = torch.arange(512, device=dev).repeat(32)
    tt = torch.zeros(tokens, dtype=torch.long, device=dev)
    tables = [torch.randn(n, hidden, device=dev, dtype=dtype) for n in (vocab, 512, 2)]
    w, b = (torch.randn(hidden, device=dev, dtype=dtype) for _ in range(2))
    args = (ids, pos, tt, *tables, w, b, 1e-12)
    # Per token: a word row read (positions and token types stay in cache across the batch), an output row written,
    # three int64 ids read.
    emb_bytes = tokens * (2 * hidden * size + 3 * 8)
    ref = lambda: embedding.embedding_layer_norm_ref(*args, upcast=True)  # noqa: E731
    torch_emb = lambda: F.layer_norm(tables[0][ids] + tables[1][pos] + tables[2][tt], (hidden,), w, b, 1e-12)  # noqa: E731
    ext_reasons = _extension.cuda_unavailable_reasons(ids.device)
    if ext_reasons:
        print("embedding (cuda-ext) not timed:", "; ".join(ext_reasons))
    else:
        # The CUDA kernel and its Triton fallback compute the same op: they must agree to rounding.
        ext_vs_triton = (_extension.embedding_layer_norm(*args).float() - embedding.embedding_layer_norm(*args).float())
        print(f"embedding: max |cuda-ext - triton| = {ext_vs_triton.abs().max().item():.3g}")
        rows.append(_case("embedding (cuda-ext)", f"{tokens}x{hidden}", emb_bytes, 8 * tokens * hidden,
                          lambda: _extension.embedding_layer_norm(*args), torch_emb, ref, ULPS["elementwise"]))
    rows.append(_case("embedding (triton)", f"{tokens}x{hidden}", emb_bytes, 8 * tokens * hidden,
                      lambda: embedding.embedding_layer_norm(*args), torch_emb, ref, ULPS["elementwise"]))

    batch, heads, seq, head_dim = 32, 12, 512, 64
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=dev, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    att_flops = 4 * batch * heads * seq * seq * head_dim
    att_bytes = 4 * batch * seq * heads * head_dim * size
    rows.append(_case("attention", f"B{batch} H{heads} S{seq} D{head_dim}", att_bytes, att_flops,
                      lambda: attention.attention(qkv),
                      lambda: F.scaled_dot_product_attention(q, k, v),
                      lambda: attention.attention_ref(qkv), ULPS["attention"]))
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(seq)[None] < lengths[:, None]
    mask = mask.to(dev)
    additive = torch.zeros(mask.shape, device=dev, dtype=dtype).masked_fill_(~mask, -math.inf)[:, None, None]
    rows.append(_case("attention (padding mask)", f"B{batch} H{heads} S{seq} D{head_dim}", att_bytes, att_flops,
                      lambda: attention.attention(qkv, mask),
                      lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                      lambda: attention.attention_ref(qkv, mask), ULPS["attention"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows = kernel_cases(getattr(torch, args.dtype))
    device = torch.cuda.get_device_name()
    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        row["pct_of_copy_bw"] = 100 * row["fastbert_gbs"] / copy_gbs
    with open(args.out / "kernels.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import triton

    lines = [f"# Kernels vs torch — {device}, {args.dtype}, torch {torch.__version__}, triton {triton.__version__}, "
             f"{stamp}", "", f"Copy bandwidth measured in this run: {copy_gbs:.0f} GB/s", "",
             "| kernel | shape | fastbert ms | torch ms | speedup | fastbert GB/s | % copy BW | max abs err | tol |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['shape']} | {r['fastbert_ms']:.4f} | {r['torch_ms']:.4f} | {r['speedup']:.2f} | "
              f"{r['fastbert_gbs']:.0f} | {r['pct_of_copy_bw']:.0f}% | {r['max_abs_err']:.2g} | {r['tol']:.2g} |"
              for r in rows]
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
