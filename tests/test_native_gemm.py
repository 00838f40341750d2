"""fastbert's own float32 CPU GEMM (fastbert/native_gemm.py, csrc/gemm_cpu.h) against its torch reference: odd shapes
(rows 1-13 around its 6-row tiles and the tails it splits into tiles of 3-5 and 4 rows, columns around its 16-column
panels, inputs around its 64-input partial sums), each epilogue, strided inputs, empty ones, and bad input. The
models with it forced: test_cpu_gemm.py."""

import pytest
import torch

from fastbert import _extension, cpu_gemm, native_gemm


@pytest.fixture(autouse=True)
def runs_here():
    reasons = native_gemm.unavailable_reasons()
    if reasons:
        pytest.skip("; ".join(reasons))


SHAPES = [(1, 312, 26), (5, 26, 17), (6, 64, 16), (7, 65, 1), (8, 40, 33), (9, 130, 50), (13, 768, 312),
          (129, 768, 768), (37, 3072, 768), (300, 96, 2304)]  # (rows, in, out)


@pytest.mark.parametrize("rows, d_in, d_out", SHAPES)
@pytest.mark.parametrize("epilogue", [None, "bias", "gelu", "gelu_new", "relu", "residual"])
def test_linear_matches_reference(rows, d_in, d_out, epilogue):
    """Error against float64 at most twice torch's own (F.linear + torch ops) plus 1e-6, and within 1e-5 of torch."""
    generator = torch.Generator().manual_seed(rows + d_in + d_out)
    x, weight = torch.randn(rows, d_in, generator=generator), torch.randn(d_out, d_in, generator=generator)
    weight, bias = weight * d_in ** -0.5, torch.randn(d_out, generator=generator)
    bias = None if epilogue is None else bias
    residual = torch.randn(rows, d_out, generator=generator) if epilogue == "residual" else None
    activation = None if epilogue in (None, "bias", "residual") else epilogue
    ref = cpu_gemm.linear_ref(x.double(), weight.double(), None if bias is None else bias.double(), activation,
                              None if residual is None else residual.double())
    with torch.inference_mode():
        out = native_gemm.linear(x, native_gemm.pack(weight), bias, activation, residual)
        out_torch = cpu_gemm.linear_ref(x, weight, bias, activation, residual)
    assert out.dtype == torch.float32 and out.shape == (rows, d_out)
    err, err_torch = ((o.double() - ref).abs().max().item() for o in (out, out_torch))
    assert err <= 2 * err_torch + 1e-6, (err, err_torch)
    torch.testing.assert_close(out, out_torch, rtol=1e-5, atol=1e-5)


def test_gelu_epilogue_as_exact_as_torch():
    """The kernel's erf GELU on pre-activations from -12 to 12 (a step of 1e-4; each computed exactly: x times a
    weight of 1): in each range of x (its 8 segments of erf, the tails) its error against float64 at most twice that
    of torch's F.gelu; infinities, NaN and zeros as F.gelu gives them. With a residual, the GELU runs after the sum
    in torch ops (the kernel's epilogue takes no activation with a residual, and says so)."""
    x = torch.linspace(-12, 12, 240_001).unsqueeze(1)
    one = native_gemm.pack(torch.ones(1, 1))
    with torch.inference_mode():
        ours, theirs = native_gemm.linear(x, one, None, "gelu"), torch.nn.functional.gelu(x)
    ref = torch.nn.functional.gelu(x.double())
    for low, high in [(-12, -6), (-6, -3), (-3, -1), (-1, 0), (0, 1), (1, 3), (3, 6), (6, 12)]:
        rows = ((x >= low) & (x < high)).squeeze(1)
        err, err_torch = ((o.double() - ref)[rows].abs().max().item() for o in (ours, theirs))
        assert err <= 2 * err_torch + 1e-9, (low, high, err, err_torch)
    special = torch.tensor([[0.0], [-0.0], [float("inf")], [float("-inf")], [float("nan")], [1e-30], [-1e-30], [40.0],
                            [-40.0]])
    with torch.inference_mode():
        torch.testing.assert_close(native_gemm.linear(special, one, None, "gelu"), torch.nn.functional.gelu(special),
                                   equal_nan=True, rtol=0, atol=0)
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(9, 40, generator=generator), torch.randn(33, 40, generator=generator)
    bias, residual = torch.randn(33, generator=generator), torch.randn(9, 33, generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(native_gemm.linear(x, native_gemm.pack(weight), bias, "gelu", residual),
                                   cpu_gemm.linear_ref(x, weight, bias, "gelu", residual), rtol=1e-5, atol=1e-5)
    y = torch.empty(9, 33)
    with pytest.raises(ValueError, match="gelu with a residual"):
        _extension._C.gemm_cpu(x.data_ptr(), 40, native_gemm.pack(weight).panels.data_ptr(), bias.data_ptr(),
                               residual.data_ptr(), y.data_ptr(), 9, 40, 33, 1, True)


def test_strided_and_empty_inputs():
    """Rows of a wider tensor (a row stride past ``in``) and column slices read as torch reads them; no rows, or no
    inputs (the bias alone), as F.linear gives them."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    packed = native_gemm.pack(weight)
    wide = torch.randn(9, 30, generator=generator)
    for x in (wide[:, :24], wide[:, 3:27], wide[::2, :24], torch.randn(24, 9, generator=generator).t()):
        torch.testing.assert_close(native_gemm.linear(x, packed, bias), torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
    for row in (torch.randn(24, generator=generator).expand(1, 24), torch.randn(24, 1, generator=generator).t()):
        # (one row with a row stride under ``in``: torch calls it contiguous)
        torch.testing.assert_close(native_gemm.linear(row, packed, bias), torch.nn.functional.linear(row, weight, bias),
                                   rtol=1e-5, atol=1e-5)
    assert native_gemm.linear(torch.empty(0, 24), packed, bias).shape == (0, 40)
    no_inputs = native_gemm.pack(torch.empty(40, 0))
    torch.testing.assert_close(native_gemm.linear(torch.empty(3, 0), no_inputs, bias), bias.expand(3, 40))


def test_another_default_dtype_changes_nothing():
    x, weight = torch.randn(5, 24), torch.randn(40, 24)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = native_gemm.linear(x, native_gemm.pack(weight), None)
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_non_finite_inputs_propagate():
    weight = torch.randn(17, 8)
    x = torch.randn(7, 8)
    x[2, 3], x[5, 0] = float("nan"), float("inf")
    out, ref = native_gemm.linear(x, native_gemm.pack(weight), None), torch.nn.functional.linear(x, weight)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


def test_bad_input_names_the_argument():
    packed = native_gemm.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="weight must be"):
        native_gemm.pack(torch.randn(8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        native_gemm.linear(torch.randn(2, 3, 4), packed, None)
    with pytest.raises(ValueError, match="x must be"):
        native_gemm.linear(torch.randn(2, 5), packed, None)
    with pytest.raises(ValueError, match="x must be"):
        native_gemm.linear(torch.randn(2, 4, dtype=torch.bfloat16), packed, None)
    with pytest.raises(ValueError, match="bias must be"):
        native_gemm.linear(torch.randn(2, 4), packed, torch.randn(7))
    with pytest.raises(ValueError, match="residual must be"):
        native_gemm.linear(torch.randn(2, 4), packed, None, residual=torch.randn(3, 8))
    with pytest.raises(ValueError, match="panels must be"):
        native_gemm.PackedWeight(packed.panels, 17)  # (17 outputs need 2 panels)
