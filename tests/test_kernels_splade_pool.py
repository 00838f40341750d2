"""fastbert.kernels.splade_pool: the SPLADE head (decoder GEMM, log(1 + ReLU), pool over each sequence's tokens) in
one kernel, against its PyTorch reference; the reference against sentence-transformers' SpladePooling.

The kernel runs through Triton's interpreter on CPU tensors (no TRITON_INTERPRET needed, see kernels/_common.py); the
cuda parametrization runs the compiled kernel on a GPU. Odd shapes: hidden 312 and 26 (not multiples of BLOCK_K),
vocabularies that are not multiples of BLOCK_V, one-token and empty sequences, sequences longer than BLOCK_T.
Comparison rule: kernel_checks.assert_close_to_ref (fp32 within 1e-5 of the fp32 reference). bf16 runs on CUDA only:
under Triton 3.9's interpreter ``tl.dot`` on bf16 operands returns garbage (DESIGN.md §6).
"""

import pytest
import torch

from fastbert.kernels._common import compilable, compile_for_gpu
from fastbert.kernels.splade_pool import (
    ACTIVATIONS,
    POOLINGS,
    _splade_pool_kernel,
    _splade_pool_op,
    splade_pool,
    splade_pool_ref,
)
from kernel_checks import DTYPES, assert_close_to_ref, cubin_resources


def make_inputs(lengths, hidden, vocab, dtype, device, bias=True, seed=0):
    """(x [N, hidden], weight [vocab, hidden], bias [vocab] or None, cu_seqlens [B + 1] int32): logits ~ N(0, 1), so
    about half are positive and log1p(relu) is curved."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), hidden, generator=g)
    weight = torch.randn(vocab, hidden, generator=g) * hidden ** -0.5
    b = 0.5 * torch.randn(vocab, generator=g) if bias else None
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    to = dict(dtype=dtype, device=device)
    return x.to(**to), weight.to(**to), None if b is None else b.to(**to), cu_seqlens.to(device)


def check(lengths, hidden, vocab, dtype, device, activation="relu", pooling="max", bias=True):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("bf16 tl.dot is wrong under Triton 3.9's interpreter (DESIGN.md §6): bf16 is tested on CUDA")
    x, weight, b, cu_seqlens = make_inputs(lengths, hidden, vocab, dtype, device, bias)
    out = splade_pool(x, weight, b, cu_seqlens, activation, pooling)
    ref32 = splade_pool_ref(x.float(), weight.float(), None if b is None else b.float(), cu_seqlens, activation,
                            pooling)
    same_dtype = splade_pool_ref(x, weight, b, cu_seqlens, activation, pooling)
    assert_close_to_ref(out, ref32, same_dtype)
    assert out.shape == (len(lengths), vocab) and out.is_contiguous()
    return out


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_splade_pool_matches_reference(device, activation, pooling, bias):
    check([5, 1, 23, 17], 312, 331, torch.float32, device, activation, pooling, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [[1], [3, 40, 1, 7], [70]], ids=["one-token", "mixed", "long"])
@pytest.mark.parametrize("hidden, vocab", [(26, 65), (48, 1000), (96, 130)])
def test_splade_pool_shapes(device, hidden, vocab, lengths, dtype):
    check(lengths, hidden, vocab, dtype, device)


def test_splade_pool_empty_sequences(device):
    """A sequence without tokens pools to zeros, as SpladePooling's all-masked row does; so does an empty batch."""
    out = check([4, 0, 3, 0], 26, 70, torch.float32, device)
    assert (out[1] == 0).all() and (out[3] == 0).all()
    check([4, 0], 26, 70, torch.float32, device, pooling="sum")
    x, weight, b, _ = make_inputs([2], 26, 70, torch.float32, device)
    assert splade_pool(x[:0], weight, b, torch.zeros(1, dtype=torch.int32, device=device), "relu", "max").shape == \
        (0, 70)


