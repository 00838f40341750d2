"""The LayerNorm that writes the u8 of its output for the int8 GEMM reading it (``ops/norm.py``'s cpu-ext backend,
csrc/layer_norm_cpu.h, ``int8_handoff.py``): the kernel against a float64 LayerNorm and its u8 against the static
quantizer's bytes (odd widths, rows of one token, no weight or bias, SmoothQuant divisors); in a quantized model, the
handoff taken from the second forward on, the same outputs as without it, and nothing handed to a consumer that
changed. Int8 forced on (``FASTBERT_CPU_INT8=on``)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers

import fastbert
from fastbert import guard, int8, int8_handoff, int8_linear
from fastbert.ops import norm

FP32_TOL = 1e-5  # a LayerNorm of values of order 1..10 in float32 against float64


@pytest.fixture
def kernel():
    if norm.layer_norm_cpu_unavailable_reasons():
        pytest.skip("; ".join(norm.layer_norm_cpu_unavailable_reasons()))


@pytest.mark.parametrize("rows, cols", [(0, 768), (1, 1), (1, 312), (7, 17), (300, 384), (33, 768), (5, 1030)])
@pytest.mark.parametrize("affine", ["weight and bias", "weight", "none"])
def test_layer_norm_against_float64_and_its_u8_against_the_quantizer(kernel, rows, cols, affine):
    generator = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=generator) * 3 + 1.5
    weight = torch.randn(cols, generator=generator) if affine != "none" else None
    bias = torch.randn(cols, generator=generator) if affine == "weight and bias" else None
    expected = F.layer_norm(x.double(), (cols,), None if weight is None else weight.double(),
                            None if bias is None else bias.double(), 1e-12)
    y, q = norm.layer_norm_cpu(x, weight, bias, 1e-12)
    assert q is None
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=FP32_TOL)
    divisor = torch.rand(cols, generator=generator) + 0.5
    for target in (int8_handoff.Target(0.03, 128, None), int8_handoff.Target(8 / 255, 17, divisor)):
        y_again, q = norm.layer_norm_cpu(x, weight, bias, 1e-12, target)
        assert torch.equal(y_again, y)  # (writing the u8 changes nothing else)
        assert torch.equal(q, int8_linear.quantize_static_ref(y, *target))  # the consumer's own bytes of y
        levels = int8_linear.quantize_static_ref(expected.float(), *target).int() - q.int()
        assert levels.abs().max().item() <= 1 if rows else True  # (a level at most from float64's, at ties)


def test_bad_arguments_are_named(kernel):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="x must be"):
        norm.layer_norm_cpu(x.double(), None, None, 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        norm.layer_norm_cpu(x, torch.ones(7), None, 1e-5)
    with pytest.raises(ValueError, match="smooth must be"):
        norm.layer_norm_cpu(x, None, None, 1e-5, int8_handoff.Target(0.1, 0, torch.ones(9)))
    with pytest.raises(ValueError, match="scale"):
        norm.layer_norm_cpu(x, None, None, 1e-5, int8_handoff.Target(0.0, 0, None))


def _static_model(hidden: int = 312, layers: int = 2) -> tuple[torch.nn.Module, torch.Tensor]:
    """A fastbert BERT (head dim 26) with every Linear int8 and static scales calibrated on its own forward."""
    config = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=12,
                                     intermediate_size=600, vocab_size=100)
    torch.manual_seed(0)
    model = fastbert.BertModel(config).eval()
    ids = torch.randint(1, 100, (3, 21))
    chosen = guard.layers_of(model)
    guard.choose(chosen, int8.weight_bits(), guard.RECIPES[0])
    with int8.recording() as ranges, torch.inference_mode():
        model(ids)
    guard.choose(chosen, int8.weight_bits(), guard.RECIPES[0],
                 static={m: int8.static_qparams(*ranges[m], None) for layer in chosen for m in layer.linears})
    return model, ids


@pytest.fixture
def handoffs(monkeypatch):
    """How many GEMM inputs were handed over already quantized, per forward."""
    taken = []
    take = int8_handoff.take

    def counting(*args):
        q = take(*args)
        taken.append(q is not None)
        return q

    monkeypatch.setattr(int8_handoff, "take", counting)
    return taken


def _forward(model, ids):
    with torch.inference_mode():
        return model(ids).last_hidden_state


def test_quantized_layers_take_the_layer_norms_u8_from_the_second_forward(int8_on, kernel, handoffs, monkeypatch):
    """Per layer the QKV and FFN-in GEMMs read a LayerNorm's output (but layer 0's QKV, after the embedding): from
    the second forward on each takes its u8, and the outputs are those of the GEMMs quantizing it themselves."""
    model, ids = _static_model()
    first = _forward(model, ids)
    assert not any(handoffs)
    handoffs.clear()
    second = _forward(model, ids)
    assert sum(handoffs) == 3, handoffs  # layer 0's FFN in, layer 1's QKV and FFN in
    assert torch.equal(first, second)
    assert _layer_norm_backends(model) == {"cpu-ext"}
    monkeypatch.setattr(int8_handoff, "target", lambda producer: None)
    assert torch.equal(_forward(model, ids), second)


def test_a_consumer_that_changed_gets_its_own_quantization(int8_on, kernel, handoffs):
    """Other static scales on a consumer: its first forward quantizes the LayerNorm's output itself (the handed u8
    was made with the old ones) and the producer learns the new ones; a consumer made float32: the producer stops
    writing u8 after one untaken offer. The outputs are those of a model quantized so from the start."""
    model, ids = _static_model()
    _forward(model, ids), _forward(model, ids)
    ffn_in = model.encoder.layer[0].intermediate.dense
    producer = model.encoder.layer[0].attention.output.LayerNorm
    choice = int8.chosen(ffn_in)
    scale, zero_point = choice.static
    int8.choose(ffn_in, int8.Choice(choice.bits, choice.smooth, static=(scale * 1.5, zero_point)))
    changed = _forward(model, ids)
    assert int8_handoff._targets[producer].scale == scale * 1.5
    assert torch.equal(_forward(model, ids), changed)
    int8.choose(ffn_in, None)
    float32_ffn = _forward(model, ids)
    _forward(model, ids)
    assert producer not in int8_handoff._targets
    assert torch.equal(_forward(model, ids), float32_ffn)


def test_float32_models_keep_torchs_layer_norm(kernel):
    """The C++ LayerNorm runs where the GEMM before it is int8 (by design: no warning elsewhere)."""
    model = fastbert.BertModel(transformers.BertConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                                                       intermediate_size=64, vocab_size=50)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _forward(model, torch.randint(1, 50, (2, 5)))
    assert _layer_norm_backends(model) == {"torch"}


def _layer_norm_backends(model) -> set[str]:
    """The backends the last forward's plan chose for the post-norm LayerNorms."""
    decisions = model.__dict__["_fastbert_plan"].decisions
    return {decision.backend.name for (_, op), decision in decisions.items() if op == "dense_residual_layer_norm"}
