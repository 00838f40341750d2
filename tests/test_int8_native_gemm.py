"""fastbert._C's int8 GEMM (``fastbert/int8/native_gemm.py``, csrc/gemm_int8_cpu.h) at its edges and against bad
arguments; its results against the float64 reference on odd shapes, with every epilogue and kind of input scale, are
``test_int8.py``'s (both int8 GEMMs, where each runs)."""

import pytest
import torch

from fastbert.int8 import linear as int8_linear


def test_native_gemm_edges():
    """No inputs (the result is the bias), and a bias and residual that are not contiguous: the copies the launcher
    makes live until the kernel has read them (a large residual's copy, freed early, is unmapped memory)."""
    native = int8_linear.native_gemm
    if native.unavailable_reasons():
        pytest.skip("; ".join(native.unavailable_reasons()))
    empty = native.pack(torch.zeros(5, 0, dtype=torch.int8), torch.ones(5))
    bias = torch.arange(5.0)
    torch.testing.assert_close(native.linear(torch.zeros(3, 0, dtype=torch.uint8), 1.0, 0, empty, bias),
                               bias.expand(3, 5), rtol=0, atol=0)
    torch.testing.assert_close(native.linear_quantizing(torch.zeros(3, 0), 3, None, empty, bias), bias.expand(3, 5),
                               rtol=0, atol=0)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-63, 64, (4096, 4), dtype=torch.int8, generator=generator)
    packed = native.pack(weight, torch.ones(4096))
    q = torch.randint(0, 256, (4096, 4), dtype=torch.uint8, generator=generator)
    residual = torch.randn(4096, 4096, generator=generator).t()  # (transposed: copied by the launcher; 64 MB: mmap)
    strided_bias = torch.randn(8192, generator=generator)[::2]
    y = native.linear(q, 1.0, 0, packed, strided_bias, residual=residual)
    exact = q.double() @ weight.double().t() + strided_bias.double() + residual.double()
    torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item())


def test_native_gemm_checks_its_arguments():
    """fastbert._C's int8 GEMM: a weight past 7 bits is refused when packed; wrong tensors are named before the
    kernel runs; the extension itself refuses null pointers and bad scales."""
    native = int8_linear.native_gemm
    if native.unavailable_reasons():
        pytest.skip("; ".join(native.unavailable_reasons()))
    for level in (64, -64, -128):  # (-128: its abs() wraps to itself)
        with pytest.raises(ValueError, match="7-bit"):
            native.pack(torch.full((4, 8), level, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="int8 CPU tensor"):
        native.pack(torch.ones(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="scales must be"):
        native.pack(torch.ones(4, 8, dtype=torch.int8), torch.ones(5))
    packed = native.pack(torch.ones(4, 8, dtype=torch.int8), torch.ones(4))
    q = torch.zeros(3, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="q must be"):
        native.linear(q[:, :5], 1.0, 0, packed, None)
    with pytest.raises(ValueError, match="bias must be"):
        native.linear(q, 1.0, 0, packed, torch.zeros(5))
    with pytest.raises(ValueError, match="residual must be"):
        native.linear(q, 1.0, 0, packed, None, residual=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="erf GELU or no activation"):
        native.linear(q, 1.0, 0, packed, None, "relu", output=(0.1, 0))
    with pytest.raises(ValueError, match="activation must be one of"):
        native.linear(q, 1.0, 0, packed, None, "swish-ish")
    with pytest.raises(ValueError, match="without a residual"):
        native.linear(q, 1.0, 0, packed, None, "gelu", residual=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="rows must be"):
        native.linear_quantizing(torch.randn(3, 8), 4, None, packed, None)
    with pytest.raises(ValueError, match="rows indexes"):
        native.linear_quantizing(torch.randn(3, 8), torch.tensor([3]), None, packed, None)
    with pytest.raises(ValueError, match="smooth must be"):
        native.linear_quantizing(torch.randn(3, 8), 3, torch.ones(7), packed, None)
    with pytest.raises(ValueError, match="u8 output takes"):
        native.linear_quantizing(torch.randn(3, 8), 3, None, packed, None, output=(0.1, 0), per_token=True)
    y = torch.empty(3, 4)

    def call(**changes):
        arguments = dict(x=q.data_ptr(), x_stride=8, packed=packed.panels.data_ptr(),
                         column_sums=packed.column_sums.data_ptr(), scales=packed.scales.data_ptr(), x_scale=1.0,
                         x_zero_point=0, bias=0, residual=0, y=y.data_ptr(), y_u8=0, y_scale=1.0, y_zero_point=0,
                         rows=3, out=4, num_threads=1, **{"in": 8})
        int8_linear._extension._C.gemm_int8_cpu(**(arguments | changes))

    call()
    torch.testing.assert_close(y, torch.zeros(3, 4))  # (zero u8 at zero point 0)
    for changes, message in [({"x_scale": 0.0}, "x_scale"), ({"x_zero_point": 256}, "x_zero_point"),
                             ({"x": 0}, "null data pointer"), ({"y_u8": q.data_ptr()}, "both y and y_u8"),
                             ({"residual": y.data_ptr(), "gelu": True}, "gelu with a residual"),
                             ({"x_stride": 7}, "x_stride"), ({"y": 0, "y_u8": q.data_ptr(), "y_scale": -1.0},
                                                             "y_scale")]:
        with pytest.raises(ValueError, match=message):
            call(**changes)
