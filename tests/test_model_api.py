"""The drop-in contract: checkpoints both ways, optimize() on HF task models, torch.compile, training, dtypes,
fastbert.info and the FASTBERT_BACKEND override."""

import copy
import json
import pickle
import subprocess
import sys

import pytest
import torch
import transformers
from transformers.models.bert import modeling_bert as hf_bert

import fastbert
from fastbert import dispatch


def right_padded(config, batch: int = 4, seq_len: int = 10, seed: int = 0):
    """(input_ids, attention_mask): random ids in [1, vocab) (0 is the pad token), rows of decreasing length."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, config.vocab_size, (batch, seq_len), generator=generator)
    lengths = seq_len - torch.arange(batch) * (seq_len // batch)
    mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    return input_ids.masked_fill(mask == 0, config.pad_token_id), mask


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------


def test_state_dict_round_trip(bert_trio):
    trio = bert_trio()
    assert trio.fast.state_dict().keys() == trio.hf.state_dict().keys()
    input_ids, mask = right_padded(trio.config)

    hf = transformers.BertModel(trio.config).eval()  # HF -> fastbert -> HF
    assert hf.load_state_dict(trio.fast.state_dict(), strict=True)
    fast = fastbert.BertModel(trio.config).eval()
    assert fast.load_state_dict(hf.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(hf(input_ids, attention_mask=mask).last_hidden_state,
                           trio.hf(input_ids, attention_mask=mask).last_hidden_state)
        assert torch.equal(fast(input_ids, attention_mask=mask).last_hidden_state,
                           trio.fast(input_ids, attention_mask=mask).last_hidden_state)


def test_save_pretrained_both_ways(bert_trio, assert_matches_hf, tmp_path):
    trio = bert_trio()
    input_ids, mask = right_padded(trio.config)
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)

    trio.fast.save_pretrained(tmp_path / "fast")
    assert (tmp_path / "fast" / "model.safetensors").exists()
    hf = transformers.BertModel.from_pretrained(tmp_path / "fast").eval()
    trio.hf.save_pretrained(tmp_path / "hf")
    fast = fastbert.BertModel.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(fast, fastbert.BertModel) and type(hf) is transformers.BertModel
    with torch.no_grad():
        assert torch.equal(hf(input_ids, attention_mask=mask).last_hidden_state, out_hf.last_hidden_state)
        loaded = fast(input_ids, attention_mask=mask)
    assert torch.equal(loaded.last_hidden_state, out.last_hidden_state)
    assert_matches_hf(loaded.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)


class NotATensor:
    """A pickled object a weights_only load must refuse."""


def test_bin_checkpoint(bert_trio, tmp_path):
    """A torch.save'd ``pytorch_model.bin`` loads through HF's loader (weights_only), into fastbert and HF alike;
    one holding an arbitrary pickled object is refused."""
    trio = bert_trio()
    trio.hf.config.save_pretrained(tmp_path)
    torch.save(trio.hf.state_dict(), tmp_path / "pytorch_model.bin")
    try:
        hf = transformers.BertModel.from_pretrained(tmp_path)
    except (OSError, EnvironmentError) as error:
        if "safetensors" in str(error) or "pytorch_model.bin" in str(error):
            pytest.skip(f"transformers {transformers.__version__} no longer loads .bin checkpoints: {error}")
        raise
    fast = fastbert.BertModel.from_pretrained(tmp_path)
    for key, value in trio.hf.state_dict().items():
        assert torch.equal(fast.state_dict()[key], value) and torch.equal(hf.state_dict()[key], value), key

    torch.save({**trio.hf.state_dict(), "evil": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fastbert.BertModel.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# fastbert.optimize on HF models
# ---------------------------------------------------------------------------------------------------------------

# HF class -> the outputs to compare: (attribute, per-token?) — per-token outputs are compared on real tokens only.
TASK_MODELS = [
    pytest.param(transformers.BertModel, [("last_hidden_state", True), ("pooler_output", False)], id="BertModel"),
    pytest.param(transformers.BertForSequenceClassification, [("logits", False)], id="SequenceClassification"),
    pytest.param(transformers.BertForMaskedLM, [("logits", True)], id="MaskedLM"),
    pytest.param(transformers.BertForTokenClassification, [("logits", True)], id="TokenClassification"),
    pytest.param(transformers.BertForPreTraining, [("prediction_logits", True), ("seq_relationship_logits", False)],
                 id="PreTraining"),
]


@pytest.mark.parametrize("model_class, compared", TASK_MODELS)
def test_optimize_task_models(small_bert_config, assert_matches_hf, model_class, compared):
    config = small_bert_config(num_labels=3)
    torch.manual_seed(0)
    model = model_class(config).eval()
    reference = copy.deepcopy(model).double()
    input_ids, mask = right_padded(config)
    with torch.no_grad():
        before, ref = model(input_ids, attention_mask=mask), reference(input_ids, attention_mask=mask)
    parameters = [(name, p, p.data_ptr()) for name, p in model.named_parameters()]

    assert fastbert.optimize(model) is model
    assert [(name, p, p.data_ptr()) for name, p in model.named_parameters()] == parameters  # the same objects
    encoder = model if model_class is transformers.BertModel else model.bert
    assert isinstance(encoder, fastbert.BertModel)
    swapped = (hf_bert.BertModel, hf_bert.BertEmbeddings, hf_bert.BertLayer, hf_bert.BertSelfAttention,
               hf_bert.BertIntermediate, hf_bert.BertOutput)
    assert not any(type(m) in swapped for m in model.modules()), "an HF encoder module was left in place"
    if model_class in (transformers.BertForMaskedLM, transformers.BertForPreTraining):
        transform = model.cls.predictions.transform
        assert type(transform) is fastbert.models.bert.BertPredictionHeadTransform
        assert model.cls.predictions.decoder.weight is encoder.embeddings.word_embeddings.weight  # still tied

    with torch.no_grad():
        after = model(input_ids, attention_mask=mask)
    for name, per_token in compared:
        assert_matches_hf(getattr(after, name), getattr(before, name), getattr(ref, name),
                          mask if per_token else None, name=name)


def test_optimize_leaves_decoder_to_transformers(small_bert_config, recwarn):
    """A model with an encoder and a decoder: the encoder is accelerated, the decoder stays transformers' (said
    once), and a fastbert.BertModel built as a decoder runs transformers' forward with the same outputs."""
    encoder = transformers.BertModel(small_bert_config())
    decoder = transformers.BertModel(small_bert_config(is_decoder=True))
    model = torch.nn.ModuleList([encoder, decoder])
    fastbert.optimize(model)
    assert type(model[0]) is fastbert.BertModel
    assert type(model[1]) is hf_bert.BertModel
    assert not any(type(m).__module__.startswith("fastbert") for m in model[1].modules())

    config = small_bert_config(is_decoder=True)
    torch.manual_seed(0)
    hf = transformers.BertModel(config).eval()
    fast = fastbert.BertModel(config).eval()
    fast.load_state_dict(hf.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (2, 5))
    with torch.no_grad():
        out, out_hf = fast(input_ids, use_cache=True), hf(input_ids, use_cache=True)
    torch.testing.assert_close(out.last_hidden_state, out_hf.last_hidden_state, rtol=0, atol=0)
    assert out.past_key_values is not None
    assert any("is_decoder" in str(w.message) for w in recwarn.list) or "is_decoder" in str(
        fastbert.announce.seen())


