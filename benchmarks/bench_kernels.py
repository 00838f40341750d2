"""Each fused kernel against its torch equivalent, on a CUDA GPU, with the working shown.

For every kernel: the fewest bytes it must move and the FLOPs it must do, the time of the fastbert kernel and of the
torch ops it replaces (median of ``triton.testing.do_bench``, after warm-up, on random data), and the achieved
bandwidth next to the copy bandwidth measured in the same run. Correctness is checked against the reference first,
with a tolerance in units of the dtype's epsilon at the output's magnitude (``ulp_tolerance``).

A case that misses its tolerance or raises gets a row without timings whose status says why ("mismatch: ...",
"error: ..."), and the table goes on; the exit status is 1 when any row is not ok. kernels.csv and kernels.md are
rewritten after every row, so a run that is killed keeps the rows it finished.

    python benchmarks/bench_kernels.py --out DIR      # writes kernels.csv and kernels.md
"""

import argparse
import csv
import datetime
import math
import sys
import traceback
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
# The dense + residual + LayerNorm rows get 4 as well: their GEMM output is rounded to the I/O dtype before the
# LayerNorm reads it (as in the model), about half an ulp of the output once normalized (0.6-0.75 x eps x max |ref|
# when emulated on CPU), and cuBLAS may sum split-K partials in the I/O dtype (torch's
# allow_{fp16,bf16}_reduced_precision_reduction).
ULPS = {"elementwise": 2, "attention": 4, "gemm+layer_norm": 4}


def ulp_tolerance(ref: torch.Tensor, ulps: float, dtype: torch.dtype | None = None) -> float:
    """``ulps * eps(dtype) * max |ref|`` (dtype: ref's own by default); at least the dtype's smallest normal."""
    finfo = torch.finfo(dtype or ref.dtype)
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    return max(ulps * finfo.eps * scale, finfo.tiny)


FIELDS = ["kernel", "shape", "status", "bytes", "flops", "max_abs_err", "tol", "fastbert_ms", "torch_ms", "speedup",
          "fastbert_gbs", "torch_gbs", "fastbert_tflops", "pct_of_copy_bw"]


def _case(name, shape, nbytes, flops, fastbert_fn, torch_fn, ref_fn, ulps) -> dict:
    """One row: fastbert_fn checked against ref_fn, then fastbert_fn and torch_fn timed. A miss or an exception
    leaves the row's timings empty and says why in its status (the traceback goes to stderr): never time a wrong
    kernel, never lose the other rows."""
    row = dict.fromkeys(FIELDS)
    row.update(kernel=name, shape=shape, bytes=nbytes, flops=flops, status="ok")
    try:
        got, want = fastbert_fn(), ref_fn()
        err = (got.float() - want.float()).abs().max().item()
        tol = ulp_tolerance(want, ulps, got.dtype)
        row.update(max_abs_err=err, tol=tol)
        if not err <= tol:
            row["status"] = (f"mismatch: max abs error {err:.3g} > tol {tol:.3g} ({ulps} x eps({got.dtype}) x "
                             f"max abs ref {want.float().abs().max().item():.3g})")
            return row
        ours, theirs = _do_bench(fastbert_fn), _do_bench(torch_fn)
    except Exception as e:  # noqa: BLE001 - any failure of one case is that row's result
        traceback.print_exc()
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        return row
    row.update(fastbert_ms=ours, torch_ms=theirs, speedup=theirs / ours, fastbert_gbs=nbytes / ours / 1e6,
               torch_gbs=nbytes / theirs / 1e6, fastbert_tflops=flops / ours / 1e9)
    return row


