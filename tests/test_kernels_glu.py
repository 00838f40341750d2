"""fastbert.kernels.glu: the GLU act-and-mul kernel against its PyTorch reference, and the reference against HF.

The reference is checked against transformers' own MLP modules (ModernBERT, GTE, NomicBERT; skipped where the
installed transformers lacks the family): fed the fused GEMM's output, ``glu_ref`` must give exactly the tensor HF
hands its down projection. The kernel runs through Triton's interpreter on CPU tensors (no TRITON_INTERPRET needed,
see kernels/_common.py); the cuda parametrization runs the compiled kernel on a GPU.
Comparison rule: kernel_checks.assert_close_to_ref (flash-attention's, fp32 within 1e-5 of the fp32 reference).
"""

import pytest
import torch

from fastbert.kernels._common import compilable, compile_for_gpu
from fastbert.kernels.glu import GLU_ACTIVATIONS, _glu_kernel, _glu_op, glu, glu_activation_ref, glu_ref
from kernel_checks import ATOL, DTYPES, assert_close_to_ref, cubin_resources


def make_inputs(n_rows, n_cols, dtype, device, seed=0):
    """x [n_rows, 2 * n_cols] ~ 3 N(0, 1) (GELU and SiLU curved, not linear), bias [2 * n_cols] ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n_rows, 2 * n_cols, generator=g)).to(dtype).to(device)
    bias = torch.randn(2 * n_cols, generator=g).to(dtype).to(device)
    return x, bias


def check_against_ref(x, bias, activation, activated_half):
    out = glu(x, bias, activation, activated_half)
    ref32 = glu_ref(x.float(), None if bias is None else bias.float(), activation, activated_half)
    assert_close_to_ref(out, ref32, glu_ref(x, bias, activation, activated_half))
    assert out.is_contiguous() and out.device == x.device
    if out.dtype != torch.float32:
        # Rounded once: within one ulp (of the larger value: the two may sit either side of a power of two) of the
        # fp32 math rounded once, plus the tiny atol (GELU's 1 + erf cancels for x < -3: a few fp32 ulps of 1 there
        # are many of the small result's). Closer than the 2x rule asks.
        out32, once = out.float(), glu_ref(x, bias, activation, activated_half, upcast=True).float()
        exponent = torch.frexp(torch.maximum(out32.abs(), once.abs()))[1]
        ulp = torch.finfo(out.dtype).eps * torch.ldexp(torch.ones_like(once), exponent - 1)
        assert ((out32 - once).abs() <= ulp + ATOL[out.dtype]).all()
    return out


# --- the reference is HF's math ------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", sorted(GLU_ACTIVATIONS))
def test_activation_ref_is_hf_module(activation):
    """Bit for bit the module transformers builds for the name, in every dtype (the 16-bit bar is HF's rounding)."""
    from transformers.activations import ACT2FN

    x = 3 * torch.randn(4096)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(glu_activation_ref(x.to(dtype), activation), ACT2FN[activation](x.to(dtype)))


def assert_is_hf(out, hf):
    """Bit for bit in 16-bit. In fp32 within torch's default fp32 tolerance (rtol 1.3e-6, atol 1e-5): torch's CPU
    GELU/SiLU take a scalar path on a strided view (the chunk ModernBERT activates, a half of our fused input) and a
    vectorized one on a contiguous tensor (GTE's and Nomic's gate_proj output); for the same fp32 input the two GELU
    paths differ by up to 1.4e-6 (measured on 4.8M values ~ 3 N(0, 1); 5.5e-7 relative for x > 0, up to 1.3e-6
    absolute in the erf-cancelling x < 0 tail), and the product scales that by |b|."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, hf)
    else:
        assert torch.equal(out, hf)


def _down_projection_input(mlp, down, h):
    """What ``mlp(h)`` feeds its down projection module ``down``: HF's act-and-mul result."""
    seen = []
    handle = down.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            mlp(h)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_ref_is_modernbert_mlp(activation, mlp_bias):
    """ModernBertMLP: ``input, gate = Wi(h).chunk(2); act(input) * gate`` -> activated_half=0; with ``mlp_bias`` the
    kernel takes Wi's bias (the GEMM runs without it)."""
    modeling = pytest.importorskip("transformers.models.modernbert.modeling_modernbert")
    config = modeling.ModernBertConfig(hidden_size=32, intermediate_size=48, hidden_activation=activation,
                                       mlp_bias=mlp_bias, mlp_dropout=0.0)
    mlp = modeling.ModernBertMLP(config).eval()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        mlp.to(dtype)
        h = torch.randn(5, 32).to(dtype)
        with torch.no_grad():
            fused = mlp.Wi(h)  # [5, 2 * 48]
            unbiased = torch.nn.functional.linear(h, mlp.Wi.weight)
        hf = _down_projection_input(mlp, mlp.Wo, h)
        assert_is_hf(glu_ref(fused, None, activation, 0), hf)
        if mlp_bias and dtype == torch.float32:
            torch.testing.assert_close(glu_ref(unbiased, mlp.Wi.bias.detach(), activation, 0), hf)


@pytest.mark.parametrize("family", ["gte", "nomic_bert"])
def test_ref_is_gated_mlp(family):
    """GteMLP and NomicBertMLP: ``act(gate_proj(h)) * up_proj(h)``. With the weights stacked [up; gate] (the layout
    of GTE's ``up_gate_proj`` and of Nomic's [fc11; fc12] checkpoints) the activated half is the second: 1."""
    if family == "gte":
        modeling = pytest.importorskip("transformers.models.gte.modeling_gte")
        config_cls, mlp_cls, activation = modeling.GteConfig, modeling.GteMLP, "gelu"
    else:
        modeling = pytest.importorskip("transformers.models.nomic_bert.modeling_nomic_bert")
        config_cls, mlp_cls, activation = modeling.NomicBertConfig, modeling.NomicBertMLP, "silu"
    config = config_cls(hidden_size=32, intermediate_size=48, hidden_act=activation, hidden_dropout_prob=0.0)
    mlp = mlp_cls(config).eval()
    assert mlp.up_proj.bias is None and mlp.gate_proj.bias is None  # no GEMM bias to fuse in either family
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        mlp.to(dtype)
        h = torch.randn(5, 32).to(dtype)
        with torch.no_grad():
            fused = torch.cat([mlp.up_proj(h), mlp.gate_proj(h)], dim=-1)  # [5, 2 * 48]: HF's own GEMM outputs
            stacked = torch.nn.functional.linear(h, torch.cat([mlp.up_proj.weight, mlp.gate_proj.weight]))
        hf = _down_projection_input(mlp, mlp.down_proj, h)
        assert_is_hf(glu_ref(fused, None, activation, 1), hf)
        if dtype == torch.float32:  # one GEMM on the stacked weight: the same up to GEMM rounding
            torch.testing.assert_close(glu_ref(stacked, None, activation, 1), hf)


# --- the kernel against the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activated_half", [0, 1])
@pytest.mark.parametrize("activation", sorted(GLU_ACTIVATIONS))
def test_glu_matches_reference(device, activation, activated_half, with_bias, dtype):
    x, bias = make_inputs(7, 312, dtype, device)
    check_against_ref(x, bias if with_bias else None, activation, activated_half)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_rows", [1, 7, 300])
@pytest.mark.parametrize("n_cols", [1, 96, 312, 1152])  # 1152: ModernBERT-base; 312, 1152 leave partial blocks
def test_glu_shapes(device, n_cols, n_rows, dtype):
    """Odd shapes, ModernBERT-like (gelu, first half) and Nomic-like (silu, second half), with a bias."""
    x, bias = make_inputs(n_rows, n_cols, dtype, device)
    out = check_against_ref(x, bias, "gelu", 0)
    assert out.shape == (n_rows, n_cols)
    check_against_ref(x, bias, "silu", 1)


def test_glu_strided_rows(device):
    """x is a column slice of a wider buffer (row stride 2500, not 2 * 1152): read through the stride, no copy."""
    wide, _ = make_inputs(37, 1250, torch.float32, device)
    x = wide[:, 50:50 + 2 * 1152]
    _, bias = make_inputs(1, 1152, torch.float32, device, seed=1)
    assert x.stride() == (2500, 1)
    for activated_half in (0, 1):
        check_against_ref(x, bias, "gelu_new", activated_half)


@pytest.mark.parametrize("activation", sorted(GLU_ACTIVATIONS))
def test_glu_extreme_values(device, activation):
    """Large |x| in the activated half: no overflow into NaN/inf (tanh and sigmoid are computed from exp(-|u|))."""
    values = torch.tensor([-1e4, -100.0, -30.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 30.0, 100.0, 1e4])
    x = torch.cat([values, torch.linspace(-2, 2, len(values))]).repeat(3, 1).to(device)
    out = check_against_ref(x, None, activation, 0)
    assert torch.isfinite(out).all()


def test_glu_empty(device):
    x, bias = make_inputs(0, 26, torch.float32, device)
    assert glu(x, bias, "gelu", 0).shape == (0, 26)
    assert glu(torch.empty(3, 0, device=device), None, "silu", 1).shape == (3, 0)


def test_glu_opcheck():
    """torch.library's checks of the registered op: schema, fake (meta) impl, autograd registration, AOT dispatch."""
    x, bias = make_inputs(7, 26, torch.float32, "cpu")
    torch.library.opcheck(_glu_op, (x, bias, "gelu", 0))
    torch.library.opcheck(_glu_op, (x[:, :50], None, "silu", 1))  # row stride 52, not 50


def test_glu_fake_tensors_use_the_op():
    """Fake tensors (tracing, export) go through the registered op: its fake impl gives [tokens, I] and checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, bias = make_inputs(7, 26, torch.float16, "cpu")
    with FakeTensorMode() as mode:
        fake_x, fake_bias = mode.from_tensor(x), mode.from_tensor(bias)
        out = glu(fake_x, fake_bias, "gelu_pytorch_tanh", 1)
        assert out.shape == (7, 26) and out.dtype == torch.float16
        with pytest.raises(ValueError, match="must be even"):
            glu(fake_x[:, :51], None, "gelu", 0)


@pytest.mark.skipif(not compilable(_glu_kernel), reason="TRITON_INTERPRET=1 at import")
@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_compiles_for_h100(dtype):
    """The compiled path, which the interpreter never exercises, builds for sm_90 (no GPU needed)."""
    x = torch.empty(0, dtype=dtype)
    for kind in sorted(set(GLU_ACTIVATIONS.values())):
        compiled = compile_for_gpu(_glu_kernel, x, x, x, 4096, 1152, 2304, 1152, 0, HAS_BIAS=True, ACTIVATION=kind,
                                   BLOCK_M=4, BLOCK_N=1024)
        assert (cubin_resources(compiled) or (0, 0))[1] == 0  # no register spills


def test_glu_errors():
    x, bias = make_inputs(7, 26, torch.float32, "cpu")
    with pytest.raises(ValueError, match="activation 'relu' has no GLU kernel; supported: gelu, "):
        glu(x, bias, "relu", 0)
    with pytest.raises(ValueError, match="activated_half must be 0 .* or 1 .*, got 2"):
        glu(x, bias, "gelu", 2)
    with pytest.raises(TypeError, match="activated_half must be the int 0 or 1, got bool"):
        glu(x, bias, "gelu", True)
    with pytest.raises(ValueError, match="x's last dimension must be even .*, got 51"):
        glu(x[:, :51], None, "gelu", 0)
    with pytest.raises(ValueError, match=r"bias has shape \(26,\), expected \(52,\)"):
        glu(x, bias[:26], "gelu", 0)
    with pytest.raises(TypeError, match="bias has dtype torch.float16 but x has torch.float32"):
        glu(x, bias.half(), "gelu", 0)
    with pytest.raises(ValueError, match="bias is on meta but x is on cpu"):
        glu(x, bias.to("meta"), "gelu", 0)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        glu(x.double(), None, "gelu", 0)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 2 \* intermediate\]"):
        glu(x[None], None, "gelu", 0)
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        glu(torch.randn(52, 7).t(), None, "gelu", 0)
