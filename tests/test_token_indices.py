"""``token_indices``: the native pass over host inputs gives what ``inputs.prepare`` / ``prepare_packed`` give op by
op (the reference, and what inputs on a GPU run): the same [3, rows] indices, layout and range errors, for every
family's numbering, every kind of mask (none, all real, right and left padding, holes, rows without a real token),
every integer dtype tokenizers and users pass, given positions and token types, spare rows, and the checks off."""

import dataclasses

import pytest
import torch
from test_families import FAMILIES, FAMILY_IDS, _pad_id, max_len

import fastbert
from fastbert import _extension, inputs, token_indices

pytestmark = pytest.mark.skipif(bool(token_indices.unavailable_reasons()), reason=str(
    token_indices.unavailable_reasons()))

MASKS = {
    "none": None,
    "all-real": lambda b, s: torch.ones(b, s, dtype=torch.long),
    "right": lambda b, s: (torch.arange(s)[None] < torch.tensor([s, 1, s - 3, 2])[:b, None]).long(),
    "left": lambda b, s: (torch.arange(s)[None] >= torch.tensor([0, 2, s - 1, 3])[:b, None]).long(),
    "holes": lambda b, s: (torch.arange(b * s).view(b, s) % 3 != 1).long(),
    "empty-row": lambda b, s: torch.ones(b, s, dtype=torch.long).index_fill(0, torch.tensor([1]), 0),
}


def _model(family: str, small_bert_config):
    if family == "bert":
        return fastbert.BertModel(small_bert_config()).eval()
    return FAMILIES[family].fast(FAMILIES[family].config).eval()


def _both(model, call):
    """call() natively and op by op -> (native, reference)."""
    native = call()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inputs, "_native", lambda *integer_inputs: False)
        return native, call()


def _assert_same(native, reference):
    (indices, layout), (ref_indices, ref_layout) = native, reference
    assert torch.equal(indices, ref_indices) and indices.dtype == torch.long
    for field in dataclasses.fields(layout):
        value, expected = getattr(layout, field.name), getattr(ref_layout, field.name)
        if isinstance(expected, torch.Tensor):
            assert isinstance(value, torch.Tensor) and value.dtype == expected.dtype, field.name
            assert torch.equal(value, expected), field.name
        else:
            assert value == expected, field.name


def _ids(config, batch, seq_len, pad_inside=True):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
    if pad_inside:  # (RoBERTa numbers from the ids: a pad id among real tokens gets padding_idx)
        ids[:, 1] = _pad_id(config)
    return ids


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("family", ["bert", *FAMILY_IDS])
def test_padded_batches_as_op_by_op(family, mask_kind, small_bert_config):
    model = _model(family, small_bert_config)
    batch, seq_len = 4, min(11, max_len(model.config))
    mask = None if MASKS[mask_kind] is None else MASKS[mask_kind](batch, seq_len)
    given = dict.fromkeys(inputs.NAMES)
    given.update(input_ids=_ids(model.config, batch, seq_len), attention_mask=mask,
                 token_type_ids=torch.randint(0, max(getattr(model.config, "type_vocab_size", 1), 1), (batch, seq_len)))
    with torch.inference_mode():
        _assert_same(*_both(model, lambda: inputs.prepare(model, given)))


@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int32), (torch.int64, torch.bool), (torch.int32, torch.uint8),
                                    (torch.int64, torch.int32)], ids=lambda d: str(d).replace("torch.", ""))
def test_integer_dtypes_and_given_positions(dtypes):
    spec = FAMILIES["roberta"]
    model = spec.fast(spec.config).eval()
    ids_dtype, mask_dtype = dtypes
    mask = MASKS["left"](4, 9).to(mask_dtype)
    for positions in (None, torch.arange(2, 11)[None], torch.arange(36).view(4, 9) % 30):
        given = dict.fromkeys(inputs.NAMES)
        given.update(input_ids=_ids(spec.config, 4, 9).to(ids_dtype), attention_mask=mask,
                     position_ids=None if positions is None else positions.to(ids_dtype))
        with torch.inference_mode():
            _assert_same(*_both(model, lambda: inputs.prepare(model, given)))


def test_noncontiguous_inputs(small_bert_config):
    model = _model("bert", small_bert_config)
    wide = _ids(model.config, 4, 20)
    given = dict.fromkeys(inputs.NAMES)
    given.update(input_ids=wide[:, ::2], attention_mask=MASKS["holes"](4, 20)[:, ::2],
                 token_type_ids=torch.ones(10, 4, dtype=torch.long).t())
    with torch.inference_mode():
        _assert_same(*_both(model, lambda: inputs.prepare(model, given)))


@pytest.mark.parametrize("family", ["bert", *FAMILY_IDS])
def test_back_to_back_as_op_by_op(family, small_bert_config):
    model = _model(family, small_bert_config)
    seqlens = (5, 1, min(17, max_len(model.config)), 2)
    ids = _ids(model.config, 1, sum(seqlens))[0]
    types = torch.randint(0, max(getattr(model.config, "type_vocab_size", 1), 1), ids.shape)
    with torch.inference_mode():
        for given_types in (None, types, types.int()):
            _assert_same(*_both(model, lambda: inputs.prepare_packed(model, ids.int(), seqlens, given_types)))


