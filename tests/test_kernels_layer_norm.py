"""fastbert.kernels.layer_norm: LayerNorm(act(x + bias) + residual) against its PyTorch reference.

On CPU the kernels run through Triton's interpreter; ``fastbert.kernels`` picks it per launch for CPU tensors, so no
TRITON_INTERPRET is needed (see kernels/_common.py). The cuda parametrization runs the compiled kernel on a GPU.
Comparison rule: kernel_checks.assert_close_to_ref (flash-attention's, fp32 within 1e-5 of the fp32 reference).
"""

import pytest
import torch

from fastbert.kernels.activation import ACTIVATIONS
from fastbert.kernels._common import calculate_settings, compilable, compile_for_gpu
from fastbert.kernels.layer_norm import _layer_norm_kernel, _layer_norm_op, layer_norm, layer_norm_ref
from kernel_checks import DTYPES, assert_close_to_ref, cubin_resources

# (has bias, has residual, activation): BertSelfOutput/BertOutput, the MLM head transform, and the other mixes.
FUSIONS = {
    "plain": (False, False, None),
    "bias": (True, False, None),
    "bias+residual": (True, True, None),
    "bias+gelu": (True, False, "gelu"),
    "gelu_new": (False, False, "gelu_new"),
    "bias+relu+residual": (True, True, "relu"),
}


def make_inputs(n_rows, hidden, dtype, device, fusion="bias+residual", seed=0):
    """(x, weight, ln_bias, kwargs) with random LayerNorm parameters (not 1/0, which would hide a dropped one)."""
    has_bias, has_residual, activation = FUSIONS[fusion]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (scale * torch.randn(*shape, generator=g) + shift).to(dtype).to(device)

    x = rand(n_rows, hidden, scale=2.0, shift=0.5)
    weight, ln_bias = rand(hidden, scale=0.2, shift=1.0), rand(hidden, scale=0.2)
    kwargs = dict(activation=activation)
    if has_bias:
        kwargs["bias"] = rand(hidden, scale=0.5)
    if has_residual:
        kwargs["residual"] = rand(n_rows, hidden)
    return x, weight, ln_bias, kwargs


def check_against_ref(x, weight, ln_bias, eps, **kwargs):
    out = layer_norm(x, weight, ln_bias, eps, **kwargs)
    upcast = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ref32 = layer_norm_ref(x.float(), weight.float(), ln_bias.float(), eps, **upcast)
    assert_close_to_ref(out, ref32, layer_norm_ref(x, weight, ln_bias, eps, **kwargs))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("n_rows, hidden", [(1, 26), (7, 312), (37, 1000), (3, 1)])
def test_layer_norm_matches_reference(device, dtype, fusion, n_rows, hidden):
    x, weight, ln_bias, kwargs = make_inputs(n_rows, hidden, dtype, device, fusion)
    out = check_against_ref(x, weight, ln_bias, 1e-12, **kwargs)
    assert out.is_contiguous() and out.device == x.device


def test_layer_norm_strided_rows(device):
    """x and residual are column slices of wider buffers (row strides 400 and 350): read through the strides."""
    x, weight, ln_bias, kwargs = make_inputs(37, 400, torch.float32, device)
    residual = torch.randn(37, 350, device=device)
    check_against_ref(
        x[:, 50:362], weight[:312], ln_bias[:312], 1e-5, bias=kwargs["bias"][:312], residual=residual[:, 20:332]
    )


@pytest.mark.parametrize("eps", [1e-12, 1e-5, 0.1])
def test_layer_norm_eps_and_hard_rows(device, eps):
    """eps is honoured; a constant row (variance 0) gives ln_bias, finite; a row with a large mean stays accurate
    (corrected two-pass). Against float64: on the row of mean 1000, torch's own float32 LayerNorm is ~2e-5 off (CPU)
    where the kernel is ~7e-7 off, so the float32 reference would measure torch's error, not the kernel's."""
    x, weight, ln_bias, _ = make_inputs(3, 312, torch.float32, device)
    x[0] = 7.0
    x[1] += 1000.0
    out = layer_norm(x, weight, ln_bias, eps)
    ref64 = layer_norm_ref(x.double(), weight.double(), ln_bias.double(), eps)
    torch.testing.assert_close(out.double(), ref64, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], ln_bias, atol=1e-5, rtol=0)


def test_layer_norm_empty(device):
    x, weight, ln_bias, kwargs = make_inputs(0, 26, torch.float32, device)
    assert layer_norm(x, weight, ln_bias, 1e-5, **kwargs).shape == (0, 26)


@pytest.mark.parametrize("fusion", ["plain", "bias+relu+residual", "bias+gelu"])
def test_layer_norm_opcheck(fusion):
    """torch.library's checks of the registered op: schema, fake (meta) impl, autograd registration, AOT dispatch."""
    x, weight, ln_bias, kwargs = make_inputs(7, 26, torch.float32, "cpu", fusion)
    args = (x, weight, ln_bias, 1e-5, kwargs.get("bias"), kwargs.get("residual"), kwargs["activation"])
    torch.library.opcheck(_layer_norm_op, args)


