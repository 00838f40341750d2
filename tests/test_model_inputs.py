"""Bad inputs raise a clear Python exception before any kernel runs; edge-case inputs give the right outputs."""

import pytest
import torch

import fastbert
from fastbert.ops import activation, embedding, gemm, norm

# small_bert_config: vocab 99, type_vocab 2, max_position_embeddings 64, hidden 64.
B, S = 2, 6


@pytest.fixture
def model(small_bert_config):
    torch.manual_seed(0)
    return fastbert.BertModel(small_bert_config()).eval()


@pytest.fixture
def no_kernels(monkeypatch):
    """Every op of the model raises if reached: an error seen under this fixture came from the input checks."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("an op ran before the input was rejected")

    for module, name in ((embedding, "embedding"), (gemm, "stacked"), (norm, "dense_residual_layer_norm"),
                         (activation, "dense_act")):
        monkeypatch.setattr(module, name, must_not_run)


def ids(*shape, low=0, high=99):
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(0))


# (name, forward kwargs, exception type, message fragment)
BAD_INPUTS = [
    ("id >= vocab", dict(input_ids=ids(B, S).index_fill(1, torch.tensor([3]), 99)), ValueError,
     r"input_ids out of range.*vocab_size=99"),
    ("id < 0", dict(input_ids=ids(B, S).index_fill(1, torch.tensor([0]), -1)), ValueError,
     r"input_ids out of range"),
    ("token type >= type_vocab", dict(input_ids=ids(B, S), token_type_ids=torch.full((B, S), 2)), ValueError,
     r"token_type_ids out of range.*type_vocab_size=2"),
    ("position >= max_position", dict(input_ids=ids(B, S), position_ids=torch.arange(60, 60 + S)[None]), ValueError,
     r"position_ids out of range.*max_position_embeddings=64"),
    ("position < 0", dict(input_ids=ids(B, S), position_ids=torch.arange(-1, S - 1)[None]), ValueError,
     r"position_ids out of range"),
    ("seq_len > max_position", dict(input_ids=ids(B, 65)), ValueError, r"sequence length 65 exceeds the 64 positions"),
    ("mask shape", dict(input_ids=ids(B, S), attention_mask=torch.ones(B, S + 1)), ValueError,
     r"attention_mask has shape \(2, 7\)"),
    ("mask 1-d", dict(input_ids=ids(B, S), attention_mask=torch.ones(B * S)), ValueError, r"attention_mask has shape"),
    ("token types shape", dict(input_ids=ids(B, S), token_type_ids=torch.zeros(B, S - 1, dtype=torch.long)),
     ValueError, r"token_type_ids has shape \(2, 5\)"),
    ("position_ids shape", dict(input_ids=ids(B, S), position_ids=torch.arange(S)), ValueError,
     r"position_ids has shape \(6,\)"),
    ("position_ids batch", dict(input_ids=ids(B, S), position_ids=torch.arange(S).expand(3, S)), ValueError,
     r"position_ids has shape \(3, 6\)"),
    ("float input_ids", dict(input_ids=ids(B, S).float()), TypeError, r"input_ids must be an integer tensor"),
    ("bool input_ids", dict(input_ids=ids(B, S) > 50), TypeError, r"input_ids must be an integer tensor"),
    ("float token types", dict(input_ids=ids(B, S), token_type_ids=torch.zeros(B, S)), TypeError,
     r"token_type_ids must be an integer tensor"),
    ("list input_ids", dict(input_ids=[[1, 2, 3]]), TypeError, r"input_ids must be a torch.Tensor, got list"),
    ("uint64 input_ids", dict(input_ids=ids(B, S).to(torch.uint64)), TypeError,
     r"input_ids must be an integer tensor of dtype torch.int64 \(or torch.int32\), got torch.uint64"),
    ("meta input_ids", dict(input_ids=torch.empty(B, S, dtype=torch.long, device="meta")), ValueError,
     r"input_ids is on meta but the model's weights are on cpu"),
    ("meta mask", dict(input_ids=ids(B, S), attention_mask=torch.ones(B, S, device="meta")), ValueError,
     r"attention_mask is on meta"),
    ("1-d input_ids", dict(input_ids=ids(S)), ValueError, r"input_ids must be \[batch, seq_len\]"),
    ("both ids and embeds", dict(input_ids=ids(B, S), inputs_embeds=torch.zeros(B, S, 64)), ValueError,
     r"exactly one of input_ids or inputs_embeds"),
    ("neither ids nor embeds", dict(attention_mask=torch.ones(B, S)), ValueError,
     r"exactly one of input_ids or inputs_embeds"),
    ("embeds hidden size", dict(inputs_embeds=torch.zeros(B, S, 63)), ValueError, r"inputs_embeds must be \[batch"),
    ("embeds dtype", dict(inputs_embeds=torch.zeros(B, S, 64, dtype=torch.float64)), TypeError,
     r"inputs_embeds is torch.float64 but the model is torch.float32"),
    ("S = 0", dict(input_ids=ids(B, 0)), ValueError, r"zero-length sequences"),
    # Arguments of transformers.BertModel that fastbert does not implement: named, never ignored.
]


@pytest.mark.parametrize("kwargs, error, message", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS])
def test_bad_input_raises_before_any_kernel(model, no_kernels, kwargs, error, message):
    with pytest.raises(error, match=message):
        with torch.no_grad():
            model(**kwargs)


@pytest.mark.parametrize("with_mask", [False, True])
def test_empty_batch(model, with_mask):
    """B = 0: empty outputs of the right shapes (as HF gives)."""
    mask = torch.ones(0, S, dtype=torch.long) if with_mask else None
    with torch.no_grad():
        out = model(ids(0, S), attention_mask=mask, output_hidden_states=True)
    hidden = model.config.hidden_size
    assert out.last_hidden_state.shape == (0, S, hidden)
    assert out.pooler_output.shape == (0, hidden)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (0, S, hidden) for h in out.hidden_states)


def test_range_checks_off_clamps(model, input_checks_off):
    """With checks off an out-of-range index never crashes or reads out of bounds: it is clamped into its table."""
    bad = ids(B, S)
    bad[0, 1], bad[1, 2] = 1000, -5
    token_types = torch.zeros(B, S, dtype=torch.long)
    token_types[1, 0] = 7
    positions = torch.arange(S)[None].clone()
    positions[0, -1] = 500
    with torch.no_grad():
        out = model(bad, attention_mask=torch.ones(B, S), token_type_ids=token_types, position_ids=positions)
        clamped = model(bad.clamp(0, 98), token_type_ids=token_types.clamp(0, 1), position_ids=positions.clamp(0, 63))
    assert torch.isfinite(out.last_hidden_state).all()
    torch.testing.assert_close(out.last_hidden_state, clamped.last_hidden_state, rtol=0, atol=1e-6)


def test_range_checks_back_on(model):
    """The input_checks_off fixture restored the checks (and they are on by default)."""
    assert fastbert.validation.input_checks_enabled()
    with pytest.raises(ValueError, match="input_ids out of range"):
        model(ids(B, S).index_fill(1, torch.tensor([0]), 99))


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_inputs_embeds_matches_hf(bert_trio, assert_matches_hf, unpad):
    trio = bert_trio(unpad=unpad)
    input_ids = ids(3, 9)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, :2] = 0
    embeds = torch.randn(3, 9, trio.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = trio.fast(inputs_embeds=embeds, attention_mask=mask)
        out_hf = trio.hf(inputs_embeds=embeds, attention_mask=mask)
        out_ref = trio.ref(inputs_embeds=embeds.double(), attention_mask=mask)
        # The word embeddings passed as inputs_embeds: HF's outputs for the ids.
        by_embeds = trio.fast(inputs_embeds=trio.fast.embeddings.word_embeddings(input_ids), attention_mask=mask)
        by_ids_hf, by_ids_ref = trio.hf(input_ids, attention_mask=mask), trio.ref(input_ids, attention_mask=mask)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)
    assert_matches_hf(by_embeds.last_hidden_state, by_ids_hf.last_hidden_state, by_ids_ref.last_hidden_state, mask)


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_all_padding_row_does_not_disturb_others(model, unpad):
    """A fully padded row: finite outputs everywhere, and the other rows as when computed without it.

    Exactly so on the packed path, whose per-token GEMMs see the same rows either way; up to fp32 rounding where a
    GEMM has one more row (the pooler, the dense path), which may change its blocking.
    """
    model.unpad = unpad
    input_ids = ids(3, S)
    mask = torch.ones(3, S, dtype=torch.long)
    mask[0, 4:] = 0
    mask[1] = 0
    with torch.no_grad():
        out = model(input_ids, attention_mask=mask)
        alone = model(input_ids[[0, 2]], attention_mask=mask[[0, 2]])
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    real = mask[[0, 2]].bool()
    atol = 0 if unpad else 1e-6
    torch.testing.assert_close(out.last_hidden_state[[0, 2]][real], alone.last_hidden_state[real], rtol=0, atol=atol)
    torch.testing.assert_close(out.pooler_output[[0, 2]], alone.pooler_output, rtol=0, atol=1e-6)


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_every_row_padded(model, unpad):
    """A batch with no real token at all (zero packed tokens): finite outputs; zeros on the packed path."""
    model.unpad = unpad
    with torch.no_grad():
        out = model(ids(3, S), attention_mask=torch.zeros(3, S, dtype=torch.long), output_hidden_states=True)
    assert out.last_hidden_state.shape == (3, S, model.config.hidden_size)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    if unpad:
        assert (out.last_hidden_state == 0).all()


@pytest.mark.parametrize("native", [False, True], ids=["op-by-op", "native"])
@pytest.mark.parametrize("checks", [True, False], ids=["checks-on", "checks-off"])
@pytest.mark.parametrize("case", ["padded", "no-padding", "no-mask"])
def test_one_host_read_per_forward(model, read_backs, case, checks, native, monkeypatch):
    """Op by op, as inputs on a GPU run, a padded forward reads the data back once (range check and sequence lengths
    in one transfer); with the checks off, only the lengths, and a forward without a mask reads nothing. The native
    pass (inputs on the host) reads nothing back but the lengths it counted, where the mask has padding."""
    monkeypatch.setattr(fastbert.validation, "_checks_enabled", checks)
    if not native:
        monkeypatch.setattr(fastbert.inputs, "_native", lambda *integer_inputs: False)
    input_ids = ids(3, 7)
    mask = torch.ones(3, 7, dtype=torch.long)
    if case == "padded":
        mask[1, 4:] = 0
    with torch.inference_mode():
        model(input_ids, attention_mask=None if case == "no-mask" else mask)  # (first-time decisions read too)
        read_backs.clear()
        model(input_ids, attention_mask=None if case == "no-mask" else mask)
    if native:
        expected = 1 if case == "padded" else 0
    else:
        expected = 0 if (case == "no-mask" and not checks) else 1
    assert len(read_backs) == expected, read_backs


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_host_inputs_read_no_device_data(model, read_backs, unpad):
    """Integer inputs on the CPU with the model elsewhere (here the meta device, whose data cannot be read at all):
    the checks and the packed layout are computed on the host, and no device data is read."""
    model.unpad = unpad
    model.to("meta")
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.inference_mode():
        out = model(ids(3, 7), attention_mask=mask, token_type_ids=torch.ones(3, 7, dtype=torch.long))
        with pytest.raises(ValueError, match=r"input_ids out of range.*vocab_size=99"):
            model(ids(3, 7).index_fill(1, torch.tensor([2]), 99), attention_mask=mask)
    assert out.last_hidden_state.device.type == "meta" and out.last_hidden_state.shape == (3, 7, 64)
    assert read_backs and all(read.endswith(" on cpu") for read in read_backs), read_backs


def test_host_inputs_all_on_the_host(model):
    model.to("meta")
    with pytest.raises(ValueError, match="input_ids is on the CPU but attention_mask is on meta"):
        model(ids(B, S), attention_mask=torch.ones(B, S, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="inputs_embeds is on cpu but the model's weights are on meta"):
        model(inputs_embeds=torch.zeros(B, S, 64), attention_mask=torch.ones(B, S, dtype=torch.long))


def test_graph_safe_forward_reads_no_device_data(small_bert_config):
    """The forward a CUDA graph captures reads no device data, even with the input checks on: it runs on CUDA fake
    tensors, where any read raises. (The normal padded forward does read, once: the same harness catches it.)"""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    assert fastbert.validation.input_checks_enabled()
    # No pooler: HF's indexes hidden_states[:, 0], which fake CUDA tensors cannot do without a GPU.
    model = fastbert.BertModel(small_bert_config(), add_pooling_layer=False).eval()
    with FakeTensorMode(allow_non_fake_inputs=True), torch.inference_mode():
        model.to_empty(device="cuda")
        input_ids = torch.zeros(3, 7, dtype=torch.long, device="cuda")
        mask = torch.ones(3, 7, dtype=torch.long, device="cuda")
        out = model._forward((input_ids, mask), {}, graph_safe=True)
        assert out.last_hidden_state.shape == (3, 7, 64) and out.last_hidden_state.device.type == "cuda"
        with pytest.raises(DataDependentOutputException):
            model(input_ids, attention_mask=mask)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_safe_forward_matches(model, backend, fastbert_env):
    """The graph-safe forward (dense with the mask, no checks) gives the normal forward's outputs on real tokens."""
    if backend == "triton":
        pytest.importorskip("triton")
        fastbert_env(FASTBERT_BACKEND="triton", TRITON_INTERPRET="1")
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2] = 0
    with torch.inference_mode():
        expected = model(ids(3, 7), attention_mask=mask)
        out = model._forward((ids(3, 7), mask), {}, graph_safe=True)
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], expected.last_hidden_state[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.pooler_output[:2], expected.pooler_output[:2], rtol=0, atol=1e-5)