def test_spare_rows_as_op_by_op(small_bert_config):
    """A model ``fastbert.quantize`` chose runs its rows bucketed: spare rows, zeros, as op by op."""
    model = fastbert.quantize(fastbert.BertModel(small_bert_config()).eval(), guard=False)
    given = dict.fromkeys(inputs.NAMES)
    given.update(input_ids=_ids(model.config, 4, 9), attention_mask=MASKS["right"](4, 9))
    with torch.inference_mode():
        native, reference = _both(model, lambda: inputs.prepare(model, given))
    assert native[1].spare_rows > 0
    _assert_same(native, reference)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_range_errors_as_op_by_op(family, small_bert_config):
    model = _model(family, small_bert_config)
    config = model.config
    longest = max_len(config)
    cases = [
        dict(input_ids=_ids(config, 2, 6).index_fill(1, torch.tensor([3]), config.vocab_size)),
        dict(input_ids=_ids(config, 2, 6).index_fill(1, torch.tensor([0]), -1)),
        dict(input_ids=_ids(config, 2, 6), token_type_ids=torch.full((2, 6), 7)),
        dict(input_ids=_ids(config, 2, 6), position_ids=torch.arange(6)[None] + longest),
    ]
    if family == "roberta":  # its numbering runs past the table with more real tokens than it holds
        cases.append(dict(input_ids=torch.full((1, longest + 2), 5)))
    for case in cases:
        given = dict.fromkeys(inputs.NAMES)
        given.update(case, attention_mask=torch.ones_like(case["input_ids"]).index_fill(1, torch.tensor([5]), 0))
        messages = []
        for native in (True, False):
            with pytest.MonkeyPatch.context() as patch, pytest.raises(ValueError, match="out of range") as error:
                if not native:
                    patch.setattr(inputs, "_native", lambda *integer_inputs: False)
                inputs.prepare(model, given)
            messages.append(str(error.value))
        assert messages[0] == messages[1]
    with pytest.raises(ValueError, match=r"input_ids out of range: values span \[5, 500\]"):
        inputs.prepare_packed(model, torch.tensor([5, 500]), (2,))


def test_dispatch_modes_run_op_by_op(small_bert_config):
    """Under a dispatch mode (fake tensors: no memory to read) the reference path runs, as under torch.compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _model("bert", small_bert_config)
    given = dict.fromkeys(inputs.NAMES)
    given.update(input_ids=_ids(model.config, 2, 4))
    with FakeTensorMode(allow_non_fake_inputs=True):
        indices, layout = inputs.prepare(model, given)
    assert indices.shape == (3, 8) and not layout.packed


def test_back_to_back_lengths_as_a_list(small_bert_config):
    model = _model("bert", small_bert_config)
    _, layout = inputs.prepare_packed(model, _ids(model.config, 1, 5)[0], [2, 3])
    assert layout.seqlens == (2, 3)


def test_checks_off_give_the_same_indices(input_checks_off, small_bert_config):
    model = _model("bert", small_bert_config)
    given = dict.fromkeys(inputs.NAMES)
    given.update(input_ids=_ids(model.config, 2, 6).index_fill(1, torch.tensor([3]), 500),
                 attention_mask=MASKS["right"](2, 6))
    _assert_same(*_both(model, lambda: inputs.prepare(model, given)))


def test_floating_masks_run_op_by_op(small_bert_config):
    """A float mask (transformers accepts one) is not an integer input the native pass reads: op by op runs it."""
    model = _model("bert", small_bert_config)
    ids, mask = _ids(model.config, 4, 9), MASKS["right"](4, 9)
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask.float()).last_hidden_state, expected)


@pytest.mark.parametrize("call, message", [
    (lambda out: _extension._C.token_indices(0, 0, 0, 0, 0, 0, 1, 0, 0, [], 2, 3, 0, 0, 6, out.data_ptr(), 4, 0, 0),
     "rows >= tokens"),
    (lambda out: _extension._C.token_indices(0, 5, 0, 0, 0, 0, 1, 0, 0, [], 0, 0, 0, 0, 0, out.data_ptr(), 4, 0, 0),
     "dtype code"),
    (lambda out: _extension._C.token_indices(0, 0, 0, 0, 0, 0, 1, 0, 0, [2, 2], 2, 2, 0, 0, 3, out.data_ptr(), 4, 0,
                                              0), "add up to tokens"),
    (lambda out: _extension._C.token_indices(0, 0, 0, 0, 0, 0, 1, 0, 0, [], 2, 3, 0, 0, 5, out.data_ptr(), 8, 0, 0),
     "every one of the batch"),
    (lambda out: _extension._C.token_indices(0, 0, 0, 0, 0, 0, 1, 0, 0, [], 2, 3, 2, 0, 6, out.data_ptr(), 8, 0, 0),
     "numbering"),
])
def test_native_arguments_are_checked(call, message):
    """The raw-pointer API's last line of defence: sizes or codes that would read or write outside a buffer raise."""
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(3, 8, dtype=torch.long))
