"""fastbert.BertModel vs transformers.BertModel on random configurations, with the 2x rule of conftest.py.

Every comparison is on real tokens only: fastbert's packed path leaves zeros at padding positions by design.
"""

import pytest
import torch

import fastbert
from fastbert import padding
from fastbert.ops import attention

# Configurations named by what they exercise: head dims 16, 26 (hidden 312, not a multiple of 64) and 64, and the
# three activations BERT checkpoints use.
CONFIGS = [
    pytest.param(dict(hidden_size=64, num_attention_heads=4, hidden_act="gelu"), id="h64-d16-gelu"),
    pytest.param(dict(hidden_size=312, num_attention_heads=12, intermediate_size=256, hidden_act="gelu_new"),
                 id="h312-d26-gelu_new"),
    pytest.param(dict(hidden_size=128, num_attention_heads=2, hidden_act="relu"), id="h128-d64-relu"),
]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),  # HF runs fp16 on CPU (torch >= 2.x), so both sides can be measured
]


def mixed_mask(batch: int, seq_len: int) -> torch.Tensor:
    """[batch, seq_len] long mask cycling through the padding patterns a real batch has: full, right-padded,
    left-padded, holes, a single real token (first or last). No fully padded row (see its own test)."""
    rows = []
    for b in range(batch):
        row = torch.ones(seq_len, dtype=torch.long)
        length = 1 + (b * 7) % seq_len
        kind = b % 6
        if kind == 1:
            row[length:] = 0  # right padding
        elif kind == 2:
            row[: seq_len - length] = 0  # left padding
        elif kind == 3:
            row[seq_len // 4 : seq_len // 2] = 0  # a hole
            row[-2] = 0
        elif kind == 4:
            row[1:] = 0  # only the first token
        elif kind == 5:
            row[:-1] = 0  # only the last token
        rows.append(row)
    return torch.stack(rows)


def random_inputs(config, batch: int, seq_len: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
    token_type_ids = torch.randint(0, config.type_vocab_size, (batch, seq_len), generator=generator)
    return input_ids, token_type_ids


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("overrides", CONFIGS)
def test_matches_hf(bert_trio, assert_matches_hf, overrides, dtype, unpad):
    """Batch 16 of mixed padding, random token types: last_hidden_state and pooler on real tokens, on the packed
    path (the default) and the dense masked one (``unpad=False``)."""
    trio = bert_trio(dtype=dtype, unpad=unpad, **overrides)
    input_ids, token_type_ids = random_inputs(trio.config, 16, 24)
    mask = mixed_mask(16, 24)
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask, token_type_ids=token_type_ids)

    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask, dtype=dtype)
    if unpad:
        assert (out.last_hidden_state[~mask.bool()] == 0).all(), "packed path: padding positions are zeros"
    first_real = mask[:, 0].bool()  # HF's pooler reads position 0 whether real or not: compare where it is real
    assert_matches_hf(out.pooler_output, out_hf.pooler_output, out_ref.pooler_output, first_real, dtype=dtype,
                      name="pooler_output")


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "right-padded"])
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (16, 1), (1, 512), (16, 512)])
def test_sequence_lengths(bert_trio, assert_matches_hf, batch, seq_len, with_mask):
    """seq 1 and 512 (the position table's full length), batch 1 and 16, on a tiny hidden size."""
    trio = bert_trio(hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    input_ids, _ = random_inputs(trio.config, batch, seq_len)
    mask = None
    if with_mask:
        lengths = torch.arange(batch) * 37 % seq_len + 1  # 1 .. seq_len real tokens, right-padded
        mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)
    real = None if mask is None else mask.bool()
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, real)
    assert_matches_hf(out.pooler_output, out_hf.pooler_output, out_ref.pooler_output, name="pooler_output")


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_fully_padded_row(bert_trio, assert_matches_hf, unpad):
    """A row with no real token: no NaN anywhere, other rows as HF; on the packed path its outputs are zeros."""
    trio = bert_trio(unpad=unpad)
    input_ids, _ = random_inputs(trio.config, 3, 10)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1] = 0
    mask[2, 6:] = 0
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask, output_hidden_states=True)

    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)
    rows = torch.tensor([True, False, True])
    assert_matches_hf(out.pooler_output, out_hf.pooler_output, out_ref.pooler_output, rows, name="pooler_output")
    if unpad:
        assert (out.last_hidden_state[1] == 0).all()
        assert all((h[1] == 0).all() for h in out.hidden_states)


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_mask_forms(bert_trio, assert_matches_hf, unpad):
    """No mask, an all-ones mask (bool, long, float) give the same outputs as HF; so does a float 0/1 padding mask."""
    trio = bert_trio(unpad=unpad)
    input_ids, _ = random_inputs(trio.config, 4, 12)
    out, out_hf, out_ref = trio.run(input_ids)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state)
    for dtype in (torch.bool, torch.long, torch.float32):
        ones = torch.ones(4, 12, dtype=dtype)
        with torch.no_grad():
            torch.testing.assert_close(trio.fast(input_ids, attention_mask=ones).last_hidden_state,
                                       out.last_hidden_state, rtol=0, atol=0)
    mask = mixed_mask(4, 12)
    _, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)
    for dtype in (torch.bool, torch.long, torch.float32):
        with torch.no_grad():
            out = trio.fast(input_ids, attention_mask=mask.to(dtype))
        assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask,
                          name=f"last_hidden_state ({dtype} mask)")


