"""fastbert.ops.splade_pool: the op's backends against the reference (kernels/splade_pool.py's splade_pool_ref) on odd
shapes (the torch and onednn backends each, float32; onednn in bfloat16 too), the torch backend's bounded scratch, a
decoder that is not plain (called, not read), dispatch (onednn on the CPU where oneDNN runs GEMMs here, else torch;
triton under TRITON_INTERPRET=1 with FASTBERT_BACKEND=triton), forward-only, and info()."""

import pytest
import torch
from torch import nn

import fastbert
from fastbert import cpu_gemm
from fastbert.kernels.splade_pool import ACTIVATIONS, POOLINGS, splade_pool_ref
from fastbert.ops import gemm, splade_pool as op

CPU = torch.device("cpu")
ONEDNN = pytest.mark.skipif(bool(cpu_gemm.unavailable_reasons(torch.float32)),
                            reason="; ".join(cpu_gemm.unavailable_reasons(torch.float32)))
RUNS = {"torch": op._torch_run, "onednn": op._onednn_run}


def make(lengths, hidden, vocab, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    decoder = nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        decoder.weight.copy_(torch.randn(vocab, hidden, generator=g) * hidden ** -0.5)
        if bias:
            decoder.bias.copy_(0.5 * torch.randn(vocab, generator=g))
    x = torch.randn(sum(lengths), hidden, generator=g)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu_seqlens, decoder.eval()


def reference(x, cu_seqlens, decoder, activation, pooling):
    return splade_pool_ref(x, decoder.weight.detach(), None if decoder.bias is None else decoder.bias.detach(),
                           cu_seqlens, activation, pooling)


@pytest.mark.parametrize("backend", ["torch", pytest.param("onednn", marks=ONEDNN)])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("lengths, hidden, vocab", [
    ([5, 1, 23, 0, 17], 312, 331),
    ([1], 26, 65),
    ([300, 2, 700, 50], 48, 3001),  # past TOKEN_BLOCK tokens; vocab blocks of 1024 with a partial last one
], ids=["mixed", "one-token", "blocks"])
def test_cpu_backends_match_reference(lengths, hidden, vocab, bias, activation, pooling, backend):
    x, cu_seqlens, decoder = make(lengths, hidden, vocab, bias)
    with torch.inference_mode():
        out = RUNS[backend](op.Call(decoder, activation, pooling, True, CPU, x.dtype), x, cu_seqlens)
        expected = reference(x, cu_seqlens, decoder, activation, pooling)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if 0 in lengths:
        assert (out[lengths.index(0)] == 0).all()


@pytest.mark.skipif(bool(cpu_gemm.unavailable_reasons(torch.bfloat16)),
                    reason="; ".join(cpu_gemm.unavailable_reasons(torch.bfloat16)))
def test_onednn_backend_in_bfloat16():
    """bfloat16 in and out: within 2x the error of the reference run in bfloat16 (both against float64)."""
    x, cu_seqlens, decoder = make([5, 1, 300, 17], 312, 3001)
    exact = reference(x.double(), cu_seqlens, decoder.double(), "relu", "max")
    x, decoder = x.bfloat16(), decoder.bfloat16()
    with torch.inference_mode():
        out = op._onednn_run(op.Call(decoder, "relu", "max", True, CPU, x.dtype), x, cu_seqlens)
        in_bf16 = reference(x, cu_seqlens, decoder, "relu", "max")
    assert out.dtype == torch.bfloat16
    assert float((out.double() - exact).abs().max()) <= 2 * float((in_bf16.double() - exact).abs().max())


def test_torch_backend_scratch_is_bounded(monkeypatch, fastbert_env):
    """The GEMM's blocks never hold more than SCRATCH_ELEMENTS values: with a small bound, many blocks, same result."""
    fastbert_env(FASTBERT_CPU_GEMM="torch")
    monkeypatch.setattr(op, "SCRATCH_ELEMENTS", 4096)
    monkeypatch.setattr(op, "TOKEN_BLOCK", 16)
    x, cu_seqlens, decoder = make([40, 3, 9], 26, 1000)
    blocks = []
    original = torch.mm

    def counted(a, b, *, out=None):
        blocks.append(out.numel())
        return original(a, b, out=out)

    monkeypatch.setattr(op.torch, "mm", counted)
    with torch.inference_mode():
        out = op.splade_pool(x, cu_seqlens, decoder, "relu", "max")
    assert len(blocks) > 10 and max(blocks) <= 16 * 256  # (at least 128 vocabulary entries a block)
    torch.testing.assert_close(out, reference(x, cu_seqlens, decoder, "relu", "max"), atol=1e-5, rtol=1e-5)


class Doubled(nn.Module):
    """A decoder that is not a plain Linear (as PEFT's wrappers are): it must be called, not read."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear
        self.out_features = linear.out_features

    def forward(self, x):
        return 2 * self.linear(x)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_a_decoder_that_is_not_plain_is_called(pooling):
    x, cu_seqlens, decoder = make([4, 7], 26, 129)
    wrapped = Doubled(decoder)
    with torch.inference_mode():
        out = op.splade_pool(x, cu_seqlens, wrapped, "relu", pooling)
    doubled = nn.Linear(26, 129)
    doubled.load_state_dict({"weight": 2 * decoder.weight.detach(), "bias": 2 * decoder.bias.detach()})
    torch.testing.assert_close(out, reference(x, cu_seqlens, doubled, "relu", pooling), atol=1e-5, rtol=1e-5)


def test_dispatch(fastbert_env):
    """onednn on the CPU where oneDNN runs this dtype's GEMMs here, else torch (Triton there only under the
    interpreter, by design); FASTBERT_BACKEND=triton with TRITON_INTERPRET=1 runs the kernel, with the same result."""
    x, cu_seqlens, decoder = make([6, 2, 11], 48, 200)
    decoder.requires_grad_(False)
    cpu_choice = "onednn" if gemm.onednn_runs(CPU, torch.float32) else "torch"
    assert op._decide(x, decoder, "relu", "max").backend.name == cpu_choice
    assert op._decide(x, Doubled(decoder), "relu", "max").backend.name == "torch"
    with torch.inference_mode():
        on_torch = op.splade_pool(x, cu_seqlens, decoder, "relu", "max")
    fastbert_env(TRITON_INTERPRET="1", FASTBERT_BACKEND="triton")
    assert op._decide(x, decoder, "relu", "max").backend.name == "triton"
    assert op._decide(x, Doubled(decoder), "relu", "max").backend.name == "torch"
    with torch.inference_mode():
        torch.testing.assert_close(op.splade_pool(x, cu_seqlens, decoder, "relu", "max"), on_torch, atol=1e-5,
                                   rtol=1e-5)


def test_forward_only_and_listed():
    x, cu_seqlens, decoder = make([3], 26, 40)
    with pytest.raises(RuntimeError, match="splade_pool is forward-only, and gradients are required"):
        op.splade_pool(x, cu_seqlens, decoder, "relu", "max")
    with pytest.raises(ValueError, match="pooling 'mean': expected one of max, sum"):
        op.splade_pool(x, cu_seqlens, decoder, "relu", "mean")
    assert "splade_pool" in fastbert.info()["backends"]