def kernel_cases(dtype: torch.dtype):
    """Yields one row per case (see ``_case``), as each completes."""
    from fastbert import _extension
    from fastbert.ops import embedding as embedding_op
    from fastbert.kernels import activation, attention, attention_varlen, embedding, layer_norm

    dev, size = "cuda", torch.finfo(dtype).bits // 8
    for tokens, hidden in ((4096, 768), (4096, 3072)):
        x, res = (torch.randn(tokens, hidden, device=dev, dtype=dtype) for _ in range(2))
        w, b, bias = (torch.randn(hidden, device=dev, dtype=dtype) for _ in range(3))
        # x and residual read, output written: 3 tensors of tokens x hidden; parameters are negligible.
        yield _case(
            "bias_residual_layer_norm", f"{tokens}x{hidden}", 3 * tokens * hidden * size, 8 * tokens * hidden,
            lambda: layer_norm.layer_norm(x, w, b, 1e-12, bias=bias, residual=res),
            lambda: F.layer_norm(x + bias + res, (hidden,), w, b, 1e-12),
            lambda: layer_norm.layer_norm_ref(x, w, b, 1e-12, bias=bias, residual=res, upcast=True),
            ULPS["elementwise"])
        # x read, output written.
        yield _case(
            "bias_gelu", f"{tokens}x{hidden}", 2 * tokens * hidden * size, 20 * tokens * hidden,
            lambda: activation.bias_act(x, bias, "gelu"),
            lambda: F.gelu(x + bias),
            lambda: activation.bias_act_ref(x, bias, "gelu", upcast=True), ULPS["elementwise"])
        yield _case(
            "gelu_layer_norm", f"{tokens}x{hidden}", 2 * tokens * hidden * size, 28 * tokens * hidden,
            lambda: layer_norm.layer_norm(x, w, b, 1e-12, bias=bias, activation="gelu"),
            lambda: F.layer_norm(F.gelu(x + bias), (hidden,), w, b, 1e-12),
            lambda: layer_norm.layer_norm_ref(x, w, b, 1e-12, bias=bias, activation="gelu", upcast=True),
            ULPS["elementwise"])

    # BertSelfOutput (768 -> 768) and BertOutput (3072 -> 768), GEMM included: LayerNorm(x W^T + b + residual), the
    # two ways of feeding the fused LayerNorm. addmm(residual, x, W^T) folds the residual into the GEMM (cuBLAS first
    # copies it into the output) and leaves the dense bias to the kernel; linear(x, W, b) takes the bias in cuBLASLt's
    # epilogue and the kernel adds the residual (what fastbert/ops/norm.py runs). torch: HF's linear, add, LayerNorm.
    tokens, hidden = 4096, 768
    for k_in in (768, 3072):
        x = torch.randn(tokens, k_in, device=dev, dtype=dtype)
        weight = (torch.randn(hidden, k_in, device=dev) / math.sqrt(k_in)).to(dtype)  # outputs of unit scale
        res = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        b, w, ln_b = (torch.randn(hidden, device=dev, dtype=dtype) for _ in range(3))
        # x, W and the residual read, the output written (the GEMM's output round trip is what fusing saves).
        gemm_bytes = (tokens * k_in + hidden * k_in + 2 * tokens * hidden) * size
        gemm_flops = 2 * tokens * k_in * hidden + 8 * tokens * hidden
        ref = lambda: layer_norm.layer_norm_ref(  # noqa: E731
            x.float() @ weight.float().t(), w, ln_b, 1e-12, bias=b, residual=res, upcast=True).to(dtype)
        torch_dense = lambda: F.layer_norm(F.linear(x, weight, b) + res, (hidden,), w, ln_b, 1e-12)  # noqa: E731
        yield _case("dense_residual_layer_norm (addmm, LN bias)", f"{tokens}x{k_in}->{hidden}", gemm_bytes,
                    gemm_flops,
                    lambda: layer_norm.layer_norm(torch.addmm(res, x, weight.t()), w, ln_b, 1e-12, bias=b),
                    torch_dense, ref, ULPS["gemm+layer_norm"])
        yield _case("dense_residual_layer_norm (linear, LN residual)", f"{tokens}x{k_in}->{hidden}", gemm_bytes,
                    gemm_flops,
                    lambda: layer_norm.layer_norm(F.linear(x, weight, b), w, ln_b, 1e-12, residual=res),
                    torch_dense, ref, ULPS["gemm+layer_norm"])

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
        yield _case("embedding (cuda-ext)", f"{tokens}x{hidden}", emb_bytes, 8 * tokens * hidden,
                    lambda: embedding_op.embedding_layer_norm(*args), torch_emb, ref, ULPS["elementwise"])
        # The CUDA kernel and its Triton fallback compute the same op: they must agree to rounding.
        try:
            ext_vs_triton = (embedding_op.embedding_layer_norm(*args).float()
                             - embedding.embedding_layer_norm(*args).float())
            print(f"embedding: max |cuda-ext - triton| = {ext_vs_triton.abs().max().item():.3g}")
        except Exception:  # noqa: BLE001 - the rows say which of the two failed
            traceback.print_exc()
    yield _case("embedding (triton)", f"{tokens}x{hidden}", emb_bytes, 8 * tokens * hidden,
                lambda: embedding.embedding_layer_norm(*args), torch_emb, ref, ULPS["elementwise"])

    # Attention, each variant the model runs, on one batch of right-padded rows (real lengths S/4..S):
    #   dense      no padding (every row full);
    #   masked     the padded batch as a CUDA graph or unpad=False runs it: padding mask + key bounds (the key loop
    #              stops at each row's last real key), and the padding mask alone, to show what the bounds save;
    #   bounds     key bounds only (a right-padded prefix: no mask read);
    #   varlen     the real tokens packed, cu_seqlens (unpad=True).
    # torch: F.scaled_dot_product_attention on the padded batch, with the additive mask where there is padding (what
    # HF's sdpa attention runs on the same batch).
    batch, heads, seq, head_dim = 32, 12, 512, 64
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=dev, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    shape = f"B{batch} H{heads} S{seq} D{head_dim}"
    row_bytes = heads * head_dim * size  # one token's q, k, v or output
    yield _case("attention", shape, 4 * batch * seq * row_bytes, 4 * batch * heads * seq * seq * head_dim,
                lambda: attention.attention(qkv),
                lambda: F.scaled_dot_product_attention(q, k, v),
                lambda: attention.attention_ref(qkv), ULPS["attention"])
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=torch.Generator().manual_seed(0))
    lengths[0] = seq
    real = int(lengths.sum())
    mask = (torch.arange(seq)[None] < lengths[:, None]).to(dev)
    bounds = lengths.to(device=dev, dtype=torch.int32)
    additive = torch.zeros(mask.shape, device=dev, dtype=dtype).masked_fill_(~mask, -math.inf)[:, None, None]
    torch_masked = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive)  # noqa: E731
    shape = f"{shape} {100 * real // (batch * seq)}% real"
    # Masked: every query row computed against every key. Bounded: q read and out written for every row, k and v
    # only for the real keys, each query row against its row's real keys.
    masked_bytes, masked_flops = 4 * batch * seq * row_bytes, 4 * batch * heads * seq * seq * head_dim
    bounded_bytes, bounded_flops = (2 * batch * seq + 2 * real) * row_bytes, 4 * heads * seq * real * head_dim
    yield _case("attention (mask + key bounds)", shape, bounded_bytes, bounded_flops,
                lambda: attention.attention(qkv, mask, bounds), torch_masked,
                lambda: attention.attention_ref(qkv, mask, bounds), ULPS["attention"])
    yield _case("attention (mask)", shape, masked_bytes, masked_flops,
                lambda: attention.attention(qkv, mask), torch_masked,
                lambda: attention.attention_ref(qkv, mask), ULPS["attention"])
    yield _case("attention (key bounds)", shape, bounded_bytes, bounded_flops,
                lambda: attention.attention(qkv, None, bounds), torch_masked,
                lambda: attention.attention_ref(qkv, None, bounds), ULPS["attention"])
    packed = qkv[mask]  # [real tokens, 3, H, D]
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(device=dev, dtype=torch.int32)
    max_seqlen = int(lengths.max())
    # Packed: q, k, v read and out written for the real tokens only; each against its own sequence's keys.
    yield _case("attention_varlen (packed)", shape, 4 * real * row_bytes,
                4 * heads * head_dim * int((lengths.long() ** 2).sum()),
                lambda: attention_varlen.attention_varlen(packed, cu_seqlens, max_seqlen), torch_masked,
                lambda: attention_varlen.attention_varlen_ref(packed, cu_seqlens, max_seqlen), ULPS["attention"])