@pytest.mark.parametrize("positions", ["batch", "broadcast"])
def test_token_types_and_positions(bert_trio, assert_matches_hf, positions):
    """token_type_ids and custom position_ids, [B, S] or [1, S], with padding."""
    trio = bert_trio(type_vocab_size=3)
    input_ids, token_type_ids = random_inputs(trio.config, 5, 16, seed=1)
    generator = torch.Generator().manual_seed(2)
    rows = 5 if positions == "batch" else 1
    position_ids = torch.stack([torch.randperm(64, generator=generator)[:16] for _ in range(rows)])
    mask = mixed_mask(5, 16)
    kwargs = dict(attention_mask=mask, token_type_ids=token_type_ids, position_ids=position_ids)
    out, out_hf, out_ref = trio.run(input_ids, **kwargs)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)
    # The inputs matter: zero token types or default positions give different outputs.
    with torch.no_grad():
        default = trio.fast(input_ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(default[mask.bool()], out.last_hidden_state[mask.bool()], atol=1e-2)


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_output_hidden_states(bert_trio, assert_matches_hf, unpad):
    trio = bert_trio(num_hidden_layers=3, unpad=unpad)
    input_ids, token_type_ids = random_inputs(trio.config, 6, 12)
    mask = mixed_mask(6, 12)
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask, token_type_ids=token_type_ids,
                                    output_hidden_states=True)
    assert len(out.hidden_states) == len(out_hf.hidden_states) == trio.config.num_hidden_layers + 1
    for i, (h, h_hf, h_ref) in enumerate(zip(out.hidden_states, out_hf.hidden_states, out_ref.hidden_states)):
        assert_matches_hf(h, h_hf, h_ref, mask, name=f"hidden_states[{i}]")
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state, rtol=0, atol=0)


@pytest.mark.parametrize("output_hidden_states", [False, True])
def test_return_dict_false(bert_trio, output_hidden_states):
    """The tuple has HF's structure and the values of the dict output."""
    trio = bert_trio()
    input_ids, _ = random_inputs(trio.config, 3, 8)
    mask = mixed_mask(3, 8)
    kwargs = dict(attention_mask=mask, output_hidden_states=output_hidden_states)
    with torch.no_grad():
        as_tuple = trio.fast(input_ids, return_dict=False, **kwargs)
        as_dict = trio.fast(input_ids, **kwargs)
        hf_tuple = trio.hf(input_ids, return_dict=False, **kwargs)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(hf_tuple)
    assert torch.equal(as_tuple[0], as_dict.last_hidden_state)
    assert torch.equal(as_tuple[1], as_dict.pooler_output)
    if output_hidden_states:
        assert len(as_tuple[2]) == len(hf_tuple[2])
        assert all(torch.equal(a, b) for a, b in zip(as_tuple[2], as_dict.hidden_states))


def test_without_pooling_layer(bert_trio, assert_matches_hf):
    trio = bert_trio(add_pooling_layer=False)
    assert trio.fast.pooler is None
    assert trio.fast.state_dict().keys() == trio.hf.state_dict().keys()
    input_ids, _ = random_inputs(trio.config, 4, 9)
    mask = mixed_mask(4, 9)
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)
    assert out.pooler_output is None and out_hf.pooler_output is None
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)
    with torch.no_grad():  # (transformers 4.x keeps the None pooler output in the tuple, 5.x drops it)
        as_tuple = trio.fast(input_ids, attention_mask=mask, return_dict=False)
        assert len(as_tuple) == len(trio.hf(input_ids, attention_mask=mask, return_dict=False))


