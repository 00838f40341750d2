"""fastbert.kernels.activation: the fused bias + activation kernel against its PyTorch reference.

On CPU the kernels run through Triton's interpreter; ``fastbert.kernels`` picks it per launch for CPU tensors, so no
TRITON_INTERPRET is needed (see kernels/_common.py). The cuda parametrization runs the compiled kernel on a GPU.
Comparison rule: kernel_checks.assert_close_to_ref (flash-attention's, fp32 within 1e-5 of the fp32 reference).
"""

import pytest
import torch

from fastbert.kernels._common import compilable, compile_for_gpu
from fastbert.kernels.activation import (BIAS_ACT_KINDS, BIAS_ACT_NAMES, _bias_act_kernel, _bias_act_op, bias_act,
                                         bias_act_ref)
from kernel_checks import DTYPES, assert_close_to_ref, cubin_resources


def make_inputs(n_rows, n_cols, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n_rows, n_cols, generator=g)).to(dtype).to(device)
    bias = torch.randn(n_cols, generator=g).to(dtype).to(device)
    return x, bias


def check_against_ref(x, bias, activation):
    out = bias_act(x, bias, activation)
    ref32 = bias_act_ref(x.float(), None if bias is None else bias.float(), activation)
    assert_close_to_ref(out, ref32, bias_act_ref(x, bias, activation))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(BIAS_ACT_NAMES))
@pytest.mark.parametrize("n_rows, n_cols", [(1, 26), (7, 312), (37, 1000)])
def test_bias_act_matches_reference(device, dtype, activation, n_rows, n_cols):
    x, bias = make_inputs(n_rows, n_cols, dtype, device)
    out = check_against_ref(x, bias, activation)
    assert out.is_contiguous() and out.device == x.device


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("activation", sorted(BIAS_ACT_NAMES))
def test_bias_act_without_bias(device, dtype, activation):
    x, _ = make_inputs(7, 312, dtype, device)
    check_against_ref(x, None, activation)


def test_bias_act_strided_rows(device):
    """x is a column slice of a wider buffer (row stride 1100, not 1000): read through the stride, no copy."""
    wide, bias = make_inputs(37, 1100, torch.float32, device)
    x = wide[:, 50:1050]
    assert x.stride(0) == 1100
    check_against_ref(x, bias[:1000], "gelu")


@pytest.mark.parametrize("activation", sorted(BIAS_ACT_NAMES))
def test_bias_act_extreme_values(device, activation):
    """Large |x|: the tanh form must not overflow into NaN/inf (tanh is computed from exp(-2|u|))."""
    values = torch.tensor([-1e4, -100.0, -30.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 30.0, 100.0, 1e4])
    x = values.repeat(3, 1).to(device)
    out = check_against_ref(x, None, activation)
    assert torch.isfinite(out).all()


def test_bias_act_empty(device):
    x, bias = make_inputs(0, 26, torch.float32, device)
    assert bias_act(x, bias, "gelu").shape == (0, 26)


def test_bias_act_opcheck():
    """torch.library's checks of the registered op: schema, fake (meta) impl, autograd registration, AOT dispatch."""
    x, bias = make_inputs(7, 26, torch.float32, "cpu")
    torch.library.opcheck(_bias_act_op, (x, bias, "gelu_new"))
    torch.library.opcheck(_bias_act_op, (x, None, "relu"))


@pytest.mark.skipif(not compilable(_bias_act_kernel), reason="TRITON_INTERPRET=1 at import")
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act_compiles_for_h100(dtype):
    """The compiled path, which the interpreter never exercises, builds for sm_90 (no GPU needed)."""
    x = torch.empty(0, dtype=dtype)
    for kind in BIAS_ACT_KINDS:
        compiled = compile_for_gpu(_bias_act_kernel, x, x, x, 4096, 3072, 3072, HAS_BIAS=True, ACTIVATION=kind,
                                   BLOCK_M=4, BLOCK_N=1024)
        assert (cubin_resources(compiled) or (0, 0))[1] == 0  # no register spills


def test_bias_act_errors():
    x, bias = make_inputs(7, 26, torch.float32, "cpu")
    with pytest.raises(ValueError, match="not fused.*supported"):
        bias_act(x, bias, "swish")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        bias_act(x.int(), None, "gelu")
    with pytest.raises(TypeError, match="bias has dtype torch.float16"):
        bias_act(x, bias.half(), "gelu")
    with pytest.raises(ValueError, match=r"bias has shape \(25,\)"):
        bias_act(x, bias[:25], "gelu")
    with pytest.raises(ValueError, match="tokens, features"):
        bias_act(x[None], bias, "gelu")
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        bias_act(x.t(), None, "gelu")


def test_gemm_epilogue_only_where_exact():
    """The activation goes into the GEMM's epilogue only where torch._addmm_activation computes exactly it: ReLU
    everywhere, tanh GELU on CUDA; on CPU its GELU is the erf one (checked here), so tanh models keep the kernel."""
    from fastbert.ops.activation import gemm_epilogue

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [gemm_epilogue(a, cuda) for a in ("relu", "gelu_new", "gelu_pytorch_tanh", "gelu", "silu")] == \
        [False, True, True, None, None]
    assert [gemm_epilogue(a, cpu) for a in ("relu", "gelu_new", "gelu")] == [False, None, None]
    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    gelu = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    torch.testing.assert_close(gelu, torch.nn.functional.gelu(x @ w.t() + b))
    torch.testing.assert_close(torch._addmm_activation(b, x, w.t()), torch.relu(x @ w.t() + b))