def test_layer_norm_torch_compile_fullgraph():
    """torch.compile sees one opaque op (no graph break); aot_eager keeps the test free of a C++ compiler."""
    x, weight, ln_bias, kwargs = make_inputs(7, 26, torch.float32, "cpu")

    def block(x, residual):
        return layer_norm(2 * x, weight, ln_bias, 1e-5, bias=kwargs["bias"], residual=residual) + 1

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, kwargs["residual"]), block(x, kwargs["residual"]), atol=0, rtol=0)


@pytest.mark.skipif(not compilable(_layer_norm_kernel), reason="TRITON_INTERPRET=1 at import")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 4096])
def test_layer_norm_compiles_for_h100(dtype, hidden):
    """The compiled path, which the interpreter never exercises, builds for sm_90 (no GPU needed)."""
    x = torch.empty(0, dtype=dtype)
    block_n, num_warps = calculate_settings(hidden)
    for has_bias, has_residual, activation in FUSIONS.values():
        compiled = compile_for_gpu(
            _layer_norm_kernel, x, x, x, x, x, x, hidden, hidden, hidden, 1e-12, HAS_BIAS=has_bias,
            HAS_RESIDUAL=has_residual, ACTIVATION="none" if activation is None else ACTIVATIONS[activation],
            BLOCK_N=block_n, num_warps=num_warps,
        )
        assert (cubin_resources(compiled) or (0, 0))[1] == 0  # no register spills


@pytest.mark.skipif(not compilable(_layer_norm_kernel), reason="TRITON_INTERPRET=1 at import: nothing compiles here")
def test_interpreted_launch_leaves_triton_untouched():
    """A CPU launch patches triton.language (builtins, tensor methods, and here ``JITFunction.__call__`` for device
    functions such as the activation helper and tl.sum) only while it runs: CUDA kernels compiled later in the same
    process need every attribute as it was."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    patched = (tl, tl.core, tl.math, tl.standard, tl.core.tensor, tl.core.dtype, JITFunction)

    def state():
        return [dict(vars(obj)) for obj in patched]

    before = state()
    x, weight, ln_bias, kwargs = make_inputs(7, 26, torch.float32, "cpu", "bias+relu+residual")
    layer_norm(x, weight, ln_bias, 1e-5, **kwargs)
    layer_norm(x, weight, ln_bias, 1e-5, activation="gelu")
    for obj, old, new in zip(patched, before, state()):
        changed = [name for name, value in old.items() if new.get(name) is not value]
        assert not changed, f"{obj.__name__}: {changed} still patched after the launch"


def test_layer_norm_errors():
    x, weight, ln_bias, kwargs = make_inputs(7, 26, torch.float32, "cpu")
    with pytest.raises(ValueError, match="not fused.*supported"):
        layer_norm(x, weight, ln_bias, 1e-5, activation="tanh")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        layer_norm(x.double(), weight, ln_bias, 1e-5)
    with pytest.raises(TypeError, match="weight has dtype torch.float16"):
        layer_norm(x, weight.half(), ln_bias, 1e-5)
    with pytest.raises(ValueError, match=r"ln_bias has shape \(25,\)"):
        layer_norm(x, weight, ln_bias[:25], 1e-5)
    with pytest.raises(ValueError, match=r"residual has shape \(6, 26\)"):
        layer_norm(x, weight, ln_bias, 1e-5, residual=kwargs["residual"][:6])
    with pytest.raises(TypeError, match="residual has dtype torch.bfloat16"):
        layer_norm(x, weight, ln_bias, 1e-5, residual=kwargs["residual"].bfloat16())
    with pytest.raises(ValueError, match="tokens, hidden"):
        layer_norm(x[None], weight, ln_bias, 1e-5)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        layer_norm(torch.randn(26, 7).t(), weight, ln_bias, 1e-5)
    with pytest.raises(ValueError, match="eps"):
        layer_norm(x, weight, ln_bias, -1.0)


def test_eager_calls_skip_the_registered_op(monkeypatch):
    """Eager calls on plain tensors run the launcher directly (the op's dispatcher costs host time per launch);
    fake tensors (tracing, export) still go through the registered op and its fake implementation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fastbert.kernels import _common
    from fastbert.kernels import layer_norm as module

    x, weight, bias = torch.randn(3, 26), torch.randn(26), torch.randn(26)
    assert _common.direct_launch(x)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not _common.direct_launch(fake)
        assert module.layer_norm(fake, mode.from_tensor(weight), mode.from_tensor(bias), 1e-5).shape == (3, 26)

    def must_not_run(*args, **kwargs):
        raise AssertionError("the eager call went through the registered op")

    monkeypatch.setattr(module, "_layer_norm_op", must_not_run)
    out = module.layer_norm(x, weight, bias, 1e-5)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (26,), weight, bias, 1e-5), rtol=1e-5, atol=1e-5)
