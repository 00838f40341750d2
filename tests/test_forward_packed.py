"""``FusedModel.forward_packed``: sequences back to back as token ids, no padding anywhere (what ``fastbert serve``
runs), for every family: the same hidden states as the model on the padded batch (its real tokens), with token
types too; ``sentence.pool_packed`` the same sentence embeddings as ``sentence.pool`` on it, for every pooling mode;
and each family's sequence-classification head on the packed rows (``serve.heads``) the logits of transformers'
model on the padded batch."""

import copy
import inspect

import pytest
import torch
import transformers
from conftest import _randomize_
from test_families import FAMILIES, FAMILY_IDS, _pad_id, max_len

import fastbert
from fastbert.serve import heads
from fastbert.sentence import POOLING_MODES, pool, pool_packed


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_forward_packed_equals_the_padded_forward(family):
    spec = FAMILIES[family]
    torch.manual_seed(0)
    model = spec.fast(spec.config).eval()
    longest = max_len(spec.config)  # (the longest the position table allows)
    lengths = [5, 1, 17, longest, 2]
    generator = torch.Generator().manual_seed(1)
    pad = _pad_id(spec.config)
    ids = torch.randint(3, spec.config.vocab_size, (len(lengths), longest), generator=generator)
    ids[ids == pad] = pad + 1
    mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad)
    with torch.inference_mode():
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state
        packed = model.forward_packed(ids[mask.bool()], lengths)
    torch.testing.assert_close(packed, padded[mask.bool()], rtol=1e-5, atol=1e-5)
    pooled = pool_packed(packed, torch.tensor(lengths), POOLING_MODES)
    torch.testing.assert_close(pooled, pool(padded, mask, POOLING_MODES), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_pool_packed_equals_pool_per_sequence(dtype):
    """Every pooling mode of back-to-back rows (on the CPU each sequence reduced on its own) equals ``pool`` of the
    padded batch, one sequence or many, 16-bit accumulated in float32 as ``pool`` does."""
    generator = torch.Generator().manual_seed(0)
    for lengths in ([7], [3, 1, 9, 2]):
        mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
        padded = torch.randn(len(lengths), max(lengths), 26, generator=generator).to(dtype)
        packed = pool_packed(padded[mask.bool()], torch.tensor(lengths), POOLING_MODES)
        assert packed.dtype == dtype and packed.shape == (len(lengths), 26 * len(POOLING_MODES))
        torch.testing.assert_close(packed, pool(padded, mask, POOLING_MODES))
    empty = pool_packed(torch.zeros(0, 26, dtype=dtype), torch.zeros(0, dtype=torch.long), POOLING_MODES)
    assert empty.shape == (0, 26 * len(POOLING_MODES))


def test_bad_packed_inputs_name_themselves():
    spec = FAMILIES["roberta"]
    model = spec.fast(spec.config).eval()
    with pytest.raises(ValueError, match="seqlens must be >= 1 each and add up to the 4 ids"):
        model.forward_packed(torch.tensor([5, 6, 7, 8]), [2, 3])
    with pytest.raises(ValueError, match="input_ids must be a 1-D"):
        model.forward_packed(torch.tensor([[5, 6]]), [2])
    with pytest.raises(ValueError, match=r"input_ids out of range: values span \[5, 500\]"):
        model.forward_packed(torch.tensor([5, 500]), [2])
    with pytest.raises(ValueError, match="positions .*numbered within each sequence.* out of range"):
        model.forward_packed(torch.full((60,), 5), [60])


def _pairs(config, lengths: list[int], seed: int = 1):
    """Padded (ids, mask, token types) of ``lengths`` sequences as a pair tokenizer makes them: the pad id after each
    sequence, type 1 on the second half of each where the family has two token types, else 0."""
    longest = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    pad = _pad_id(config)
    ids = torch.randint(3, config.vocab_size, (len(lengths), longest), generator=generator)
    ids[ids == pad] = pad + 1
    mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).long()
    second = torch.arange(longest)[None] >= (torch.tensor(lengths)[:, None] + 1) // 2
    types = (second & mask.bool()).long() if getattr(config, "type_vocab_size", 0) >= 2 else torch.zeros_like(ids)
    return ids.masked_fill(mask == 0, pad), mask, types


def _types_argument(model, types) -> dict:
    """``token_type_ids=types`` where the model's forward takes them (DistilBERT's and ModernBERT's do not)."""
    return {"token_type_ids": types} if "token_type_ids" in inspect.signature(model.forward).parameters else {}


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_token_types_of_packed_sequences_equal_the_padded_forward(family):
    spec = FAMILIES[family]
    torch.manual_seed(0)
    model = spec.fast(spec.config).eval()
    lengths = [6, 1, max_len(spec.config), 3]
    ids, mask, types = _pairs(spec.config, lengths)
    with torch.inference_mode():
        padded = model(input_ids=ids, attention_mask=mask, **_types_argument(model, types)).last_hidden_state
        packed = model.forward_packed(ids[mask.bool()], lengths, types[mask.bool()])
    torch.testing.assert_close(packed, padded[mask.bool()], rtol=1e-5, atol=1e-5)


def _bert_config():
    return transformers.BertConfig(vocab_size=99, hidden_size=96, num_attention_heads=3, num_hidden_layers=2,
                                   intermediate_size=160, max_position_embeddings=40, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)


_HEAD_CONFIGS = {"bert": _bert_config(), **{name: spec.config for name, spec in FAMILIES.items()}}


@pytest.mark.parametrize("family", list(_HEAD_CONFIGS))
def test_each_sequence_classification_head_on_packed_rows_gives_transformers_logits(family):
    """Random weights everywhere (the head's biases and pooler too), 3 labels: ``heads.logits`` of forward_packed's
    rows equals transformers' own *ForSequenceClassification on the padded batch within float32 rounding."""
    config = copy.deepcopy(_HEAD_CONFIGS[family])
    config.num_labels = 3
    name = type(config).__name__.removesuffix("Config") + "ForSequenceClassification"
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config).eval()
    _randomize_(hf, 0)
    fast = fastbert.optimize(copy.deepcopy(hf))
    assert heads.why_not(fast) is None
    lengths = [7, 2, max_len(config), 4, 1]
    ids, mask, types = _pairs(config, lengths)
    with torch.inference_mode():
        expected = hf(input_ids=ids, attention_mask=mask, **_types_argument(hf, types)).logits
        hidden = fast.base_model.forward_packed(ids[mask.bool()], lengths, types[mask.bool()])
        got = heads.logits(fast, hidden, torch.tensor(lengths))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