# ---------------------------------------------------------------------------------------------------------------
# torch.compile, torch.library
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_mask", [False, True], ids=["dense", "padded"])
def test_torch_compile_fullgraph(bert_trio, assert_matches_hf, with_mask):
    """One graph (the range check is an opaque op); under compile a padding mask takes the dense masked path."""
    torch._dynamo.reset()
    trio = bert_trio(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1)
    input_ids, mask = right_padded(trio.config)
    mask = mask if with_mask else None
    compiled = torch.compile(trio.fast, fullgraph=True)
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)
    with torch.no_grad():
        out_compiled = compiled(input_ids, attention_mask=mask)
    for name in ("last_hidden_state", "pooler_output"):
        assert_matches_hf(getattr(out_compiled, name), getattr(out_hf, name), getattr(out_ref, name),
                          mask if name == "last_hidden_state" else None, name=name)
    torch.testing.assert_close(out_compiled.pooler_output, out.pooler_output, rtol=0, atol=1e-5)


def test_checked_indices_opcheck():
    generator = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 99, (3, 7), generator=generator), torch.randint(0, 2, (3, 7), generator=generator),
            torch.arange(7)[None].expand(3, 7), [99, 2, 64])
    torch.library.opcheck(torch.ops.fastbert.checked_indices.default, args)
    out = torch.ops.fastbert.checked_indices(*args)
    assert out.dtype == torch.int64 and out.shape == (3, 21)
    assert torch.equal(out, torch.stack([a.flatten() for a in args[:3]]))


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def loss_and_grads(model, input_ids, mask, weights):
    """A loss on real tokens and the pooler; returns (loss, {name: grad})."""
    model.zero_grad()
    out = model(input_ids, attention_mask=mask)
    hidden = out.last_hidden_state.flatten(0, 1) if mask is None else out.last_hidden_state[mask.bool()]
    loss = (hidden * weights[0].to(hidden.dtype)).sum() + (out.pooler_output * weights[1].to(hidden.dtype)).sum()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("unpad, with_mask", [(True, True), (False, True), (True, False)],
                         ids=["packed", "dense-masked", "no-mask"])
