"""fastbert.kernels.attention: the flash-attention forward kernel against its PyTorch reference, both layouts.

On CPU the kernels run through Triton's interpreter; ``fastbert.kernels`` picks it per launch for CPU tensors, so no
TRITON_INTERPRET is needed (see kernels/_common.py), and with 16 x 16 blocks there, sequences of 17 and 33 tokens
cross block boundaries. The cuda parametrization runs the compiled kernel (its own block sizes) on a GPU.
Comparison rule: kernel_checks.assert_close_to_ref (flash-attention's), fp32 within FP32_TOL = 1e-4 of the fp32
reference.

bf16 runs on CUDA only: under Triton 3.9's interpreter ``tl.dot`` on bf16 operands returns garbage (DESIGN.md §6);
fp32 and fp16 dots, bf16 loads/stores and casts are right there.
"""

import itertools

import pytest
import torch

from fastbert.kernels._common import compilable, compile_for_gpu, interpreting
from fastbert.kernels.attention import _attention_fwd_kernel, _attention_op, attention, attention_ref
from fastbert.kernels.attention_config import (
    _ATTENTION_CONFIGS,
    _attention_config,
    _gpu_arch,
    _gpu_config,
    _input_precision,
)
from fastbert.kernels.attention_varlen import _attention_varlen_op, attention_varlen, attention_varlen_ref
from kernel_checks import DTYPES, assert_close_to_ref, cubin_resources

FP32_TOL = 1e-4
HEAD_DIMS = [16, 25, 26, 64, 80]
HEADS = 2


def skip_bf16_on_interpreter(dtype, device):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("bf16 tl.dot is wrong under Triton 3.9's interpreter (DESIGN.md §6): bf16 is tested on CUDA")


def fused_qkv(tokens, head_dim, dtype, device, seed=0, pad_cols=0, scale=1.0):
    """The fused QKV GEMM's output [tokens, 3 * H * D] (optionally inside a wider buffer), as the model has it."""
    g = torch.Generator().manual_seed(seed)
    width = 3 * HEADS * head_dim
    buffer = scale * torch.randn(tokens, width + pad_cols, generator=g)
    return buffer.to(dtype).to(device)[:, pad_cols:]