@pytest.mark.parametrize("seed", range(20))
def test_random_masks(bert_trio, assert_matches_hf, seed):
    """Seeded random masks: each row random lengths, holes, sometimes left-padded or empty; real tokens as HF."""
    trio = bert_trio(hidden_size=48, num_attention_heads=3, seed=seed)
    generator = torch.Generator().manual_seed(1000 + seed)
    batch, seq_len = 5, 20
    density = torch.rand(batch, 1, generator=generator)  # from nearly empty rows to full ones
    mask = (torch.rand(batch, seq_len, generator=generator) < density + 0.2).long()
    input_ids, token_type_ids = random_inputs(trio.config, batch, seq_len, seed=seed)
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask, token_type_ids=token_type_ids)
    assert torch.isfinite(out.last_hidden_state).all()
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)


# ---------------------------------------------------------------------------------------------------------------
# The packing helpers (fastbert.padding)
# ---------------------------------------------------------------------------------------------------------------


def test_unpadded_layout():
    mask = torch.tensor([
        [1, 1, 1, 0, 0],  # right padding
        [0, 0, 0, 0, 0],  # empty row
        [0, 1, 1, 1, 1],  # left padding
        [1, 0, 1, 0, 1],  # holes
        [1, 1, 1, 1, 1],
    ])
    layout = padding.unpadded_layout(mask)
    assert layout.packed and (layout.batch, layout.seq_len) == (5, 5)
    assert layout.seqlens == (3, 0, 4, 3, 5)
    assert layout.max_seqlen == 5
    assert layout.cu_seqlens.dtype == torch.int32
    assert layout.cu_seqlens.tolist() == [0, 3, 3, 7, 10, 15]
    assert layout.indices.tolist() == [0, 1, 2, 11, 12, 13, 14, 15, 17, 19, 20, 21, 22, 23, 24]
    empty = padding.unpadded_layout(torch.zeros(2, 3, dtype=torch.long))
    assert empty.seqlens == (0, 0) and empty.cu_seqlens.tolist() == [0, 0, 0] and empty.max_seqlen == 0
    full = padding.unpadded_layout(torch.ones(2, 3, dtype=torch.long))  # no padding: dense, no mask, no packing
    assert not full.packed and full.key_padding_mask is None and (full.batch, full.seq_len) == (2, 3)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long, torch.float32])
def test_pack_unpack_round_trip(mask_dtype):
    generator = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 11, generator=generator) < 0.6).to(mask_dtype)
    mask[2] = 0
    x = torch.randn(6, 11, 7, generator=generator)
    layout = padding.unpadded_layout(mask)
    packed = padding.pack(x, layout)
    real = mask.bool()
    assert torch.equal(packed, x[real])  # row-major order of the real tokens, exactly
    unpacked = padding.unpack(packed, layout)
    assert torch.equal(unpacked[real], x[real])
    assert (unpacked[~real] == 0).all()
    dense = padding.dense_layout(6, 11, mask)
    assert not dense.packed and torch.equal(padding.unpack(padding.pack(x, dense), dense), x)
    assert torch.equal(dense.key_padding_mask, real)