def test_gradients_match_hf(bert_trio, assert_matches_hf, unpad, with_mask):
    """Loss and every parameter's gradient: the 2x rule against HF in float64, and within 1e-4 of HF relative to
    the gradient's scale (the largest gradient of all: key biases have none in exact arithmetic, only noise)."""
    trio = bert_trio(unpad=unpad)
    for model in (trio.fast, trio.hf, trio.ref):
        model.train()  # dropout probabilities are 0: train mode is deterministic
    input_ids, mask = right_padded(trio.config)
    mask = mask if with_mask else None
    generator = torch.Generator().manual_seed(1)
    tokens = input_ids.numel() if mask is None else int(mask.sum())
    weights = (torch.randn(tokens, trio.config.hidden_size, generator=generator),
               torch.randn(input_ids.shape[0], trio.config.hidden_size, generator=generator))

    loss, grads = loss_and_grads(trio.fast, input_ids, mask, weights)
    loss_hf, grads_hf = loss_and_grads(trio.hf, input_ids, mask, weights)
    loss_ref, grads_ref = loss_and_grads(trio.ref, input_ids, mask, weights)
    assert_matches_hf(loss, loss_hf, loss_ref, name="loss")
    assert grads.keys() == grads_hf.keys()
    scale = max(g.abs().max().item() for g in grads_hf.values())
    for name, grad_hf in grads_hf.items():
        assert grads[name] is not None, name
        assert_matches_hf(grads[name], grad_hf, grads_ref[name], name=f"{name}.grad")
        assert (grads[name] - grad_hf).abs().max().item() <= 1e-4 * scale, name


def test_gradient_checkpointing_keeps_gradients(bert_trio):
    """HF's gradient_checkpointing_enable() recomputes each layer in backward: same loss and gradients as without."""
    trio = bert_trio()
    trio.fast.train()
    input_ids, mask = right_padded(trio.config)
    generator = torch.Generator().manual_seed(1)
    weights = (torch.randn(int(mask.sum()), trio.config.hidden_size, generator=generator),
               torch.randn(input_ids.shape[0], trio.config.hidden_size, generator=generator))
    loss, grads = loss_and_grads(trio.fast, input_ids, mask, weights)
    trio.fast.gradient_checkpointing_enable()
    # transformers 5 flags each layer (4.x the encoder)
    assert all(layer.gradient_checkpointing for layer in trio.fast.encoder.layer)
    trio.fast.zero_grad()
    loss_ckpt, grads_ckpt = loss_and_grads(trio.fast, input_ids, mask, weights)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_padding_idx_gets_no_gradient(bert_trio):
    """As nn.Embedding(padding_idx=pad_token_id) in HF: the pad token's row receives no gradient, even when the pad
    id appears among real tokens or no mask is given."""
    trio = bert_trio()
    trio.fast.train()
    input_ids, _ = right_padded(trio.config)
    input_ids[:, 2] = trio.config.pad_token_id
    trio.fast(input_ids).last_hidden_state.sum().backward()
    grad = trio.fast.embeddings.word_embeddings.weight.grad
    assert grad[input_ids[0, 0]].abs().sum() > 0
    assert (grad[trio.config.pad_token_id] == 0).all()


