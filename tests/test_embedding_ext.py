"""fastbert._C's fused embedding (C++ on CPU, CUDA on GPU) against the PyTorch reference in kernels/embedding.py.

fp32 must match the reference to 1e-5. Low precision follows flash-attention's method: the kernel's error against
the fp32 reference may be at most twice the error of PyTorch itself run in that dtype, plus a tiny atol.
"""

import pytest
import torch

from fastbert import _extension
from fastbert.ops import embedding
from fastbert.kernels.embedding import embedding_layer_norm_ref
from kernel_checks import max_error

VOCAB, MAX_POSITIONS, TYPE_VOCAB = 50, 20, 2
HIDDEN_SIZES = (1, 26, 312, 768, 1000)  # 1 and 26: below a warp; 1000: not a multiple of 16-byte vectors in bf16
TOKEN_COUNTS = (0, 1, 37)
ATOL = 1e-6  # of the 2x rule: tighter than the Triton kernels' (kernel_checks.ATOL)


def make_inputs(n_tokens, hidden, dtype, device="cpu", seed=0):
    """(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias) with in-range ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, rows, (n_tokens,), generator=gen) for rows in (VOCAB, MAX_POSITIONS, TYPE_VOCAB)]
    tables = [torch.randn(rows, hidden, generator=gen) for rows in (VOCAB, MAX_POSITIONS, TYPE_VOCAB)]
    weight = 1 + 0.1 * torch.randn(hidden, generator=gen)
    bias = 0.1 * torch.randn(hidden, generator=gen)
    return [t.to(device) for t in ids] + [t.to(device, dtype) for t in (*tables, weight, bias)]


def fp32_reference(inputs, eps):
    ids, tables = inputs[:3], inputs[3:]
    return embedding_layer_norm_ref(*ids, *(t.float() for t in tables), eps)


def assert_close_to_reference(out, inputs, eps):
    """fp32: within 1e-5 of the reference; lower precision: at most 2x PyTorch's own error in that dtype + ATOL."""
    ref = fp32_reference(inputs, eps)
    assert out.shape == ref.shape and out.dtype == inputs[3].dtype and out.device == inputs[3].device
    if out.dtype == torch.float32:
        assert max_error(out, ref) <= 1e-5
    else:
        torch_error = max_error(embedding_layer_norm_ref(*inputs, eps), ref)
        assert max_error(out, ref) <= 2 * torch_error + ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_cpu_matches_reference(n_tokens, hidden, dtype):
    inputs = make_inputs(n_tokens, hidden, dtype)
    out = embedding.embedding_layer_norm(*inputs, 1e-12)
    assert_close_to_reference(out, inputs, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_many_tokens_multithreaded(dtype):
    # 300 x 768 elements is above the kernel's threshold for an OpenMP parallel region.
    inputs = make_inputs(300, 768, dtype)
    assert_close_to_reference(embedding.embedding_layer_norm(*inputs, 1e-12), inputs, 1e-12)


def test_cpu_eps_is_applied():
    inputs = make_inputs(37, 26, torch.float32)
    assert_close_to_reference(embedding.embedding_layer_norm(*inputs, 0.5), inputs, 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_out_of_range_indices_are_clamped(dtype):
    inputs = make_inputs(6, 26, dtype)
    inputs[0] = torch.tensor([-5, -1, 0, VOCAB - 1, VOCAB, 10**12])
    inputs[1] = torch.tensor([MAX_POSITIONS, -1, 3, 10**9, 0, -(10**12)])
    inputs[2] = torch.tensor([2, -1, 1, 0, 7, 1])
    out = embedding.embedding_layer_norm(*inputs, 1e-12)
    clamped = [ids.clamp(0, rows - 1) for ids, rows in zip(inputs[:3], (VOCAB, MAX_POSITIONS, TYPE_VOCAB))]
    assert_close_to_reference(out, clamped + inputs[3:], 1e-12)


def test_cpu_noncontiguous_inputs_are_copied():
    inputs = make_inputs(37, 312, torch.float32)
    strided = [torch.stack([t, t], dim=-1)[..., 0] for t in inputs]  # same values, stride 2 in the last dim
    assert not any(t.is_contiguous() for t in strided)
    out = embedding.embedding_layer_norm(*strided, 1e-12)
    assert_close_to_reference(out, inputs, 1e-12)


def test_invalid_arguments_raise_before_launch():
    inputs = make_inputs(4, 26, torch.float32)

    def call(**changes):
        names = ("input_ids", "position_ids", "token_type_ids", "word", "position", "token_type", "weight", "bias")
        args = dict(zip(names, inputs)) | changes
        return embedding.embedding_layer_norm(*args.values(), 1e-12)

    with pytest.raises(TypeError, match="input_ids must be int64"):
        call(input_ids=inputs[0].int())
    with pytest.raises(ValueError, match=r"position_ids must be \[tokens\] like input_ids \(4,\)"):
        call(position_ids=inputs[1].view(2, 2))
    with pytest.raises(ValueError, match=r"token_type_ids must be \[tokens\] like input_ids \(4,\), got shape \(3,\)"):
        call(token_type_ids=inputs[2][:3])
    with pytest.raises(TypeError, match="position has dtype torch.float64 but word has torch.float32"):
        call(position=inputs[4].double())
    with pytest.raises(ValueError, match=r"position has shape \(20, 26\), expected \(20, 27\)"):
        call(word=torch.randn(VOCAB, 27))
    with pytest.raises(ValueError, match="the token_type table is empty"):
        call(token_type=torch.randn(0, 26))
    with pytest.raises(ValueError, match=r"bias has shape \(27,\), expected \(26,\)"):
        call(bias=torch.randn(27))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        call(**{k: t.half() for k, t in zip(("word", "position", "token_type", "weight", "bias"), inputs[3:])})


def test_raw_bindings_refuse_empty_tables():
    # The pybind11 layer is a raw-pointer API: sizes that would read outside a table never reach the kernel.
    with pytest.raises(ValueError, match="at least one row"):
        _extension._C.embedding_layer_norm_cpu(*[0] * 9, 1, 8, 0, 1, 1, 1e-12, 0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    for n_tokens, hidden in ((37, 26), (0, 8)):
        inputs = make_inputs(n_tokens, hidden, dtype)
        torch.library.opcheck(embedding._embedding_layer_norm_op, (*inputs, 1e-12, "ext"))


def test_build_info():
    info = _extension.build_info()
    assert {"cpu", "openmp", "cuda", "cuda_version", "archs", "ptx", "cuda_skip_reason"} <= info.keys()
    assert info["cpu"] is True and isinstance(info["openmp"], bool)
    if info["cuda"]:
        assert info["archs"] and all(arch.startswith("sm_") for arch in info["archs"])
        assert info["cuda_version"].count(".") == 1 and info["ptx"].startswith("compute_")
        assert info["cuda_skip_reason"] is None
    else:
        assert info["archs"] == [] and info["cuda_version"] is None and info["ptx"] is None
        assert info["cuda_skip_reason"]
    assert _extension.cpu_unavailable_reasons() == []


@pytest.mark.parametrize(
    "capability, archs, ptx, runs",
    [
        (86, ["sm_80"], None, True),  # same major, newer minor: the sm_80 cubin runs
        (80, ["sm_86"], None, False),  # older minor: it does not
        (90, ["sm_80"], None, False),  # another major needs PTX
        (100, ["sm_75", "sm_90"], "compute_90", True),  # PTX JIT-compiles for newer GPUs
        (75, ["sm_80", "sm_90"], "compute_90", False),  # but never for older ones
    ],
)
def test_arch_compatibility_rules(capability, archs, ptx, runs):
    assert _extension._runs_on(capability, archs, ptx) is runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES + (4096,))  # 4096: more shared memory than the default 48 KiB
@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS + (1000,))
def test_cuda_matches_reference(cuda_device, n_tokens, hidden, dtype):
    assert _extension.cuda_unavailable_reasons(cuda_device) == []
    inputs = make_inputs(n_tokens, hidden, dtype, cuda_device)
    out = embedding.embedding_layer_norm(*inputs, 1e-12)
    assert_close_to_reference(out, inputs, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_misaligned_tables_use_the_scalar_kernel(cuda_device, dtype):
    inputs = make_inputs(37, 768, dtype, cuda_device)
    shifted = torch.empty(VOCAB * 768 + 1, dtype=dtype, device=cuda_device)[1:].view(VOCAB, 768)
    inputs[3] = shifted.copy_(inputs[3])  # rows start 2 or 4 bytes off a 16-byte boundary
    assert_close_to_reference(embedding.embedding_layer_norm(*inputs, 1e-12), inputs, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_out_of_range_indices_are_clamped(cuda_device, dtype):
    inputs = make_inputs(4, 312, dtype, cuda_device)
    inputs[0] = torch.tensor([-1, VOCAB, 10**12, 3], device=cuda_device)
    out = embedding.embedding_layer_norm(*inputs, 1e-12)
    clamped = [inputs[0].clamp(0, VOCAB - 1)] + inputs[1:]
    assert_close_to_reference(out, clamped, 1e-12)


def test_cuda_runs_on_the_current_stream(cuda_device):
    inputs = make_inputs(1000, 768, torch.float32, cuda_device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = embedding.embedding_layer_norm(*inputs, 1e-12)
    stream.synchronize()
    assert_close_to_reference(out, inputs, 1e-12)


def test_cuda_opcheck(cuda_device):
    inputs = make_inputs(37, 312, torch.bfloat16, cuda_device)
    torch.library.opcheck(embedding._embedding_layer_norm_op, (*inputs, 1e-12, "ext"))