def test_right_padded_host_mask_goes_as_bounds_only():
    """A right-padded mask on the host becomes key bounds alone (the attention loads no mask); any other mask stays.
    The SDPA path reads the same keys either way."""
    right = (torch.arange(7)[None] < torch.tensor([[7], [3], [0]])).long()
    layout = padding.bounds_only(padding.dense_layout(3, 7, right))
    assert layout.key_padding_mask is None and torch.equal(layout.key_mask(), right.bool())
    holes = mixed_mask(4, 7)
    assert padding.bounds_only(padding.dense_layout(4, 7, holes)).key_padding_mask is not None
    heads = torch.randn(3 * 7, 3, 2, 8)
    with_mask = attention._attention_sdpa(heads, padding.dense_layout(3, 7, right), 0.0)
    torch.testing.assert_close(attention._attention_sdpa(heads, layout, 0.0), with_mask, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# The Triton path on CPU, through Triton's interpreter
# ---------------------------------------------------------------------------------------------------------------

# (module of fastbert.kernels, entry point that fastbert launches)
TRITON_ENTRY_POINTS = [
    ("attention", "attention"),
    ("attention_varlen", "attention_varlen"),
    ("layer_norm", "layer_norm"),
    ("activation", "bias_act"),
    ("embedding", "embedding_layer_norm"),
]


@pytest.mark.parametrize("layout", ["dense", "packed", "dense-masked"])
def test_triton_interpreted(bert_trio, assert_matches_hf, monkeypatch, layout, fastbert_env):
    """FASTBERT_BACKEND=triton with TRITON_INTERPRET=1: the whole model runs the Triton kernels on CPU tensors.

    triton 3.9's ``triton.jit`` decides between compiling and interpreting once, when the kernel module is imported,
    from ``TRITON_INTERPRET``; so setting it here would not reach the kernels by itself. It does not need to: the
    launchers (``kernels._common.for_device``) run CPU tensors through the interpreter at every launch, and
    ``fastbert.dispatch`` reads both variables at every op, which is what they are set for. This works whatever was
    imported before. Each kernel entry point is wrapped to count its calls, so the test fails if the model silently
    ran the torch path instead. The batch has a fully padded row (a zero-length sequence for the varlen kernel).
    """
    import importlib

    pytest.importorskip("triton")
    fastbert_env(FASTBERT_BACKEND="triton", TRITON_INTERPRET="1")
    calls = {}
    for module_name, function in TRITON_ENTRY_POINTS:
        module = importlib.import_module(f"fastbert.kernels.{module_name}")
        assert hasattr(module, function), f"fastbert.kernels.{module_name}.{function} does not exist yet"
        original = getattr(module, function)

        def counted(*args, _original=original, _name=function, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, function, counted)

    trio = bert_trio(hidden_size=52, num_attention_heads=2, intermediate_size=80, unpad=layout != "dense-masked")
    input_ids, token_type_ids = random_inputs(trio.config, 4, 10)
    mask = None
    if layout != "dense":
        mask = mixed_mask(4, 10)  # full, right-padded, left-padded, holes ...
        mask[2] = 0  # ... and one row fully padded
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask, token_type_ids=token_type_ids)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)
    assert torch.isfinite(out.last_hidden_state).all()
    rows = None if mask is None else mask[:, 0].bool()
    assert_matches_hf(out.pooler_output, out_hf.pooler_output, out_ref.pooler_output, rows, name="pooler_output")

    layers = trio.config.num_hidden_layers
    expected = {"embedding_layer_norm": 1, "layer_norm": 2 * layers, "bias_act": layers,
                "attention_varlen" if layout == "packed" else "attention": layers}
    assert calls == expected


def test_activation_without_kernel_warns_and_matches(bert_trio, assert_matches_hf, fastbert_env):
    """hidden_act "silu" has no fused kernel: on the Triton path bias+activation runs HF's module, the fallback is
    announced once, and the outputs still match HF."""
    pytest.importorskip("triton")
    fastbert_env(FASTBERT_BACKEND="triton", TRITON_INTERPRET="1")
    trio = bert_trio(hidden_size=32, num_attention_heads=2, intermediate_size=48, hidden_act="silu")
    input_ids, token_type_ids = random_inputs(trio.config, 2, 6)
    with pytest.warns(RuntimeWarning, match=r"activation SiLU\w* has no fused kernel"):
        out, out_hf, out_ref = trio.run(input_ids, token_type_ids=token_type_ids)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state)


def test_head_dim_above_kernel_limit_falls_back_to_sdpa(bert_trio, assert_matches_hf, fastbert_env):
    """head_dim 130 > the Triton attention's MAX_HEAD_DIM (128): on the Triton path (every CUDA run) attention takes
    SDPA with a warning, instead of the kernel's ValueError; the other ops still run their kernels."""
    pytest.importorskip("triton")
    fastbert_env(FASTBERT_BACKEND="triton", TRITON_INTERPRET="1")
    trio = bert_trio(hidden_size=260, num_attention_heads=2, intermediate_size=48)
    input_ids, token_type_ids = random_inputs(trio.config, 2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    with pytest.warns(RuntimeWarning, match="head_dim 130 exceeds the Triton attention kernel's 128"):
        out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask, token_type_ids=token_type_ids)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)
