"""The Triton attention kernel with DeBERTa's disentangled terms (c2p and p2c tables gathered per score), both
layouts, against the references: ``fastbert/ops/disentangled.py``'s ``attention_ref`` (packed, distances between
offsets or between columns with holes) and ``kernels/attention.py``'s ``attention_ref`` (padded; a padding query
averages every key there, as transformers' DeBERTa's [B, 1, S, S] mask makes it).

On CPU through Triton's interpreter (16 x 16 blocks: the 19- and 37-token sequences cross them), on CUDA compiled.
16-bit: within 2x torch's own error in that dtype (kernel_checks' rule), the tables in that dtype as the model makes
them.
"""

import pytest
import torch

from fastbert.kernels.attention import attention, attention_ref
from fastbert.kernels.attention_varlen import _attention_varlen_op, attention_varlen
from fastbert.ops import disentangled
from kernel_checks import DTYPES, assert_close_to_ref

HEADS, ROWS, SCALE = 2, 9, 0.1


def skip_bf16_on_interpreter(dtype, device):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("bf16 tl.dot is wrong under Triton 3.9's interpreter: bf16 is tested on CUDA")


def tables(tokens, center, which, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(HEADS, tokens, ROWS, generator=g).to(dtype).to(device)  # noqa: E731
    index = torch.randint(0, ROWS, (2 * center + 1,), generator=g, dtype=torch.int32).to(device)
    return make() if "c2p" in which else None, make() if "p2c" in which else None, index


def packed_reference(qkv, lengths, c2p, p2c, index, columns=None, dtype=torch.float32):
    terms = disentangled.Tables(None if c2p is None else c2p.cpu().to(dtype),
                                      None if p2c is None else p2c.cpu().to(dtype), index.cpu(), SCALE)
    if dtype == torch.float64:
        return disentangled.attention_ref(qkv.cpu(), lengths, terms, None if columns is None else columns.cpu())
    out = torch.cat([_torch_in(qkv.cpu().to(dtype)[s:s + n], terms, s, n, columns) for s, n in _starts(lengths)])
    return out


def _starts(lengths):
    start = 0
    for n in lengths:
        yield start, n
        start += n


def _torch_in(qkv, terms, start, length, columns):
    """One sequence in torch ops in qkv's dtype (what the 16-bit rule compares with)."""
    q, k, v = qkv.permute(1, 2, 0, 3)
    cols = torch.arange(length) if columns is None else columns.cpu()[start:start + length].long()
    bias = disentangled.bias(terms, slice(start, start + length), cols)
    return (((q @ k.transpose(1, 2) + bias) * SCALE).softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", [("c2p", "p2c"), ("c2p",), ("p2c",)], ids="+".join)
@pytest.mark.parametrize("holes", [False, True], ids=["offsets", "columns"])
def test_varlen(device, dtype, which, holes):
    skip_bf16_on_interpreter(dtype, device)
    lengths, head_dim = [5, 37, 1, 19], 26
    tokens = sum(lengths)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, 3, HEADS, head_dim, generator=g).to(dtype).to(device)
    columns = None
    if holes:  # every sequence's columns 0, 2, 4, ...
        columns = torch.cat([torch.arange(n) * 2 for n in lengths]).to(torch.int32).to(device)
    c2p, p2c, index = tables(tokens, 2 * max(lengths), which, dtype, device)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = attention_varlen(qkv, cu_seqlens, max(lengths), None, columns, None, c2p, p2c, index, SCALE)
    ref32 = packed_reference(qkv.float(), lengths, None if c2p is None else c2p.float(),
                             None if p2c is None else p2c.float(), index, columns)
    same = packed_reference(qkv, lengths, c2p, p2c, index, columns, dtype)
    assert_close_to_ref(out.cpu(), ref32, same, fp32_tol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_masks_queries_too(device, dtype):
    """Real queries as the reference; a padding query averages every value (transformers' DeBERTa)."""
    skip_bf16_on_interpreter(dtype, device)
    batch, seq_len, head_dim = 3, 19, 26
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch, seq_len, 3, HEADS, head_dim, generator=g).to(dtype).to(device)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    mask[1, 11:], mask[2, :4] = False, False
    c2p, p2c, index = tables(batch * seq_len, seq_len, ("c2p", "p2c"), dtype, device)
    out = attention(qkv, mask.to(device), None, None, None, c2p, p2c, index, SCALE, mask_queries=True).cpu()
    args = dict(c2p=c2p.cpu(), p2c=p2c.cpu(), rel_index=index.cpu(), scale=SCALE)
    ref32 = attention_ref(qkv.cpu().float(), mask, **{**args, "c2p": c2p.cpu().float(), "p2c": p2c.cpu().float()})
    same = attention_ref(qkv.cpu(), mask, upcast=False, **args)
    assert_close_to_ref(out[mask], ref32[mask], same[mask], fp32_tol=1e-4)
    values = qkv.cpu().float()[:, :, 2]  # [B, S, H, D]
    torch.testing.assert_close(out[1, 15].float(), values[1].mean(0), atol=2e-2 if dtype != torch.float32 else 1e-5,
                               rtol=0)


def test_padded_masks_queries_without_tables(device):
    """A DeBERTa layer without position terms (relative_attention off): its scale, and padding queries averaging
    every value, still."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 9, 3, HEADS, 16, generator=g).to(device)
    mask = torch.tensor([[True] * 9, [True] * 4 + [False] * 5])
    out = attention(qkv, mask.to(device), None, None, None, None, None, None, SCALE, mask_queries=True).cpu()
    ref = attention_ref(qkv.cpu(), mask, scale=SCALE)
    torch.testing.assert_close(out[mask], ref[mask], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1, 6], qkv.cpu()[1, :, 2].mean(0), atol=1e-5, rtol=0)


def test_bad_tables_raise(device):
    qkv = torch.randn(10, 3, HEADS, 8, device=device)
    cu_seqlens = torch.tensor([0, 10], dtype=torch.int32, device=device)
    c2p, p2c, index = tables(10, 9, ("c2p", "p2c"), torch.float32, device)
    with pytest.raises(ValueError, match="c2p must be contiguous"):
        attention_varlen(qkv, cu_seqlens, 10, None, None, None, c2p[:, :5], p2c, index, SCALE)
    with pytest.raises(ValueError, match="center >= 9"):
        attention_varlen(qkv, cu_seqlens, 10, None, None, None, c2p, p2c, index[1:-1], SCALE)
    with pytest.raises(TypeError, match="rel_index must be an int32"):
        attention_varlen(qkv, cu_seqlens, 10, None, None, None, c2p, p2c, index.long(), SCALE)
    with pytest.raises(ValueError, match="scale must be None or a positive float"):
        attention_varlen(qkv, cu_seqlens, 10, None, None, None, c2p, p2c, index, -1.0)


def test_registered_op(device):
    qkv = torch.randn(12, 3, HEADS, 16, device=device)
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    c2p, p2c, index = tables(12, 7, ("c2p", "p2c"), torch.float32, device)
    torch.library.opcheck(_attention_varlen_op, (qkv, cu_seqlens, 7, None, None, None, c2p, p2c, index, SCALE))