@pytest.mark.parametrize("unpad", [True, False], ids=["packed", "dense"])
def test_train_mode_dropout(small_bert_config, unpad):
    config = small_bert_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = fastbert.BertModel(config, unpad=unpad).train()
    input_ids, mask = right_padded(config)
    first = model(input_ids, attention_mask=mask)
    second = model(input_ids, attention_mask=mask)
    for out in (first, second):
        assert out.last_hidden_state.shape == (*input_ids.shape, config.hidden_size)
        assert out.pooler_output.shape == (input_ids.shape[0], config.hidden_size)
        assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    assert not torch.equal(first.last_hidden_state, second.last_hidden_state), "dropout is active in train mode"
    first.pooler_output.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
               and p is not model.embeddings.token_type_embeddings.weight)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids, attention_mask=mask).last_hidden_state,
                           model(input_ids, attention_mask=mask).last_hidden_state)


# ---------------------------------------------------------------------------------------------------------------
# dtypes and the derived QKV weight
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_conversion(bert_trio, assert_matches_hf, dtype):
    """``.to(dtype)`` after an fp32 forward: the fused QKV weight follows (it is derived, not cached stale)."""
    trio = bert_trio()
    input_ids, mask = right_padded(trio.config)
    trio.run(input_ids, attention_mask=mask)  # fp32 forward first
    trio.fast.to(dtype), trio.hf.to(dtype)
    assert all(p.dtype == dtype for p in trio.fast.parameters())
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)
    assert out.last_hidden_state.dtype == dtype
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)


@pytest.mark.parametrize("update", ["load_state_dict", "no_grad-in-place", "data-in-place", "data-assign"])
def test_weights_updated_after_forward(bert_trio, assert_matches_hf, update):
    """Weights changed after an inference forward (checkpoint reload, optimizer step, EMA via ``.data``) are used."""
    trio = bert_trio()
    input_ids, mask = right_padded(trio.config)
    trio.run(input_ids, attention_mask=mask)  # builds whatever fastbert caches
    for model in (trio.fast, trio.hf, trio.ref):
        value = model.encoder.layer[0].attention.self.value
        new = value.weight.detach().flip(0) * 2
        if update == "load_state_dict":
            model.load_state_dict({**model.state_dict(), "encoder.layer.0.attention.self.value.weight": new})
        elif update == "no_grad-in-place":
            with torch.no_grad():
                value.weight.copy_(new)
        elif update == "data-in-place":
            # Writes through .data bypass PyTorch's version counter: fastbert cannot see them (docs/usage.md) and is told.
            value.weight.data.copy_(new)
            fastbert.clear_caches(model)
        else:
            value.weight.data = new.clone()
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)


def test_frozen_encoder_input_gradients(bert_trio):
    """A frozen encoder (requires_grad False) after an inference_mode forward still gives gradients w.r.t.
    inputs_embeds (saliency, adversarial training)."""
    trio = bert_trio()
    trio.fast.requires_grad_(False), trio.hf.requires_grad_(False)
    input_ids, mask = right_padded(trio.config)
    with torch.inference_mode():
        trio.fast(input_ids, attention_mask=mask)
    grads = []
    for model in (trio.fast, trio.hf):
        embeds = model.embeddings.word_embeddings(input_ids).detach().requires_grad_(True)
        out = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        out[mask.bool()].sum().backward()
        grads.append(embeds.grad[mask.bool()])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# fastbert.info and FASTBERT_BACKEND
# ---------------------------------------------------------------------------------------------------------------

INFO_KEYS = {"ext_cpu", "ext_cuda", "cuda_archs", "backends", "reasons", "versions"}


