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
from test_int8 import libraries_here

import fastbert
from fastbert import plan
from fastbert.int8 import choices as int8, guard
from fastbert.int8 import handoff as int8_handoff
from fastbert.int8 import linear as int8_linear
from fastbert.ops import norm

FP32_TOL = 1e-5  # a LayerNorm of values of order 1..10 in float32 against float64


@pytest.fixture
def kernel():
    if norm.layer_norm_cpu_unavailable_reasons():
        pytest.skip("; ".join(norm.layer_norm_cpu_unavailable_reasons()))


@pytest.mark.parametrize("rows, cols", [(0, 768), (1, 1), (1, 312), (7, 17), (300, 384), (33, 768), (5, 1030)])
@pytest.mark.parametrize("affine", ["weight and bias", "weight", "none"])
@pytest.mark.parametrize("isa", ["", "avx2"], ids=["fastest", "avx2"])
def test_layer_norm_against_float64_and_its_u8_against_the_quantizer(kernel, rows, cols, affine, isa):
    generator = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=generator) * 3 + 1.5
    weight = torch.randn(cols, generator=generator) if affine != "none" else None
    bias = torch.randn(cols, generator=generator) if affine == "weight and bias" else None
    expected = F.layer_norm(x.double(), (cols,), None if weight is None else weight.double(),
                            None if bias is None else bias.double(), 1e-12)
    y, q = norm.layer_norm_cpu(x, weight, bias, 1e-12, isa=isa)
    assert q is None
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=FP32_TOL)
    divisor = torch.rand(cols, generator=generator) + 0.5
    for target in (int8_handoff.Target(0.03, 128, None), int8_handoff.Target(8 / 255, 17, divisor)):
        y_again, q = norm.layer_norm_cpu(x, weight, bias, 1e-12, target, isa)
        assert torch.equal(y_again, y)  # (writing the u8 changes nothing else)
        assert torch.equal(q, int8_linear.quantize_static_ref(y, *target))  # the consumer's own bytes of y
        levels = int8_linear.quantize_static_ref(expected.float(), *target).int() - q.int()
        assert levels.abs().max().item() <= 1 if rows else True  # (a level at most from float64's, at ties)
    in_place = x.clone()
    y_in_place, q = norm.layer_norm_cpu(in_place, weight, bias, 1e-12, target, isa, out=in_place)
    assert y_in_place is in_place and torch.equal(in_place, y)  # (each row read whole before it is written)
    assert torch.equal(q, int8_linear.quantize_static_ref(y, *target))


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
    for out in (torch.empty(4, 7), torch.empty(4, 8, dtype=torch.float64), torch.empty(8, 4).t()):
        with pytest.raises(ValueError, match="out must be"):
            norm.layer_norm_cpu(x, None, None, 1e-5, out=out)


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


def test_layer_norms_write_over_their_gemms_outputs_only(int8_on, kernel, monkeypatch):
    """The LayerNorm after a GEMM writes its result over that GEMM's output (a temporary of its own): every hidden
    state a forward returns, the layers' inputs included, is bit for bit what LayerNorms writing new tensors give,
    and keeps its values while later layers run."""
    model, ids = _static_model(layers=3)
    _forward(model, ids)
    overwritten = []
    handing_off = norm.handing_off

    def watching(layer_norm, x):
        y = handing_off(layer_norm, x)
        overwritten.append(y is x)
        return y

    monkeypatch.setattr(norm, "handing_off", watching)
    with torch.inference_mode():
        states = model(ids, output_hidden_states=True).hidden_states
    assert overwritten and all(overwritten), overwritten
    snapshots = [state.clone() for state in states]

    def new_tensor(layer_norm, x):
        target = int8_handoff.target(layer_norm)
        y, q = norm.layer_norm_cpu(x, layer_norm.weight, layer_norm.bias, norm.ln_eps(layer_norm), target)
        int8_handoff.offer(layer_norm, y, q, target)
        return y

    monkeypatch.setattr(norm, "handing_off", new_tensor)
    with torch.inference_mode():
        expected = model(ids, output_hidden_states=True).hidden_states
    assert len({state.data_ptr() for state in states}) == len(states)
    for state, snapshot, reference in zip(states, snapshots, expected):
        assert torch.equal(state, snapshot) and torch.equal(state, reference)
    assert _layer_norm_backends(model) == {"cpu-ext"}


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
    int8.choose(ffn_in, choice)  # and back: the producer is taught again, and every handoff resumes
    _forward(model, ids)
    handoffs.clear()
    _forward(model, ids)
    assert sum(handoffs) == 3, handoffs


def test_hooked_dropouts_run(int8_on, kernel):
    """A hook on a layer's dropout is called in a quantized model as in a float32 one (the fused LayerNorm and MLP
    step aside for it)."""
    model, ids = _static_model()
    before = _forward(model, ids)
    calls = []
    for dropout in (model.encoder.layer[0].attention.output.dropout, model.encoder.layer[0].output.dropout):
        dropout.register_forward_hook(lambda module, args, out: calls.append(module) or out * 0)
    after = _forward(model, ids)
    assert len(calls) == 2 and not torch.allclose(after, before)


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


