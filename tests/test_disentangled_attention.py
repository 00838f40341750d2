"""DeBERTa's disentangled attention (fastbert/ops/disentangled.py): fastbert._C's kernel gathering the c2p and p2c
tables per score, and torch's path building the bias from them, against the float64 reference.

Odd shapes: head dims 8, 26 and 80; sequences of 0, 1, 17, 255 and 300 tokens; tables of 1 and 37 rows; each term
alone and both; distances between offsets and between columns with holes.
"""

import pytest
import torch

from fastbert import padding
from fastbert.ops import attention, disentangled

CPU_KERNEL = pytest.mark.skipif(bool(attention.attention_cpu_unavailable_reasons()),
                                reason="; ".join(attention.attention_cpu_unavailable_reasons()))
FP32_TOL = 1e-5


def terms_of(tokens, heads, rows, center, which, scale=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = lambda: torch.randn(heads, tokens, rows, generator=g)  # noqa: E731
    index = torch.randint(0, rows, (2 * center + 1,), generator=g, dtype=torch.int32)
    return disentangled.Disentangled(table() if "c2p" in which else None, table() if "p2c" in which else None,
                                     index, scale)


def qkv_of(tokens, heads, head_dim, seed=1):
    return torch.randn(tokens, 3, heads, head_dim, generator=torch.Generator().manual_seed(seed))


@CPU_KERNEL
@pytest.mark.parametrize("isa", attention.attention_cpu_isas())
@pytest.mark.parametrize("head_dim", [8, 26, 80])
@pytest.mark.parametrize("lengths", [[17, 0, 1, 5], [255], [300, 3]], ids=["mixed", "tile-edge", "long"])
@pytest.mark.parametrize("which", [("c2p", "p2c"), ("c2p",), ("p2c",)], ids="+".join)
@pytest.mark.parametrize("rows", [1, 37])
def test_kernel_matches_reference(isa, head_dim, lengths, which, rows):
    heads, tokens = 3, sum(lengths)
    qkv, terms = qkv_of(tokens, heads, head_dim), terms_of(tokens, heads, rows, max(lengths), which)
    out = attention.attention_cpu(qkv, lengths, isa=isa, disentangled=terms)
    torch.testing.assert_close(out, disentangled.attention_ref(qkv, lengths, terms).float(), rtol=0, atol=FP32_TOL)


@CPU_KERNEL
@pytest.mark.parametrize("isa", attention.attention_cpu_isas())
def test_kernel_with_holes_measures_between_columns(isa):
    lengths = [4, 20, 1]
    columns = torch.cat([torch.arange(4) * 3, torch.arange(20) * 2 + 1, torch.tensor([7])]).to(torch.int32)
    qkv, terms = qkv_of(sum(lengths), 2, 26), terms_of(sum(lengths), 2, 11, 40, ("c2p", "p2c"))
    out = attention.attention_cpu(qkv, lengths, columns=columns, isa=isa, disentangled=terms)
    expected = disentangled.attention_ref(qkv, lengths, terms, columns).float()
    torch.testing.assert_close(out, expected, rtol=0, atol=FP32_TOL)
    assert (out - disentangled.attention_ref(qkv, lengths, terms).float()).abs().max() > 1e-3  # (the holes count)


@CPU_KERNEL
def test_bad_tables_raise_before_the_kernel():
    qkv, terms = qkv_of(6, 2, 8), terms_of(6, 2, 5, 5, ("c2p", "p2c"))
    with pytest.raises(ValueError, match="c2p"):
        attention.attention_cpu(qkv, [6], disentangled=terms.__class__(terms.c2p[:, :5], terms.p2c, terms.index, 1.0))
    with pytest.raises(ValueError, match="index must hold rows"):
        attention.attention_cpu(qkv, [6], disentangled=terms.__class__(terms.c2p, None, terms.index + 5, 1.0))
    with pytest.raises(ValueError, match="index covers distances up to 2"):
        attention.attention_cpu(qkv, [6], disentangled=terms.__class__(terms.c2p, None, terms.index[3:8], 1.0))
    with pytest.raises(ValueError, match="index must be an int32"):
        attention.attention_cpu(qkv, [6], disentangled=terms.__class__(terms.c2p, None, terms.index.long(), 1.0))


@CPU_KERNEL
def test_registered_op():
    """The torch.library op with the tables (schema, fake tensor, autograd registration)."""
    qkv, terms = qkv_of(12, 2, 8), terms_of(12, 2, 5, 7, ("c2p", "p2c"))
    torch.library.opcheck(torch.ops.fastbert.attention_cpu.default,
                          (qkv, [5, 7], None, None, None, "", terms.c2p, terms.p2c, terms.index, 0.2))


@pytest.mark.parametrize("unpad", [True, False])
def test_torch_path_matches_reference(unpad):
    """The op's torch backend (SDPA with the bias built from the tables), packed and dense with padding."""
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [0, 0] + [1] * 7])
    layout = padding.with_columns(padding.unpadded_layout(mask) if unpad else
                                  padding.dense_layout(*mask.shape, mask.bool()))
    rows = layout.tokens
    qkv, terms = qkv_of(rows, 3, 26), terms_of(rows, 3, 17, 8, ("c2p", "p2c"))
    out = attention._torch_run(None, qkv, layout, 0.0, None, None, terms).reshape(rows, 3, 26)
    if unpad:
        expected = disentangled.attention_ref(qkv, layout.seqlens, terms, layout.columns)
    else:  # each padded row as a sequence of its real keys, compared on real queries
        keep = mask.flatten().bool()
        expected = torch.cat([disentangled.attention_ref(qkv[b * 9:(b + 1) * 9], [9], _masked(terms, b, 9, mask[b]))
                              for b in range(3)])
        out, expected = out[keep], expected[keep]
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=FP32_TOL)


def _masked(terms, b, seq_len, row_mask):
    """The tables of row b, with the padding keys' scores pushed to -inf through c2p (every query, those keys)."""
    c2p = terms.c2p[:, b * seq_len:(b + 1) * seq_len].clone()
    p2c = terms.p2c[:, b * seq_len:(b + 1) * seq_len].clone()
    p2c[:, ~row_mask.bool()] = -1e9  # a padding key's p2c row: every distance's term, so its score is masked
    return disentangled.Disentangled(c2p, p2c, terms.index, terms.scale)
