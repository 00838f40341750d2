"""fastbert.kernels.rope: the in-place rotary kernel against its PyTorch reference, and the reference against HF.

The reference is checked against transformers' own rotary module and ``apply_rotary_pos_emb`` (GTE's; skipped where
the installed transformers lacks it): bit for bit in every dtype. The kernel runs through Triton's interpreter on CPU
tensors; the cuda parametrization runs the compiled kernel on a GPU.
Comparison rule: kernel_checks.assert_close_to_ref (fp32 within 1e-5 of the fp32 reference; 16-bit at most twice the
reference's own error in that dtype).
"""

import pytest
import torch

from fastbert.kernels._common import compilable, compile_for_gpu
from fastbert.kernels.rope import _rotary_kernel, _rotary_op, rotary_, rotary_ref, rotary_tables
from kernel_checks import DTYPES, assert_close_to_ref, cubin_resources


def make_inputs(tokens, num_heads, head_dim, dtype, device, theta=10000.0, max_position=4096, seed=0):
    """qkv [tokens, 3 * H * D] ~ N(0, 1), positions in [0, max_position), inv_freq as transformers builds it."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, 3 * num_heads * head_dim, generator=g).to(dtype).to(device)
    positions = torch.randint(0, max_position, (tokens,), generator=g).to(device)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return qkv, positions, inv_freq.to(device)


def check_against_ref(qkv, positions, inv_freq, num_heads, scaling=1.0):
    cos, sin = rotary_tables(positions, inv_freq, scaling)
    ref32 = rotary_ref(qkv.float(), cos, sin, num_heads)
    same_dtype = rotary_ref(qkv, cos, sin, num_heads)
    out = rotary_(qkv.clone(), cos, sin, num_heads)
    assert_close_to_ref(out, ref32, same_dtype)
    hidden = qkv.shape[1] // 3
    assert torch.equal(out[:, 2 * hidden:], qkv[:, 2 * hidden:])  # v untouched
    return out


# --- the reference is HF's math ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_parameters", [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 160000.0}],
                         ids=["default", "linear"])
def test_ref_is_hf_rotary(rope_parameters):
    """GteRotaryEmbedding + apply_rotary_pos_emb on [B, H, S, D] q and k: the same values, bit for bit, in every
    dtype (transformers casts cos/sin to the activations' dtype and rotates in it; so does the reference)."""
    modeling = pytest.importorskip("transformers.models.gte.modeling_gte")
    kwargs = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    config = modeling.GteConfig(hidden_size=78, num_attention_heads=3, **kwargs)  # head dim 26
    rotary = modeling.GteRotaryEmbedding(config)
    batch, seq_len, heads, head_dim = 2, 9, 3, 26
    position_ids = torch.tensor([list(range(9)), [5, 6, 7, 8, 100, 101, 102, 103, 4000]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        qkv = torch.randn(batch * seq_len, 3 * heads * head_dim).to(dtype)
        q, k, _ = qkv.view(batch, seq_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4)  # [B, H, S, D] each
        cos, sin = rotary(qkv.view(batch, seq_len, -1), position_ids)
        q_hf, k_hf = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        cos, sin = rotary_tables(position_ids.flatten(), rotary.inv_freq, rotary.attention_scaling)
        ours = rotary_ref(qkv, cos, sin, heads).view(batch, seq_len, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        assert torch.equal(ours[0], q_hf) and torch.equal(ours[1], k_hf)


# --- the kernel against the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("num_heads,head_dim", [(12, 26), (2, 64), (3, 2), (1, 128), (12, 64)])
def test_rotary_matches_reference(device, num_heads, head_dim, tokens, dtype):
    """Odd shapes: head dim 26 (a half of 13, not a power of two), 2 (one pair), 128; 1 token; blocks left partial."""
    qkv, positions, inv_freq = make_inputs(tokens, num_heads, head_dim, dtype, device)
    check_against_ref(qkv, positions, inv_freq, num_heads)


@pytest.mark.parametrize("theta", [10000.0, 160000.0])
def test_rotary_long_positions_and_scaling(device, theta):
    """Positions up to 8191 (ModernBERT's context) and an attention scaling (YaRN-style tables): the angle is formed
    in fp32 in the tables, so kernel and reference read the same cos/sin."""
    qkv, positions, inv_freq = make_inputs(33, 4, 64, torch.float32, device, theta=theta, max_position=8192)
    check_against_ref(qkv, positions, inv_freq, 4, scaling=1.1)


def test_rotary_strided_rows(device):
    """qkv is a column slice of a wider buffer (row stride 300, not 234): rotated through the stride, in place,
    and nothing outside the slice is written."""
    wide = torch.randn(17, 300).to(device)
    qkv = wide[:, 40:40 + 234]  # 3 heads of 26
    before = wide.clone()
    _, positions, inv_freq = make_inputs(17, 3, 26, torch.float32, device)
    cos, sin = rotary_tables(positions, inv_freq)
    expected = rotary_ref(qkv, cos, sin, 3)
    rotary_(qkv, cos, sin, 3)
    torch.testing.assert_close(wide[:, 40:274], expected, rtol=0, atol=1e-5)
    assert torch.equal(wide[:, :40], before[:, :40]) and torch.equal(wide[:, 274:], before[:, 274:])


def test_rotary_position_zero_is_identity(device):
    qkv, _, inv_freq = make_inputs(5, 2, 26, torch.float32, device)
    cos, sin = rotary_tables(torch.zeros(5, dtype=torch.long, device=device), inv_freq)
    assert torch.equal(rotary_(qkv.clone(), cos, sin, 2), qkv)


def test_rotary_empty(device):
    qkv, positions, inv_freq = make_inputs(0, 2, 26, torch.float32, device)
    cos, sin = rotary_tables(positions, inv_freq)
    assert rotary_(qkv, cos, sin, 2).shape == (0, 156)


def test_rotary_opcheck():
    """torch.library's checks of the registered in-place op: schema (mutation declared), fake impl, AOT dispatch."""
    qkv, positions, inv_freq = make_inputs(7, 3, 26, torch.float32, "cpu")
    cos, sin = rotary_tables(positions, inv_freq)
    torch.library.opcheck(_rotary_op, (qkv, cos, sin, 3))


@pytest.mark.skipif(not compilable(_rotary_kernel), reason="TRITON_INTERPRET=1 at import")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_compiles_for_h100(dtype):
    """The compiled path, which the interpreter never exercises, builds for sm_90 (no GPU needed)."""
    x, table = torch.empty(0, dtype=dtype), torch.empty(0)
    for head_dim in (26, 64, 128):
        half = head_dim // 2
        block_half = 1 << (half - 1).bit_length()
        compiled = compile_for_gpu(_rotary_kernel, x, table, table, 4096, 2304, half, head_dim,
                                   BLOCK_M=max(1, min(64, 2048 // block_half)), BLOCK_HALF=block_half)
        assert (cubin_resources(compiled) or (0, 0))[1] == 0  # no register spills


def test_rotary_errors():
    qkv, positions, inv_freq = make_inputs(7, 3, 26, torch.float32, "cpu")
    cos, sin = rotary_tables(positions, inv_freq)
    with pytest.raises(ValueError, match=r"qkv must be \[tokens, 3 \* hidden\], got shape \(7, 233\)"):
        rotary_(qkv[:, :233], cos, sin, 3)
    with pytest.raises(ValueError, match="num_heads must be a positive int dividing hidden 78, got 4"):
        rotary_(qkv, cos, sin, 4)
    with pytest.raises(ValueError, match="rotary embeddings need an even head dim, got 13"):
        rotary_(qkv, cos, sin, 6)
    with pytest.raises(ValueError, match=r"cos must be float32 \[7, 13\] .*, got torch.float16 \(7, 13\)"):
        rotary_(qkv, cos.half(), sin, 3)
    with pytest.raises(ValueError, match=r"sin must be float32 \[7, 13\] .*, got torch.float32 \(6, 13\)"):
        rotary_(qkv, cos, sin[:6], 3)
    with pytest.raises(ValueError, match="cos must be contiguous and on qkv's device cpu, got meta"):
        rotary_(qkv, cos.to("meta"), sin, 3)
    with pytest.raises(TypeError, match="qkv must be float32, float16 or bfloat16"):
        rotary_(qkv.double(), cos, sin, 3)