def test_splade_pool_strided_rows(device):
    """x and the weight are row slices of wider buffers: read through their strides."""
    x, weight, b, cu_seqlens = make_inputs([9, 4], 40, 77, torch.float32, device)
    wide_x = torch.zeros(13, 64, device=device)
    wide_x[:, 8:48] = x
    wide_w = torch.zeros(77, 50, device=device)
    wide_w[:, 3:43] = weight
    out = splade_pool(wide_x[:, 8:48], wide_w[:, 3:43], b, cu_seqlens, "relu", "max")
    torch.testing.assert_close(out, splade_pool_ref(x, weight, b, cu_seqlens, "relu", "max"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_reference_is_splade_pooling(activation, pooling):
    """``splade_pool_ref`` on the packed real tokens is sentence-transformers' SpladePooling on the padded logits of
    the same tokens (masked by the attention mask, a fully masked row included)."""
    modules = pytest.importorskip("sentence_transformers.sparse_encoder.modules")
    lengths = [6, 2, 0, 9]
    x, weight, b, cu_seqlens = make_inputs(lengths, 32, 101, torch.float32, "cpu")
    padded = torch.zeros(len(lengths), max(lengths), 32)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, (start, n) in enumerate(zip(cu_seqlens[:-1].tolist(), lengths)):
        padded[i, :n], mask[i, :n] = x[start:start + n], 1
    padded[mask == 0] = 3 * torch.randn(int((mask == 0).sum()), 32)  # what the model left there: never read
    pooling_module = modules.SpladePooling(pooling_strategy=pooling, activation_function=activation).eval()
    with torch.inference_mode():
        features = {"token_embeddings": torch.nn.functional.linear(padded, weight, b), "attention_mask": mask}
        expected = pooling_module(features)["sentence_embedding"]
    torch.testing.assert_close(splade_pool_ref(x, weight, b, cu_seqlens, activation, pooling), expected,
                               atol=1e-6, rtol=1e-6)


def test_splade_pool_opcheck():
    """torch.library's checks of the registered op: schema, fake (meta) impl, autograd registration, AOT dispatch."""
    x, weight, b, cu_seqlens = make_inputs([3, 5], 26, 40, torch.float32, "cpu")
    torch.library.opcheck(_splade_pool_op, (x, weight, b, cu_seqlens, "relu", "max"))
    torch.library.opcheck(_splade_pool_op, (x, weight, None, cu_seqlens, "log1p_relu", "sum"))


def test_splade_pool_fake_tensors_use_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, weight, b, cu_seqlens = make_inputs([3, 5], 26, 40, torch.float16, "cpu")
    with FakeTensorMode() as mode:
        out = splade_pool(*(mode.from_tensor(t) for t in (x, weight, b, cu_seqlens)), "relu", "max")
        assert out.shape == (2, 40) and out.dtype == torch.float16


@pytest.mark.skipif(not compilable(_splade_pool_kernel), reason="TRITON_INTERPRET=1 at import")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_splade_pool_compiles_for_h100(dtype, pooling):
    """The compiled path, which the interpreter never exercises, builds for sm_90 (no GPU needed), without spills."""
    x, cu_seqlens = torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.int32)
    compiled = compile_for_gpu(_splade_pool_kernel, x, x, x, cu_seqlens, x, 384, 30522, 384, 384, HAS_BIAS=True,
                               ACTIVATION="relu", POOLING=pooling, INPUT_PRECISION="ieee" if dtype == torch.float32
                               else "tf32", BLOCK_T=32, BLOCK_V=128, BLOCK_K=32)
    assert (cubin_resources(compiled) or (0, 0))[1] == 0


def test_splade_pool_errors():
    x, weight, b, cu_seqlens = make_inputs([3, 5], 26, 40, torch.float32, "cpu")
    with pytest.raises(ValueError, match="activation 'gelu': expected one of relu, log1p_relu"):
        splade_pool(x, weight, b, cu_seqlens, "gelu", "max")
    with pytest.raises(ValueError, match="pooling 'mean': expected one of max, sum"):
        splade_pool(x, weight, b, cu_seqlens, "relu", "mean")
    with pytest.raises(ValueError, match=r"weight has shape \(40, 25\), expected \(40, 26\)"):
        splade_pool(x, weight[:, :25], b, cu_seqlens, "relu", "max")
    with pytest.raises(ValueError, match=r"bias has shape \(39,\), expected \(40,\)"):
        splade_pool(x, weight, b[:39], cu_seqlens, "relu", "max")
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32 tensor"):
        splade_pool(x, weight, b, cu_seqlens.long(), "relu", "max")
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        splade_pool(x.double(), weight, b, cu_seqlens, "relu", "max")
