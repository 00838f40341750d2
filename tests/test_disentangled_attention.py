"""DeBERTa's disentangled attention (fastbert/ops/disentangled.py): fastbert._C's kernel forming each sequence's
and head's dot products with the projected relative rows in cache and gathering them per score, and torch's path
building the bias from the tables, against the float64 reference.

Odd shapes: head dims 8, 26 and 80; sequences of 0, 1, 17, 255 and 300 tokens; 1 and 37 rows; each term alone and
both; distances between offsets and between columns with holes; bfloat16 in and out (float32 inside).
"""

import dataclasses

import pytest
import torch

from fastbert import padding
from fastbert.ops import attention, attention_cpu, disentangled

CPU_KERNEL = pytest.mark.skipif(bool(attention_cpu.attention_cpu_unavailable_reasons()),
                                reason="; ".join(attention_cpu.attention_cpu_unavailable_reasons()))
FP32_TOL = 1e-5


def terms_of(heads, head_dim, rows, center, which, scale=0.1, seed=0):
    """Random projected rows [rows, heads * head_dim] for the active terms, an index into them by distance."""
    g = torch.Generator().manual_seed(seed)
    projected = lambda: torch.randn(rows, heads * head_dim, generator=g)  # noqa: E731
    index = torch.randint(0, rows, (2 * center + 1,), generator=g, dtype=torch.int32)
    return disentangled.Disentangled(projected() if "c2p" in which else None,
                                     projected() if "p2c" in which else None, index, scale)


def reference(qkv, lengths, terms, columns=None):
    """float64: the tables of ``terms`` with these tokens, then the attention they make."""
    double = dataclasses.replace(terms, pos_key=None if terms.pos_key is None else terms.pos_key.double(),
                                 pos_query=None if terms.pos_query is None else terms.pos_query.double())
    return disentangled.attention_ref(qkv, lengths, disentangled.tables(qkv.double(), double), columns)


def qkv_of(tokens, heads, head_dim, seed=1):
    return torch.randn(tokens, 3, heads, head_dim, generator=torch.Generator().manual_seed(seed))


@CPU_KERNEL
@pytest.mark.parametrize("isa", attention_cpu.attention_cpu_isas())
@pytest.mark.parametrize("head_dim", [8, 26, 80])
@pytest.mark.parametrize("lengths", [[17, 0, 1, 5], [255], [300, 3]], ids=["mixed", "tile-edge", "long"])
@pytest.mark.parametrize("which", [("c2p", "p2c"), ("c2p",), ("p2c",)], ids="+".join)
@pytest.mark.parametrize("rows", [1, 37])
def test_kernel_matches_reference(isa, head_dim, lengths, which, rows):
    heads, tokens = 3, sum(lengths)
    qkv, terms = qkv_of(tokens, heads, head_dim), terms_of(heads, head_dim, rows, max(lengths), which)
    out = attention_cpu.attention_cpu(qkv, lengths, isa=isa, disentangled=terms)
    torch.testing.assert_close(out, reference(qkv, lengths, terms).float(), rtol=0, atol=FP32_TOL)


@CPU_KERNEL
@pytest.mark.parametrize("isa", attention_cpu.attention_cpu_isas())
@pytest.mark.parametrize("head_dim", [26, 27, 80])
@pytest.mark.parametrize("which", [("c2p", "p2c"), ("p2c",)], ids="+".join)
def test_kernel_in_bfloat16(isa, head_dim, which):
    """bfloat16 q, k, v and tables (float32 inside): within half a bfloat16 step of the exact attention of those bf16
    values (27: an odd head dim)."""
    lengths, heads = [17, 0, 1, 5, 300], 3
    qkv, terms = qkv_of(sum(lengths), heads, head_dim).bfloat16(), terms_of(heads, head_dim, 37, 300, which)
    terms = dataclasses.replace(terms, pos_key=None if terms.pos_key is None else terms.pos_key.bfloat16(),
                                pos_query=terms.pos_query.bfloat16())
    out = attention_cpu.attention_cpu(qkv, lengths, isa=isa, disentangled=terms)
    assert out.dtype == torch.bfloat16
    exact = reference(qkv.float(), lengths, terms).float()
    error = (out.float() - exact).abs()
    assert bool((error <= exact.abs() * 2 ** -8 + 1e-5).all()), float((error - exact.abs() * 2 ** -8).max())


@CPU_KERNEL
@pytest.mark.parametrize("isa", attention_cpu.attention_cpu_isas())
def test_kernel_with_holes_measures_between_columns(isa):
    lengths = [4, 20, 1]
    columns = torch.cat([torch.arange(4) * 3, torch.arange(20) * 2 + 1, torch.tensor([7])]).to(torch.int32)
    qkv, terms = qkv_of(sum(lengths), 2, 26), terms_of(2, 26, 11, 40, ("c2p", "p2c"))
    out = attention_cpu.attention_cpu(qkv, lengths, columns=columns, isa=isa, disentangled=terms)
    torch.testing.assert_close(out, reference(qkv, lengths, terms, columns).float(), rtol=0, atol=FP32_TOL)
    assert (out - reference(qkv, lengths, terms).float()).abs().max() > 1e-3  # (the holes count)


@CPU_KERNEL
def test_bad_rows_raise_before_the_kernel():
    qkv, terms = qkv_of(6, 2, 8), terms_of(2, 8, 5, 5, ("c2p", "p2c"))
    with pytest.raises(ValueError, match="pos_key must be"):
        attention_cpu.attention_cpu(qkv, [6], disentangled=dataclasses.replace(terms, pos_key=terms.pos_key[:, :15]))
    with pytest.raises(ValueError, match="index must hold rows"):
        attention_cpu.attention_cpu(qkv, [6], disentangled=dataclasses.replace(terms, index=terms.index + 5))
    with pytest.raises(ValueError, match="index covers distances up to 2"):
        attention_cpu.attention_cpu(qkv, [6], disentangled=dataclasses.replace(terms, index=terms.index[3:8]))
    with pytest.raises(ValueError, match="index must be an int32"):
        attention_cpu.attention_cpu(qkv, [6], disentangled=dataclasses.replace(terms, index=terms.index.long()))


@CPU_KERNEL
def test_registered_op():
    """The torch.library op with the rows (schema, fake tensor, autograd registration)."""
    qkv, terms = qkv_of(12, 2, 8), terms_of(2, 8, 5, 7, ("c2p", "p2c"))
    torch.library.opcheck(torch.ops.fastbert.attention_cpu.default,
                          (qkv, [5, 7], None, None, None, "", terms.pos_key, terms.pos_query, terms.index, 0.2))


@pytest.mark.parametrize("unpad", [True, False])
def test_torch_path_matches_reference(unpad):
    """The op's torch backend (SDPA with the bias built from the tables), packed and dense with padding (real
    queries: each row's real keys, distances between their columns)."""
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [0, 0] + [1] * 7])
    packed = padding.with_columns(padding.unpadded_layout(mask))
    layout = packed if unpad else padding.with_columns(padding.dense_layout(*mask.shape, mask.bool()))
    dense = qkv_of(27, 3, 26)
    keep = mask.flatten().bool()
    qkv = dense[keep] if unpad else dense
    terms = terms_of(3, 26, 17, 8, ("c2p", "p2c"))
    out = attention._torch_run(None, qkv, layout, 0.0, None, None, terms, None).reshape(qkv.shape[0], 3, 26)
    expected = reference(dense[keep], packed.seqlens, terms, packed.columns)
    torch.testing.assert_close((out if unpad else out[keep]).double(), expected, rtol=0, atol=FP32_TOL)
