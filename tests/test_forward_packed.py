"""``FusedModel.forward_packed``: sequences back to back as token ids, no padding anywhere (what ``fastbert serve``
runs), for every family: the same hidden states as the model on the padded batch (its real tokens), and
``sentence.pool_packed`` the same sentence embeddings as ``sentence.pool`` on it, for every pooling mode."""

import pytest
import torch
from test_families import FAMILIES, FAMILY_IDS, _pad_id, max_len

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
