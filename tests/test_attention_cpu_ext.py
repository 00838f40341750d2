"""fastbert._C's CPU attention (csrc/attention_cpu.h) against kernels/attention.py's float64 reference.

float32 only: the kernel must be within 1e-5 of the exact result, on odd shapes (head dims 8, 26, 80 and 128: below,
between and past the vector width and the value tiles; sequences of 0, 1, 17, 255, 256 and 300 tokens: around
every tile size), with and without the relative bias, a window and holes (distances between columns).
"""

import pytest
import torch

from fastbert import _extension, attention, dispatch, padding
from fastbert.kernels.attention import attention_varlen_ref

pytestmark = pytest.mark.skipif(bool(_extension.attention_cpu_unavailable_reasons()),
                                reason="; ".join(_extension.attention_cpu_unavailable_reasons()))
FP32_TOL = 1e-5
# Every instruction set this CPU runs (an AVX-512 machine checks the AVX2 build too).
ISAS = _extension.attention_cpu_isas()


def qkv_of(tokens, heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 3, heads, head_dim, generator=g)


def table_of(heads, radius, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, 2 * radius + 1, generator=g)


def reference(qkv, lengths, relative_bias=None, window=None, columns=None):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    bias = None if relative_bias is None else relative_bias.double()
    return attention_varlen_ref(qkv.double(), cu_seqlens, max(lengths, default=0), window=window, columns=columns,
                                relative_bias=bias).float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [8, 26, 80, 128])
@pytest.mark.parametrize("lengths", [[17, 0, 1, 5], [256, 255], [300]], ids=["mixed", "tile-edges", "long"])
@pytest.mark.parametrize("radius", [None, 3, 128])
def test_matches_reference(isa, head_dim, lengths, radius):
    heads = 3
    qkv = qkv_of(sum(lengths), heads, head_dim)
    table = None if radius is None else table_of(heads, radius)
    out = _extension.attention_cpu(qkv, lengths, table, isa=isa)
    assert out.shape == (sum(lengths), heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(qkv, lengths, table), rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [0, 1, 5, 64])
@pytest.mark.parametrize("radius", [None, 8])
def test_window(isa, window, radius):
    lengths = [1, 40, 130]
    qkv = qkv_of(sum(lengths), 2, 26)
    table = None if radius is None else table_of(2, radius)
    out = _extension.attention_cpu(qkv, lengths, table, window, isa=isa)
    torch.testing.assert_close(out, reference(qkv, lengths, table, window), rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [None, 2])
def test_holes_measure_distances_between_columns(isa, window):
    """A mask with holes: distances between the tokens' columns in the padded batch, not between their offsets."""
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0, 0, 0, 1], [0, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    lengths = mask.sum(dim=1).tolist()
    columns = torch.arange(10).expand(2, 10)[mask].to(torch.int32)
    qkv, table = qkv_of(sum(lengths), 3, 16), table_of(3, 2)
    out = _extension.attention_cpu(qkv, lengths, table, window, columns, isa=isa)
    expected = reference(qkv, lengths, table, window, columns)
    torch.testing.assert_close(out, expected, rtol=0, atol=FP32_TOL)
    assert not torch.allclose(out, _extension.attention_cpu(qkv, lengths, table, window), atol=1e-3)


def test_threads_give_the_same_result():
    """Tasks are split by sequence, head and block of queries: every thread count computes the same sums."""
    lengths = [300, 7, 64]
    qkv, table = qkv_of(sum(lengths), 4, 32), table_of(4, 128)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_extension.attention_cpu(qkv, lengths, table))
    finally:
        torch.set_num_threads(threads)
    for out in results[1:]:
        torch.testing.assert_close(out, results[0], rtol=0, atol=0)


def test_bad_arguments_raise_before_the_kernel():
    qkv = qkv_of(5, 2, 8)
    with pytest.raises(ValueError, match="seqlens"):
        _extension.attention_cpu(qkv, [3, 3])
    with pytest.raises(ValueError, match="qkv"):
        _extension.attention_cpu(qkv.double(), [5])
    with pytest.raises(ValueError, match="relative_bias"):
        _extension.attention_cpu(qkv, [5], torch.zeros(2, 4))
    with pytest.raises(ValueError, match="window"):
        _extension.attention_cpu(qkv, [5], None, -1)
    with pytest.raises(ValueError, match="columns"):
        _extension.attention_cpu(qkv, [5], None, None, torch.arange(5))
    with pytest.raises(ValueError, match="isa"):
        _extension.attention_cpu(qkv, [5], isa="sse2")


def test_model_attention_takes_the_kernel_for_float32_inference():
    """The dispatch picks it for float32 on CPU; a packed layout and a dense one without padding both run it."""
    assert dispatch.report(torch.device("cpu"), torch.float32)[0]["attention"] == "cpu-ext"
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    layout = padding.unpadded_layout(mask)
    qkv = qkv_of(7, 2, 8).view(7, 48)
    with torch.inference_mode():
        out = attention.attention(qkv, layout, 2)
    torch.testing.assert_close(out.view(7, 2, 8), reference(qkv.view(7, 3, 2, 8), [3, 4]), rtol=0, atol=FP32_TOL)