def mixed_mask(seq_len, device):
    """[4, S]: right padding, left padding, holes, and a sequence with no real token at all."""
    mask = torch.ones(4, seq_len, dtype=torch.bool)
    mask[0, (seq_len + 1) // 2:] = False
    mask[1, : seq_len // 3] = False
    mask[2, 1::3] = False
    mask[3, :] = False
    return mask.to(device)


def bounds_of(mask):
    """key_bounds as the caller computes them: index of the last real token + 1 (0 for a row with none)."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask * positions).amax(dim=1).to(torch.int32)


def check_padded(qkv, mask, bounds=None):
    out = attention(qkv, mask, bounds)
    ref32 = attention_ref(qkv.float(), mask, bounds)
    assert_close_to_ref(out, ref32, attention_ref(qkv, mask, bounds, upcast=False), fp32_tol=FP32_TOL)
    assert out.shape == qkv.shape[:2] + qkv.shape[3:] and out.is_contiguous()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [1, 5, 17, 33])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_padded_mask(device, dtype, head_dim, seq_len):
    """Every mask shape at once; the sequence with no real key must come out as exact zeros."""
    skip_bf16_on_interpreter(dtype, device)
    mask = mixed_mask(seq_len, device)
    qkv = fused_qkv(4 * seq_len, head_dim, dtype, device).view(4, seq_len, 3, HEADS, head_dim)
    out = check_padded(qkv, mask)
    assert (out[3] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [1, 33])
@pytest.mark.parametrize("head_dim", [25, 64])
def test_attention_padded_no_mask(device, dtype, head_dim, seq_len):
    skip_bf16_on_interpreter(dtype, device)
    qkv = fused_qkv(2 * seq_len, head_dim, dtype, device).view(2, seq_len, 3, HEADS, head_dim)
    check_padded(qkv, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [1, 5, 17, 32, 33])
@pytest.mark.parametrize("head_dim", [26, 64])
def test_attention_key_bounds_bit_identical(device, dtype, head_dim, seq_len):
    """key_bounds consistent with the mask (right and left padding, holes, a fully padded row) skip key blocks
    without changing a bit: blocks past the bound would only have been masked. Also bound alone == the prefix mask it
    stands for. fp16 at S = 32 compares the EVEN_N mask-only kernel with the bounded one."""
    skip_bf16_on_interpreter(dtype, device)
    mask = mixed_mask(seq_len, device)
    qkv = fused_qkv(4 * seq_len, head_dim, dtype, device).view(4, seq_len, 3, HEADS, head_dim)
    bounds = bounds_of(mask)
    assert torch.equal(attention(qkv, mask, bounds), attention(qkv, mask))
    prefix = torch.arange(seq_len, device=device)[None, :] < bounds[:, None].long()
    assert torch.equal(attention(qkv, None, bounds), attention(qkv, prefix))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [1, 5, 17, 33])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_key_bounds_only(device, dtype, head_dim, seq_len):
    """key_bounds without a mask: what a caller passes when its mask is a right-padded prefix (the kernel then loads
    no mask at all). Every key, about half, one, none (zeros), against the reference, and bit for bit against the
    prefix mask with the same bounds (the dense path for the same batch)."""
    skip_bf16_on_interpreter(dtype, device)
    bounds = torch.tensor([seq_len, (seq_len + 1) // 2, 1, 0], dtype=torch.int32, device=device)
    qkv = fused_qkv(4 * seq_len, head_dim, dtype, device).view(4, seq_len, 3, HEADS, head_dim)
    out = check_padded(qkv, None, bounds)
    assert (out[3] == 0).all()
    prefix = torch.arange(seq_len, device=device)[None, :] < bounds[:, None]
    assert torch.equal(out, attention(qkv, prefix, bounds))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
def test_attention_key_bounds_inconsistent_with_mask(device, dtype, with_mask):
    """Bounds cutting into real tokens, past S, 0 and negative: keys >= bound are masked on top of the mask."""
    skip_bf16_on_interpreter(dtype, device)
    seq_len, head_dim = 33, 26
    mask = mixed_mask(seq_len, device) if with_mask else None
    bounds = torch.tensor([7, 40, 17, -1], dtype=torch.int32, device=device)
    qkv = fused_qkv(4 * seq_len, head_dim, dtype, device).view(4, seq_len, 3, HEADS, head_dim)
    out = check_padded(qkv, mask, bounds)
    assert (out[3] == 0).all()
    check_padded(qkv[:2], None if mask is None else mask[:2], torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("seq_len", [32, 64])
@pytest.mark.parametrize("head_dim", [26, 64])
@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
def test_attention_even_n(device, dtype, head_dim, seq_len, with_mask):
    """16-bit inputs with S a multiple of BLOCK_N (EVEN_N: no per-key bound check) against the reference, and bit for
    bit against the bound-checked loop (key_bounds = S turns EVEN_N off and masks nothing)."""
    skip_bf16_on_interpreter(dtype, device)
    if seq_len % _attention_config(head_dim, dtype, device)["BLOCK_N"]:
        pytest.skip("S is not a multiple of this device's BLOCK_N")
    mask = mixed_mask(seq_len, device)[:2] if with_mask else None
    qkv = fused_qkv(2 * seq_len, head_dim, dtype, device).view(2, seq_len, 3, HEADS, head_dim)
    out = check_padded(qkv, mask)
    full = torch.full((2,), seq_len, dtype=torch.int32, device=device)
    assert torch.equal(out, attention(qkv, mask, full))


def test_attention_reads_through_strides(device):
    """qkv inside a wider GEMM buffer (row stride > 3*H*D) and a mask that is a strided view: no copies needed."""
    seq_len, head_dim = 17, 26
    gemm = fused_qkv(3 * seq_len, head_dim, torch.float32, device, pad_cols=40)
    qkv = gemm.view(3, seq_len, 3, HEADS, head_dim)
    assert qkv.stride(1) == 3 * HEADS * head_dim + 40
    mask = mixed_mask(2 * seq_len, device)[:3, ::2]
    check_padded(qkv, mask)
    bounds = torch.tensor([9, 0, 12, 0, 17, 0], dtype=torch.int32, device=device)[::2]
    check_padded(qkv, mask, bounds)  # key_bounds as a strided view too


def test_attention_large_scores(device):
    """Scores in the hundreds: the online softmax (running max, rescaling) must not overflow."""
    seq_len, head_dim = 33, 64
    qkv = fused_qkv(4 * seq_len, head_dim, torch.float32, device, scale=6.0).view(4, seq_len, 3, HEADS, head_dim)
    check_padded(qkv, mixed_mask(seq_len, device))


def cu_seqlens_of(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 26, 80])
@pytest.mark.parametrize("lengths", [[3, 0, 1, 17, 5], [33], [1, 1, 0]], ids=["mixed", "one", "tiny"])
def test_attention_varlen(device, dtype, head_dim, lengths):
    """Packed sequences, an empty one and a length-1 one included; each attends only to itself."""
    skip_bf16_on_interpreter(dtype, device)
    cu_seqlens = cu_seqlens_of(lengths, device)
    qkv = fused_qkv(sum(lengths), head_dim, dtype, device).view(-1, 3, HEADS, head_dim)
    out = attention_varlen(qkv, cu_seqlens, max(lengths))
    ref32 = attention_varlen_ref(qkv.float(), cu_seqlens, max(lengths))
    assert_close_to_ref(
        out, ref32, attention_varlen_ref(qkv, cu_seqlens, max(lengths), upcast=False), fp32_tol=FP32_TOL
    )
    assert out.shape == (sum(lengths), HEADS, head_dim) and out.is_contiguous()


def test_attention_varlen_matches_padded(device):
    """The same sequences packed and padded give the same rows."""
    lengths, head_dim = [5, 17, 1], 26
    qkv = fused_qkv(sum(lengths), head_dim, torch.float32, device).view(-1, 3, HEADS, head_dim)
    packed = attention_varlen(qkv, cu_seqlens_of(lengths, device), max(lengths))
    padded_qkv = torch.zeros(len(lengths), max(lengths), 3, HEADS, head_dim, device=device)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool, device=device)
    for i, (start, n) in enumerate(zip([0, 5, 22], lengths)):
        padded_qkv[i, :n], mask[i, :n] = qkv[start : start + n], True
    padded = attention(padded_qkv, mask)
    torch.testing.assert_close(packed, padded[mask], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 1, 3, 20, 100])
@pytest.mark.parametrize("seq_len", [1, 17, 50])
def test_attention_window_padded(device, dtype, seq_len, window):
    """Banded attention (|i - j| <= window) with every mask shape and its key bounds: windows narrower than a block,
    a few blocks wide, and wider than the sequence; sequences longer than the window."""
    skip_bf16_on_interpreter(dtype, device)
    mask = mixed_mask(seq_len, device)
    qkv = fused_qkv(4 * seq_len, 26, dtype, device).view(4, seq_len, 3, HEADS, 26)
    for bounds in (None, bounds_of(mask)):
        out = attention(qkv, mask, bounds, window)
        ref32 = attention_ref(qkv.float(), mask, bounds, window=window)
        assert_close_to_ref(out, ref32, attention_ref(qkv, mask, bounds, upcast=False, window=window),
                            fp32_tol=FP32_TOL)
    if window >= seq_len:  # every key within reach: the unbanded result
        torch.testing.assert_close(out, attention(qkv, mask, bounds), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 2, 19])
def test_attention_window_varlen(device, dtype, window):
    """Packed sequences with a window, measured between offsets, and between columns where the mask had holes (the
    tokens' places in the padded batch): the packed result equals the padded one, row for row."""
    skip_bf16_on_interpreter(dtype, device)
    mask = mixed_mask(40, device)[:3]  # right padding, left padding, holes
    lengths = mask.sum(dim=1).tolist()
    cu_seqlens = cu_seqlens_of(lengths, device)
    padded_qkv = fused_qkv(3 * 40, 26, dtype, device).view(3, 40, 3, HEADS, 26)
    qkv = padded_qkv[mask]  # [T, 3, H, D]
    columns = torch.arange(40, device=device).expand(3, 40)[mask].to(torch.int32)
    out = attention_varlen(qkv, cu_seqlens, max(lengths), window, columns)
    ref32 = attention_varlen_ref(qkv.float(), cu_seqlens, max(lengths), window=window, columns=columns)
    same_dtype = attention_varlen_ref(qkv, cu_seqlens, max(lengths), upcast=False, window=window, columns=columns)
    assert_close_to_ref(out, ref32, same_dtype, fp32_tol=FP32_TOL)
    torch.testing.assert_close(ref32, attention_ref(padded_qkv.float(), mask, window=window)[mask])
    offsets = attention_varlen(qkv, cu_seqlens, max(lengths), window)  # columns = offsets: rows 0 and 1 only
    rows = cu_seqlens[2].item()
    torch.testing.assert_close(offsets[:rows], out[:rows], rtol=0, atol=0)


def relative_table(heads, radius, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, 2 * radius + 1, generator=g).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len, radius", [(1, 3), (17, 3), (50, 8), (150, 128)])
def test_attention_relative_bias_padded(device, dtype, seq_len, radius):
    """A per-head bias of the distance j - i (MPNet's), clamped to [-R, R]: distances inside and past the table,
    every mask shape, with and without key bounds, and together with a window."""
    skip_bf16_on_interpreter(dtype, device)
    mask = mixed_mask(seq_len, device)
    qkv = fused_qkv(4 * seq_len, 26, dtype, device).view(4, seq_len, 3, HEADS, 26)
    bias = relative_table(HEADS, radius, device)
    for bounds, window in ((None, None), (bounds_of(mask), None), (bounds_of(mask), 5)):
        out = attention(qkv, mask, bounds, window, bias)
        ref32 = attention_ref(qkv.float(), mask, bounds, window=window, relative_bias=bias)
        same_dtype = attention_ref(qkv, mask, bounds, upcast=False, window=window, relative_bias=bias)
        assert_close_to_ref(out, ref32, same_dtype, fp32_tol=FP32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_relative_bias_varlen(device, dtype):
    """Packed, distances between the tokens' columns (holes in the mask): the same rows as the padded layout."""
    skip_bf16_on_interpreter(dtype, device)
    mask = mixed_mask(40, device)[:3]
    lengths = mask.sum(dim=1).tolist()
    cu_seqlens = cu_seqlens_of(lengths, device)
    padded_qkv = fused_qkv(3 * 40, 26, dtype, device).view(3, 40, 3, HEADS, 26)
    qkv = padded_qkv[mask]
    columns = torch.arange(40, device=device).expand(3, 40)[mask].to(torch.int32)
    bias = relative_table(HEADS, 8, device)
    out = attention_varlen(qkv, cu_seqlens, max(lengths), None, columns, bias)
    ref32 = attention_varlen_ref(qkv.float(), cu_seqlens, max(lengths), columns=columns, relative_bias=bias)
    same_dtype = attention_varlen_ref(qkv, cu_seqlens, max(lengths), upcast=False, columns=columns,
                                      relative_bias=bias)
    assert_close_to_ref(out, ref32, same_dtype, fp32_tol=FP32_TOL)
    torch.testing.assert_close(ref32, attention_ref(padded_qkv.float(), mask, relative_bias=bias)[mask])


def test_attention_empty(device):
    qkv = fused_qkv(0, 16, torch.float32, device)
    assert attention(qkv.view(0, 5, 3, HEADS, 16)).shape == (0, 5, HEADS, 16)
    assert attention_varlen(qkv.view(0, 3, HEADS, 16), cu_seqlens_of([0, 0], device), 0).shape == (0, HEADS, 16)


def test_attention_fp32_precision_follows_torch_setting():
    """fp32 on CUDA uses TF32 only where torch allows it for fp32 matmuls; the CPU interpreter always multiplies
    exactly. (Checks the launcher's choice; no GPU needed.)"""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert _input_precision(torch.float32, cuda) == "ieee"
        torch.set_float32_matmul_precision("high")  # = torch.backends.cuda.matmul.allow_tf32 = True
        assert _input_precision(torch.float32, cuda) == "tf32"
        assert _input_precision(torch.float32, cpu) == "ieee"
    finally:
        torch.set_float32_matmul_precision(before)


# Shared memory per SM: H100 228 KiB, A100 164 KiB.
SHARED_MEMORY = {"sm90": 228 * 1024, "sm80": 164 * 1024}


def test_attention_config_table():
    """An entry for every arch, dtype class and BLOCK_D (16..128), each fitting its arch's shared memory by the
    estimate the table's comment uses: q tile + stages * (k and v tiles)."""
    keys = set(itertools.product(("sm80", "sm90"), ("16bit", "fp32"), (16, 32, 64, 128)))
    assert set(_ATTENTION_CONFIGS) == keys
    for (arch, dtype_class, block_d), (block_m, block_n, num_warps, num_stages) in _ATTENTION_CONFIGS.items():
        elt = 4 if dtype_class == "fp32" else 2
        shared = block_m * block_d * elt + num_stages * 2 * block_n * block_d * elt
        assert shared <= SHARED_MEMORY[arch], (arch, dtype_class, block_d, shared)


def test_attention_config_asks_the_arch_once_per_cuda_device(monkeypatch):
    """The capability is asked only for CUDA devices, once per device index; 8.x -> sm80, 9.x and above -> sm90."""
    capabilities = {0: (8, 0), 1: (9, 0), 2: (10, 0), 3: (7, 5)}
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or capabilities[i])
    _gpu_arch.cache_clear()
    try:
        _attention_config(64, torch.float16, torch.device("cpu"))
        assert asked == []
        assert [_gpu_arch(i) for i in (0, 1, 2, 3, 0, 1)] == ["sm80", "sm90", "sm90", "sm80", "sm80", "sm90"]
        assert asked == [0, 1, 2, 3]
        if not interpreting(torch.device("cuda")):
            config = _attention_config(64, torch.float16, torch.device("cuda", 1))
            assert config == _gpu_config("sm90", 64, torch.float16) and asked == [0, 1, 2, 3]
    finally:
        _gpu_arch.cache_clear()  # forget the fake capabilities


# Every kernel variant the launchers run: name -> (HAS_MASK, HAS_BOUND, EVEN_N, VARLEN, HAS_WINDOW, HAS_COLUMNS,
# HAS_REL_BIAS); EVEN_N for 16-bit only.
KERNEL_VARIANTS = {  # (mask, bounds, even_n, varlen, window, columns, bias, DeBERTa's tables)
    "no mask": (False, False, False, False, False, False, False, False),  # fp32, or 16-bit with S % BLOCK_N != 0
    "mask": (True, False, False, False, False, False, False, False),
    # the dense masked path (unpad=False, torch.compile, CUDA graphs)
    "mask+bounds": (True, True, False, False, False, False, False, False),
    "bounds": (False, True, False, False, False, False, False, False),  # a right-padded prefix mask as key_bounds alone
    "varlen": (False, False, False, True, False, False, False, False),
    "even_n": (False, False, True, False, False, False, False, False),
    "even_n+mask": (True, False, True, False, False, False, False, False),
    # ModernBERT's local layers: packed (columns), and dense with mask + bounds
    "varlen+window": (False, False, False, True, True, True, False, False),
    "mask+bounds+window": (True, True, False, False, True, False, False, False),
    # MPNet's relative bias: packed (columns), and dense with mask + bounds
    "varlen+bias": (False, False, False, True, False, True, True, False),
    "mask+bounds+bias": (True, True, False, False, False, False, True, False),
    # DeBERTa's c2p and p2c tables: packed (columns), dense with a mask (its padding queries masked too; full key
    # blocks in 16-bit when S is a multiple of BLOCK_N) and dense without padding
    "varlen+tables": (False, False, False, True, False, True, False, True),
    "mask+tables": (True, False, False, False, False, False, False, True),
    "even_n+mask+tables": (True, False, True, False, False, False, False, True),
    "tables": (False, False, False, False, False, False, False, True),
    "even_n+tables": (False, False, True, False, False, False, False, True),
}


@pytest.mark.skipif(not compilable(_attention_fwd_kernel), reason="TRITON_INTERPRET=1 at import")
@pytest.mark.parametrize("dtype, precision", [(torch.float16, "tf32"), (torch.bfloat16, "tf32"),
                                              (torch.float32, "ieee"), (torch.float32, "tf32")])
@pytest.mark.parametrize("head_dim", [25, 64, 128])
def test_attention_compiles_for_h100(dtype, precision, head_dim):
    """The compiled path, which the interpreter never exercises (early exit, loop-carried types, the constexpr
    layouts), builds for sm_90 with the table's sm90 block sizes, fits H100's shared memory and spills no registers
    (no GPU needed; compile_for_gpu specializes like a launch, which changes register allocation). Every variant in
    KERNEL_VARIANTS; the padded ones without EVEN_N at S = 128 and at S = 100 (a length that is not a multiple of 16
    specializes differently, and is what sends a 16-bit batch without bounds to the checked loop)."""
    qkv, mask, i32 = torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.int32)
    f32 = torch.empty(0)
    hidden = 12 * head_dim
    for name, variant in KERNEL_VARIANTS.items():
        has_mask, has_bound, even_n, varlen, has_window, has_columns, has_bias, tables = variant
        if even_n and dtype == torch.float32:
            continue
        config = _gpu_config("sm90", head_dim, dtype, has_window or has_bias or tables, tables)
        for seq_len in [0] if varlen else [128] if even_n else [100, 128]:
            compiled = compile_for_gpu(
                _attention_fwd_kernel, qkv, qkv, qkv, qkv, mask, i32, i32, i32, f32, qkv, qkv, i32,
                seq_len * 3 * hidden, 3 * hidden, head_dim, hidden, head_dim, seq_len, 1, 1,
                seq_len, 12, head_dim, 0.18, 64, 128, 4096, 511, 511, HAS_MASK=has_mask, HAS_BOUND=has_bound,
                EVEN_N=even_n, VARLEN=varlen, HAS_WINDOW=has_window, HAS_COLUMNS=has_columns, HAS_REL_BIAS=has_bias,
                HAS_C2P=tables, HAS_P2C=tables, MASK_QUERIES=tables and has_mask, INPUT_PRECISION=precision, **config,
            )
            assert compiled.metadata.shared <= 227 * 1024
            resources = cubin_resources(compiled)
            if resources is not None:
                assert resources[1] == 0, (f"{name}, S = {seq_len}: "
                                           f"{resources[0]} registers, {resources[1]} bytes of spills")


def test_attention_opcheck():
    """torch.library's checks of both registered ops: schema, fake (meta) impl, autograd registration, AOT dispatch."""
    qkv = fused_qkv(10, 16, torch.float32, "cpu")
    torch.library.opcheck(_attention_op, (qkv.view(2, 5, 3, HEADS, 16), mixed_mask(5, "cpu")[:2], None, None, None))
    bounds, bias = torch.tensor([3, 5], dtype=torch.int32), relative_table(HEADS, 3, "cpu")
    torch.library.opcheck(_attention_op, (qkv.view(2, 5, 3, HEADS, 16), None, bounds, 2, bias))
    cu_seqlens = cu_seqlens_of([3, 0, 7], "cpu")
    torch.library.opcheck(_attention_varlen_op, (qkv.view(10, 3, HEADS, 16), cu_seqlens, 7, None, None, None))
    columns = torch.tensor([0, 1, 4, 0, 2, 3, 5, 6, 8, 9], dtype=torch.int32)
    torch.library.opcheck(_attention_varlen_op, (qkv.view(10, 3, HEADS, 16), cu_seqlens, 7, 1, columns, bias))


def test_attention_window_errors():
    qkv = fused_qkv(10, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="window must be None or a non-negative int .*, got -1"):
        attention(qkv.view(2, 5, 3, HEADS, 16), window=-1)
    with pytest.raises(ValueError, match="window must be None or a non-negative int .*, got True"):
        attention(qkv.view(2, 5, 3, HEADS, 16), window=True)
    packed, cu_seqlens = qkv.view(10, 3, HEADS, 16), cu_seqlens_of([5, 5], "cpu")
    columns = torch.arange(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="columns are the tokens' positions for a window or a relative bias"):
        attention_varlen(packed, cu_seqlens, 5, None, columns)
    with pytest.raises(TypeError, match="relative_bias must be a float32 tensor, got torch.float16"):
        attention(qkv.view(2, 5, 3, HEADS, 16), relative_bias=relative_table(HEADS, 3, "cpu").half())
    with pytest.raises(ValueError, match=r"relative_bias must be \[heads, 2 \* radius \+ 1\] = \[2, odd\], got"):
        attention(qkv.view(2, 5, 3, HEADS, 16), relative_bias=torch.zeros(HEADS, 6))
    with pytest.raises(TypeError, match="columns must be an int32 tensor, got torch.int64"):
        attention_varlen(packed, cu_seqlens, 5, 2, columns.long())
    with pytest.raises(ValueError, match=r"columns must be contiguous \[tokens\] = \(10,\), got \(9,\)"):
        attention_varlen(packed, cu_seqlens, 5, 2, columns[:9])


def test_attention_errors():
    qkv = fused_qkv(10, 16, torch.float32, "cpu").view(2, 5, 3, HEADS, 16)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"qkv must be \[batch, seq_len, 3, heads, head_dim\]"):
        attention(qkv[:, :, :2], mask)
    with pytest.raises(ValueError, match=r"qkv must be \[batch, seq_len, 3, heads, head_dim\]"):
        attention(qkv[0], None)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        attention(qkv.double(), mask)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 128\]"):
        attention(torch.randn(1, 2, 3, 1, 160), None)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        attention(qkv.transpose(3, 4), None)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        attention(qkv, mask.int())
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 4\)"):
        attention(qkv, mask[:, :4])
    bounds = torch.tensor([5, 3], dtype=torch.int32)
    with pytest.raises(TypeError, match="key_bounds must be an int32 tensor, got torch.int64"):
        attention(qkv, mask, bounds.long())
    with pytest.raises(TypeError, match="key_bounds must be an int32 tensor, got list"):
        attention(qkv, mask, [5, 3])
    with pytest.raises(ValueError, match=r"key_bounds has shape \(2, 1\), expected \[batch\] = \(2,\)"):
        attention(qkv, mask, bounds[:, None])
    with pytest.raises(ValueError, match=r"key_bounds has shape \(1,\)"):
        attention(qkv, None, bounds[:1])
    with pytest.raises(ValueError, match="key_bounds is on meta but qkv is on cpu"):
        attention(qkv, mask, bounds.to("meta"))
    packed = qkv.view(10, 3, HEADS, 16)
    with pytest.raises(ValueError, match=r"qkv must be \[tokens, 3, heads, head_dim\]"):
        attention_varlen(qkv, cu_seqlens_of([5, 5], "cpu"), 5)
    with pytest.raises(TypeError, match="cu_seqlens must be an int32 tensor"):
        attention_varlen(packed, cu_seqlens_of([5, 5], "cpu").long(), 5)
    with pytest.raises(ValueError, match="cu_seqlens must be \\[batch \\+ 1\\]"):
        attention_varlen(packed, cu_seqlens_of([5, 5], "cpu")[None], 5)
    with pytest.raises(ValueError, match="max_seqlen must be a non-negative int"):
        attention_varlen(packed, cu_seqlens_of([5, 5], "cpu"), -1)
    strided = torch.tensor([0, 99, 5, 99, 10], dtype=torch.int32)[::2]  # [0, 5, 10]: the kernel would read 0, 99
    with pytest.raises(ValueError, match=r"cu_seqlens must be contiguous .*got strides \(2,\)"):
        attention_varlen(packed, strided, 5)