def write_tables(out: Path, rows: list[dict], title: str, copy_gbs: float) -> list[str]:
    """kernels.csv and kernels.md in ``out`` (rewritten whole); returns the markdown lines."""
    with open(out / "kernels.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)

    def cells(r):  # a row that is not ok has its status and empty cells for what it lacks
        fmt = {"fastbert_ms": "{:.4f}", "torch_ms": "{:.4f}", "speedup": "{:.2f}", "fastbert_gbs": "{:.0f}",
               "pct_of_copy_bw": "{:.0f}%", "fastbert_tflops": "{:.1f}", "max_abs_err": "{:.2g}", "tol": "{:.2g}"}
        status = r["status"].replace("|", "\\|")  # an exception's message may hold one
        return [r["kernel"], r["shape"], status] + ["" if r[k] is None else f.format(r[k]) for k, f in fmt.items()]

    lines = [title, "", f"Copy bandwidth measured in this run: {copy_gbs:.0f} GB/s", "",
             "| kernel | shape | status | fastbert ms | torch ms | speedup | fastbert GB/s | % copy BW "
             "| fastbert TFLOP/s | max abs err | tol |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    title = (f"# Kernels vs torch — {torch.cuda.get_device_name()}, {args.dtype}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {datetime.date.today().isoformat()}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in kernel_cases(getattr(torch, args.dtype)):
        if row["fastbert_gbs"] is not None:
            row["pct_of_copy_bw"] = 100 * row["fastbert_gbs"] / copy_gbs
        rows.append(row)
        write_tables(args.out, rows, title, copy_gbs)
        print(f"{row['kernel']} {row['shape']}: {row['status']}", flush=True)
    print("\n".join(write_tables(args.out, rows, title, copy_gbs)))
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} of {len(rows)} cases not ok: " + "; ".join(r["kernel"] for r in failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