def test_info():
    info = fastbert.info()
    assert INFO_KEYS <= info.keys(), f"missing: {INFO_KEYS - info.keys()}"
    assert set(info["backends"]) == set(dispatch.ops()) and set(info["reasons"]) == set(dispatch.ops())
    assert isinstance(info["ext_cpu"], bool) and isinstance(info["ext_cuda"], bool)
    assert isinstance(info["cuda_archs"], list)
    assert {"torch", "transformers"} <= set(info["versions"])


def test_info_command(tmp_path):
    """``python -m fastbert.info`` prints a short summary (every op with its backend, in a few dozen lines), and
    ``--json`` the same report as ``fastbert.info()`` (run outside the checkout, so that it imports the installed
    package as the tests do). The backends the two commands print are compared with each other: both read this
    machine's stored measurements (a busy machine's marker included), where this process may have measured at
    another moment."""
    result = subprocess.run([sys.executable, "-m", "fastbert.info", "--json"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert INFO_KEYS <= printed.keys() and printed["backends"].keys() == fastbert.info()["backends"].keys()
    result = subprocess.run([sys.executable, "-m", "fastbert.info"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("fastbert ") and len(lines) < 40
    assert all(any(line.split()[:2] == [op, backend] for line in lines)
               for op, backend in printed["backends"].items()), (printed["backends"], lines)
    assert sum("Triton" in line for line in lines) <= 1  # said once, not per op


def test_backend_torch_forces_torch(bert_trio, assert_matches_hf, monkeypatch, fastbert_env):
    """FASTBERT_BACKEND=torch: every op on the torch path, the extension and the Triton kernels never called."""
    fastbert_env(FASTBERT_BACKEND="torch", TRITON_INTERPRET="1")  # would otherwise make Triton eligible on CPU

    def must_not_run(*args, **kwargs):
        raise AssertionError("FASTBERT_BACKEND=torch ran a non-torch kernel")

    import fastbert.kernels.activation
    import fastbert.kernels.attention
    import fastbert.kernels.attention_varlen
    import fastbert.kernels.embedding
    import fastbert.kernels.layer_norm

    for module, name in [(fastbert.ops.embedding, "_ext_launch"), (fastbert.ops.attention, "attention_cpu"),
                         (fastbert.kernels.embedding, "embedding_layer_norm"),
                         (fastbert.kernels.attention, "attention"),
                         (fastbert.kernels.attention_varlen, "attention_varlen"),
                         (fastbert.kernels.layer_norm, "layer_norm"), (fastbert.kernels.activation, "bias_act")]:
        monkeypatch.setattr(module, name, must_not_run)
    assert set(fastbert.info()["backends"].values()) == {"torch"}

    trio = bert_trio()
    input_ids, mask = right_padded(trio.config)
    out, out_hf, out_ref = trio.run(input_ids, attention_mask=mask)
    assert_matches_hf(out.last_hidden_state, out_hf.last_hidden_state, out_ref.last_hidden_state, mask)


def test_backend_invalid_value_raises(bert_trio, fastbert_env):
    trio = bert_trio()
    input_ids, mask = right_padded(trio.config)
    fastbert_env(FASTBERT_BACKEND="cuda-please")
    with pytest.raises(ValueError, match="FASTBERT_BACKEND"):
        with torch.no_grad():
            trio.fast(input_ids, attention_mask=mask)


def test_packed_attention_via_padded_sdpa_matches_the_loop():
    """GPU training's packed attention (one masked SDPA over the padded batch) gives the CPU loop's outputs and
    gradients, on a mask with left/right padding, holes and a fully padded row."""
    from fastbert import padding
    from fastbert.ops import attention

    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1], [0, 0, 0, 0, 0]])
    layout = padding.unpadded_layout(mask)
    heads = torch.randn(layout.indices.numel(), 3, 2, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(layout.indices.numel(), 2, 8, dtype=torch.float64)
    results = []
    for run in (lambda: attention._attention_packed_via_padded_sdpa(heads, layout, 0.0),
                lambda: attention._attention_varlen_sdpa(heads, layout, 0.0)):
        heads.grad = None
        out = run()
        (out * weights).sum().backward()
        results.append((out.detach(), heads.grad.clone()))
    (out, grad), (out_loop, grad_loop) = results
    torch.testing.assert_close(out, out_loop, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_loop, rtol=0, atol=1e-12)