# --- the MLP's first GEMM writing the second one's u8 (ops/mlp.py) ---------------------------------------------------


@pytest.mark.parametrize("tokens, d_in, d_out", [(1, 3, 5), (7, 312, 600), (130, 64, 3072)])
@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
@pytest.mark.parametrize("first_scale", ["per-call", "static"])
@pytest.mark.parametrize("library", ["native", "onednn"])
def test_u8_output_matches_the_reference(int8_on, tokens, d_in, d_out, activation, first_scale, library):
    """The first GEMM's u8 result against float64's (a level apart at most, where float32's rounding of the
    activation crosses a tie, and rarely); the second GEMM reading that u8 computes what it computes on the float32
    activations its own static quantization would give those bytes."""
    generator = torch.Generator().manual_seed(tokens + d_out)
    x = torch.randn(tokens, d_in, generator=generator)
    weight = torch.randn(d_out, d_in, generator=generator) * d_in ** -0.5
    bias = 0.1 * torch.randn(d_out, generator=generator)
    static = int8_linear.qparams(*(float(v) for v in torch.aminmax(x))) if first_scale == "static" else None
    output = (0.7 / 255, 40)  # (a range that saturates some large activations)
    bits = int8.weight_bits()
    if library not in libraries_here(bits):
        pytest.skip(f"no {library} int8 GEMM for {bits}-bit weights here")
    ref = int8_linear.linear_ref(x, weight, bias, bits, activation, static=static, output=output)
    first = int8_linear.quantize_weight(weight, bits, library=library)
    with torch.inference_mode():
        q = int8_linear.linear(x, first, bias, activation, static=static, output=output)
        y = int8_linear.linear(x, first, bias, activation, static=static)
    assert q.dtype == torch.uint8 and q.shape == (tokens, d_out)
    if library == "native":  # (its epilogue quantizes as the static quantizer does: the bytes of its float32 result)
        assert torch.equal(q, int8_linear.quantize_static_ref(y, *output))
    apart = (q.int() - ref.int()).abs()
    assert apart.max().item() <= 1 and (apart > 0).sum().item() <= max(1, apart.numel() // 1000)
    second = torch.randn(11, d_out, generator=generator) * d_out ** -0.5
    packed = int8_linear.quantize_weight(second, bits)
    dequantized = (q.float() - output[1]) * output[0]  # float32 activations quantizing to exactly q
    with torch.inference_mode():
        from_u8 = int8_linear.linear(q, packed, None, static=output)
        from_float = int8_linear.linear(dequantized, packed, None, static=output)
    assert torch.equal(int8_linear.quantize_static_ref(dequantized, *output), q)
    assert torch.equal(from_u8, from_float)


def test_u8_arguments_are_checked(int8_on):
    packed = int8_linear.quantize_weight(torch.randn(4, 8), int8.weight_bits())
    q = torch.zeros(3, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="already quantized"):
        int8_linear.linear(q, packed, None)
    with pytest.raises(ValueError, match="no residual"):
        int8_linear.linear(torch.randn(3, 8), packed, None, residual=torch.randn(3, 4), output=(0.1, 0))
    with pytest.raises(ValueError, match="static scale"):
        int8_linear.linear(torch.randn(3, 8), packed, None, output=(0.0, 0))


def _mlp_backends(model) -> set[str]:
    decisions = model.__dict__["_fastbert_plan"].decisions
    return {decision.backend.name for (_, op), decision in decisions.items() if op == "mlp"}


def test_quantized_mlps_hand_u8_between_their_gemms(int8_on, kernel, monkeypatch):
    """With static scales the MLP runs as one op, its activations as u8; the outputs are the composed ops' up to
    those rare one-level differences. While the guard records the GEMM inputs' ranges, the composed ops run (the
    second GEMM's float32 input is recorded); a per-call second input keeps the composed ops."""
    model, ids = _static_model()
    fused = _forward(model, ids)
    assert _mlp_backends(model) == {"int8"}
    from fastbert.ops import mlp

    monkeypatch.setattr(mlp, "BACKENDS", mlp.BACKENDS[1:])
    plan.converted()  # (the plan holds the int8 decision)
    composed = _forward(model, ids)
    assert _mlp_backends(model) == {"torch"}
    monkeypatch.undo()
    plan.converted()
    cosine = F.cosine_similarity(fused.flatten(0, 1), composed.flatten(0, 1), dim=-1)
    assert cosine.min().item() > 0.9999 and not torch.equal(fused, torch.zeros_like(fused))
    with int8.recording() as ranges, torch.inference_mode():
        model(ids)
    assert model.encoder.layer[1].output.dense in ranges
    dense_out = model.encoder.layer[0].output.dense
    choice = int8.chosen(dense_out)
    int8.choose(dense_out, int8.Choice(choice.bits, choice.smooth))
    _forward(model, ids)
    assert _mlp_backends(model) == {"int8", "torch"}
