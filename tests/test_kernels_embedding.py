"""fastbert.kernels.embedding: LayerNorm(word[ids] + position[pos] + token_type[tt]) against its PyTorch reference.

On CPU the kernels run through Triton's interpreter; ``fastbert.kernels`` picks it per launch for CPU tensors, so no
TRITON_INTERPRET is needed (see kernels/_common.py). The cuda parametrization runs the compiled kernel on a GPU.
Comparison rule: kernel_checks.assert_close_to_ref (flash-attention's, fp32 within 1e-5 of the fp32 reference).
"""

import pytest
import torch

from fastbert.kernels._common import calculate_settings, compilable, compile_for_gpu
from fastbert.kernels.embedding import _embedding_layer_norm_kernel, embedding_layer_norm, embedding_layer_norm_ref
from fastbert.ops.embedding import _embedding_layer_norm_op
from kernel_checks import DTYPES, assert_close_to_ref, cubin_resources

VOCAB, MAX_POS, TYPE_VOCAB = 50, 40, 2


def make_tables(hidden, dtype, device, seed=0):
    """(word, position, token_type, weight, bias) with random LayerNorm parameters."""
    g = torch.Generator().manual_seed(seed)
    word = torch.randn(VOCAB, hidden, generator=g)
    position = torch.randn(MAX_POS, hidden, generator=g)
    token_type = torch.randn(TYPE_VOCAB, hidden, generator=g)
    weight = 1 + 0.2 * torch.randn(hidden, generator=g)
    bias = 0.2 * torch.randn(hidden, generator=g)
    return tuple(t.to(dtype).to(device) for t in (word, position, token_type, weight, bias))


def make_ids(n_tokens, device, dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n_tokens,), generator=g)
    positions = torch.arange(n_tokens) % MAX_POS
    types = torch.randint(0, TYPE_VOCAB, (n_tokens,), generator=g)
    return tuple(t.to(dtype).to(device) for t in (ids, positions, types))


def check_against_ref(ids, positions, types, tables, eps=1e-12):
    out = embedding_layer_norm(ids, positions, types, *tables, eps)
    ref32 = embedding_layer_norm_ref(ids, positions, types, *(t.float() for t in tables), eps)
    assert_close_to_ref(out, ref32, embedding_layer_norm_ref(ids, positions, types, *tables, eps))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens, hidden", [(1, 26), (7, 312), (37, 1000)])
def test_embedding_matches_reference(device, dtype, n_tokens, hidden):
    out = check_against_ref(*make_ids(n_tokens, device), make_tables(hidden, dtype, device))
    assert out.shape == (n_tokens, hidden) and out.is_contiguous()


def test_embedding_int32_and_strided_ids(device):
    """int32 ids, and ids as strided columns of one [tokens, 3] tensor (stride 3)."""
    tables = make_tables(312, torch.float32, device)
    check_against_ref(*make_ids(37, device, torch.int32), tables)
    stacked = torch.stack(make_ids(37, device), dim=1)  # [tokens, 3]
    ids, positions, types = stacked.unbind(1)
    assert ids.stride(0) == 3
    check_against_ref(ids, positions, types, tables)


def test_embedding_out_of_range_ids_are_clamped(device):
    """Bad ids read the nearest table row, never out of bounds (the Python layer range-checks before)."""
    tables = make_tables(26, torch.float32, device)
    ids = torch.tensor([-5, 0, VOCAB - 1, VOCAB, VOCAB + 1000, 2**40], device=device)
    positions = torch.tensor([-1, 0, MAX_POS, 3, MAX_POS + 7, -(2**40)], device=device)
    types = torch.tensor([5, -2, 1, 0, TYPE_VOCAB, 1], device=device)
    out = embedding_layer_norm(ids, positions, types, *tables, 1e-12)
    clamped = (ids.clamp(0, VOCAB - 1), positions.clamp(0, MAX_POS - 1), types.clamp(0, TYPE_VOCAB - 1))
    torch.testing.assert_close(out, embedding_layer_norm_ref(*clamped, *tables, 1e-12), atol=1e-5, rtol=1e-5)


def test_embedding_empty(device):
    out = embedding_layer_norm(*make_ids(0, device), *make_tables(26, torch.float32, device), 1e-12)
    assert out.shape == (0, 26)


def test_embedding_opcheck():
    """torch.library's checks of the registered op (fastbert.ops.embedding's, with this kernel as its "triton"
    implementation): schema, fake (meta) impl, autograd registration, AOT dispatch."""
    args = (*make_ids(7, "cpu"), *make_tables(26, torch.float32, "cpu"), 1e-12, "triton")
    torch.library.opcheck(_embedding_layer_norm_op, args)


@pytest.mark.skipif(not compilable(_embedding_layer_norm_kernel), reason="TRITON_INTERPRET=1 at import")
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_compiles_for_h100(dtype):
    """The compiled path, which the interpreter never exercises, builds for sm_90 (no GPU needed)."""
    table, ids = torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.int64)
    block_n, num_warps = calculate_settings(768)
    # type_vocab 1 (RoBERTa-likes): a launch specializes it to a constexpr, another build to check.
    for type_vocab in (2, 1):
        compiled = compile_for_gpu(
            _embedding_layer_norm_kernel, ids, ids, ids.int(), table, table, table, table, table, table, 3, 3, 3,
            768, 768, 768, 30522, 512, type_vocab, 768, 1e-12, BLOCK_N=block_n, num_warps=num_warps,
        )
        assert (cubin_resources(compiled) or (0, 0))[1] == 0  # no register spills


def test_embedding_errors():
    ids, positions, types = make_ids(7, "cpu")
    word, position, token_type, weight, bias = make_tables(26, torch.float32, "cpu")

    def call(**overrides):
        args = dict(input_ids=ids, position_ids=positions, token_type_ids=types, word=word, position=position,
                    token_type=token_type, weight=weight, bias=bias, eps=1e-12)
        args.update(overrides)
        return embedding_layer_norm(**args)

    with pytest.raises(TypeError, match="input_ids must be int64 or int32"):
        call(input_ids=ids.float())
    with pytest.raises(ValueError, match="position_ids must be \\[tokens\\]"):
        call(position_ids=positions[:6])
    with pytest.raises(ValueError, match="token_type_ids must be \\[tokens\\]"):
        call(token_type_ids=types[None])
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        call(word=word.double())
    with pytest.raises(TypeError, match="position has dtype torch.float16"):
        call(position=position.half())
    with pytest.raises(ValueError, match=r"token_type has shape \(2, 25\)"):
        call(token_type=token_type[:, :25])
    with pytest.raises(ValueError, match=r"weight has shape \(27,\)"):
        call(weight=torch.ones(27))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        call(word=torch.randn(26, VOCAB).t())
    with pytest.raises(ValueError, match="table is empty"):
        call(token_type=token_type[:0])
