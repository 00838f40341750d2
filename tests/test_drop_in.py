"""fastbert under what HF users do with a BertModel: PEFT, hooks, offload, quantization, the Trainer, torch.func,
threads, export. Each test runs the real library against transformers' own model with the same weights."""

import contextlib
import copy
import threading
import warnings

import pytest
import torch
import transformers
from transformers.models.bert import modeling_bert as hf_bert

import fastbert

from conftest import eager_attention
from test_model_api import right_padded


def _pair(small_bert_config, model_class=transformers.BertModel, seed=0, **overrides):
    """(HF model, the same weights through fastbert.optimize), both in eval mode, random non-zero biases."""
    config = small_bert_config(**overrides)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, fastbert.optimize(copy.deepcopy(model))


def _real(out, mask):
    return out[mask.bool()]


def _assert_same(out, out_hf, mask=None, atol=1e-5):
    if mask is not None:
        out, out_hf = _real(out, mask), _real(out_hf, mask)
    torch.testing.assert_close(out, out_hf, rtol=0, atol=atol)


# --- PEFT / LoRA -------------------------------------------------------------------------------------------------

LORA_TARGETS = ["query", "key", "value", "dense"]


def _lora(model):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("order", ["lora-then-optimize", "optimize-then-lora"])
def test_lora_outputs_match_hf(small_bert_config, order):
    hf, _ = _pair(small_bert_config)
    hf_lora = _lora(copy.deepcopy(hf))
    fast = fastbert.optimize(_lora(copy.deepcopy(hf))) if order == "lora-then-optimize" else _lora(
        fastbert.optimize(copy.deepcopy(hf)))
    assert any(isinstance(m, fastbert.BertModel) for m in fast.modules())
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out, out_hf, base = fast(input_ids, attention_mask=mask), hf_lora(input_ids, attention_mask=mask), hf(
            input_ids, attention_mask=mask)
    assert (_real(out_hf.last_hidden_state, mask) - _real(base.last_hidden_state, mask)).abs().max() > 1e-2
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)


def test_lora_training_updates_adapters_like_hf(small_bert_config):
    hf, _ = _pair(small_bert_config)
    models = [_lora(copy.deepcopy(hf)), fastbert.optimize(_lora(copy.deepcopy(hf)))]
    input_ids, mask = right_padded(hf.config)
    grads = []
    for model in models:
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        out = model(input_ids, attention_mask=mask).last_hidden_state
        (out[mask.bool()] ** 2).mean().backward()
        # (the pooler's adapters get no gradient from this loss, in both)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 8 and all("lora_" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    for (name, p), (_, p_hf) in zip(models[1].named_parameters(), models[0].named_parameters()):
        torch.testing.assert_close(p, p_hf, rtol=1e-4, atol=1e-6, msg=name)


# --- hooks, offload, quantization ---------------------------------------------------------------------------------


def test_forward_hooks_on_linears_fire_as_in_hf(small_bert_config):
    hf, fast = _pair(small_bert_config)
    counts = {}
    for name, model in (("hf", hf), ("fast", fast)):
        counts[name] = 0

        def hook(module, args, output, name=name):
            counts[name] += 1
            return output * 1.5  # a hook that changes the output must change the model's output too

        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.register_forward_hook(hook)
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out, out_hf = fast(input_ids, attention_mask=mask), hf(input_ids, attention_mask=mask)
    assert counts["fast"] == counts["hf"] > 0
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)
    _assert_same(out.pooler_output, out_hf.pooler_output)


@pytest.mark.parametrize("target", ["layer", "self_output_layer_norm"])
def test_hook_on_inner_module_runs(small_bert_config, target):
    """A hook on a module the fused path would skip (a whole layer) runs transformers' forward; one on a LayerNorm
    is called by the fused op."""
    hf, fast = _pair(small_bert_config)
    seen = []
    for model in (hf, fast):
        layer = model.encoder.layer[1]
        module = layer if target == "layer" else layer.attention.output.LayerNorm
        module.register_forward_hook(lambda m, a, o: (seen.append(1), o + 0.25)[1])
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out, out_hf = fast(input_ids, attention_mask=mask), hf(input_ids, attention_mask=mask)
    assert len(seen) == 2
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)


def test_accelerate_disk_offload(small_bert_config, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    hf, fast = _pair(small_bert_config)
    accelerate.disk_offload(fast, offload_dir=str(tmp_path), execution_device="cpu")
    assert fast.encoder.layer[0].attention.self.query.weight.device.type == "meta"
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out, out_hf = fast(input_ids, attention_mask=mask), hf(input_ids, attention_mask=mask)
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)


def test_from_pretrained_device_map_with_disk(small_bert_config, tmp_path):
    pytest.importorskip("accelerate")
    hf, _ = _pair(small_bert_config)
    hf.save_pretrained(tmp_path / "model")
    device_map = {"embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1": "disk", "pooler": "cpu"}
    fast = fastbert.BertModel.from_pretrained(tmp_path / "model", device_map=device_map,
                                              offload_folder=str(tmp_path / "offload")).eval()
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out, out_hf = fast(input_ids, attention_mask=mask), hf(input_ids, attention_mask=mask)
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)


def test_dynamic_quantization(small_bert_config):
    hf, fast = _pair(small_bert_config)
    quantize = torch.ao.quantization.quantize_dynamic
    hf_q, fast_q = quantize(hf, {torch.nn.Linear}, dtype=torch.qint8), quantize(fast, {torch.nn.Linear}, dtype=torch.qint8)
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out, out_hf, out_fp = fast_q(input_ids, attention_mask=mask), hf_q(input_ids, attention_mask=mask), hf(
            input_ids, attention_mask=mask)
    assert (_real(out_hf.last_hidden_state, mask) - _real(out_fp.last_hidden_state, mask)).abs().max() > 1e-4
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask, atol=1e-4)


# --- arguments and outputs as transformers has them ---------------------------------------------------------------


def test_hf_kwargs_accepted(small_bert_config):
    hf, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out = fast(input_ids, attention_mask=mask, num_items_in_batch=torch.tensor(7), use_cache=True)
        out_hf = hf(input_ids, attention_mask=mask, num_items_in_batch=torch.tensor(7), use_cache=True)
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)
    assert out.past_key_values is None and out_hf.past_key_values is None


@pytest.mark.parametrize("selection", [True, [0, 2], -1, [1, -1], 5])
def test_output_hidden_states_selection(small_bert_config, selection):
    hf, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad():
        out = fast(input_ids, attention_mask=mask, output_hidden_states=selection)
        out_hf = hf(input_ids, attention_mask=mask, output_hidden_states=selection)
    assert [h is None for h in out.hidden_states] == [h is None for h in out_hf.hidden_states]
    for h, h_hf in zip(out.hidden_states, out_hf.hidden_states):
        if h is not None:
            _assert_same(h, h_hf, mask)


@pytest.mark.parametrize("unpad", [True, False])
def test_hidden_states_are_on_the_autograd_path(small_bert_config, unpad):
    _, fast = _pair(small_bert_config)
    fast.unpad = unpad
    input_ids, mask = right_padded(fast.config)
    out = fast(input_ids, attention_mask=mask, output_hidden_states=True)
    for h in out.hidden_states:
        h.retain_grad()
    out.pooler_output.sum().backward()
    assert all(h.grad is not None for h in out.hidden_states)
    assert out.hidden_states[-1] is out.last_hidden_state


def test_output_attentions_runs_transformers(small_bert_config):
    hf, fast = _pair(small_bert_config)
    eager_attention(hf), eager_attention(fast)
    input_ids, mask = right_padded(hf.config)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="output_attentions") as record:
        out = fast(input_ids, attention_mask=mask, output_attentions=True)
    out_hf = hf(input_ids, attention_mask=mask, output_attentions=True)
    assert record[0].filename == __file__  # the warning names the caller's line
    assert len(out.attentions) == hf.config.num_hidden_layers
    for a, a_hf in zip(out.attentions, out_hf.attentions):
        torch.testing.assert_close(a, a_hf, rtol=0, atol=1e-6)


def test_cross_attention_runs_transformers(small_bert_config):
    hf, fast = _pair(small_bert_config, is_decoder=True, add_cross_attention=True)
    input_ids, mask = right_padded(hf.config)
    encoder_states = torch.randn(4, 3, hf.config.hidden_size)
    with torch.no_grad():
        out = fast(input_ids, attention_mask=mask, encoder_hidden_states=encoder_states)
        out_hf = hf(input_ids, attention_mask=mask, encoder_hidden_states=encoder_states)
    torch.testing.assert_close(out.last_hidden_state, out_hf.last_hidden_state, rtol=0, atol=0)


def test_empty_batch_returns_empty_outputs(small_bert_config):
    _, fast = _pair(small_bert_config)
    with torch.no_grad():
        out = fast(torch.zeros(0, 0, dtype=torch.long), attention_mask=torch.zeros(0, 0, dtype=torch.long))
    assert out.last_hidden_state.shape == (0, 0, fast.config.hidden_size)
    assert out.pooler_output.shape == (0, fast.config.hidden_size)


def test_buffers_initialized_after_from_pretrained(small_bert_config, tmp_path):
    hf, _ = _pair(small_bert_config)
    hf.save_pretrained(tmp_path)
    fast = fastbert.BertModel.from_pretrained(tmp_path)
    torch.testing.assert_close(fast.embeddings.position_ids, hf.embeddings.position_ids, rtol=0, atol=0)
    assert (fast.embeddings.token_type_ids == 0).all()


def test_optimize_warns_when_nothing_to_accelerate():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.warns(RuntimeWarning, match=r"found no BERT-family encoder to accelerate in Sequential \(it contains Linear, "
                                            r"ReLU\)"):
        assert fastbert.optimize(model) is model


def test_info_reports_fallbacks(small_bert_config):
    _, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(fast.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shown once per process: maybe already by an earlier test
        fast(input_ids, attention_mask=mask)  # with gradients: the torch ops run
    fallbacks = fastbert.info()["fallbacks"]
    assert any("gradients are required" in reason for reason in fallbacks)


# --- training with the HF Trainer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", [transformers.BertForSequenceClassification, transformers.BertForMaskedLM])
def test_trainer_fine_tunes_like_hf(small_bert_config, model_class, tmp_path):
    hf, fast = _pair(small_bert_config, model_class, num_labels=3)
    input_ids, mask = right_padded(hf.config, batch=8, seq_len=10)
    if model_class is transformers.BertForSequenceClassification:
        labels = torch.arange(8) % 3
    else:
        labels = input_ids.masked_fill(mask == 0, -100)
    rows = [dict(input_ids=i, attention_mask=m, labels=y) for i, m, y in zip(input_ids, mask, labels)]
    losses, first_grads = {}, {}
    for name, model in (("hf", hf), ("fast", fast)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)

        def grab(trainer=trainer, name=name):
            if name not in first_grads:
                first_grads[name] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                                     if p.grad is not None}

        trainer.add_callback(type("Grab", (transformers.TrainerCallback,), {
            "on_pre_optimizer_step": lambda self, *a, **k: grab()})())
        trainer.train()
        losses[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses["fast"][-1] < losses["fast"][0]
    assert losses["fast"] == pytest.approx(losses["hf"], rel=1e-3)
    assert first_grads["fast"].keys() == first_grads["hf"].keys()
    for n, g in first_grads["hf"].items():
        torch.testing.assert_close(first_grads["fast"][n], g, rtol=1e-4, atol=1e-6, msg=n)


# --- export -------------------------------------------------------------------------------------------------------


def test_torch_export(small_bert_config):
    hf, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(hf.config)
    exported = torch.export.export(fast, (input_ids,), {"attention_mask": mask})
    out = exported.module()(input_ids, attention_mask=mask)
    with torch.no_grad():
        out_hf = hf(input_ids, attention_mask=mask)
    _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_export_runs_in_onnxruntime(small_bert_config, tmp_path, dynamo):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    hf, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(hf.config)
    path = tmp_path / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(fast, (input_ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state", "pooler_output"], dynamo=dynamo)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    last, pooled = session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": mask.numpy()})[:2]
    with torch.no_grad():
        out_hf = hf(input_ids, attention_mask=mask)
    _assert_same(torch.from_numpy(last), out_hf.last_hidden_state, mask, atol=1e-4)
    _assert_same(torch.from_numpy(pooled), out_hf.pooler_output, atol=1e-4)


# --- parameters are never touched; derived caches follow them -----------------------------------------------------


def test_forward_never_touches_parameters(small_bert_config):
    _, fast = _pair(small_bert_config)
    before = {n: (p, p.data_ptr(), p._version) for n, p in fast.named_parameters()}
    input_ids, mask = right_padded(fast.config)
    with torch.inference_mode():
        fast(input_ids, attention_mask=mask)
    with torch.no_grad():
        fast(input_ids, attention_mask=mask)
    assert {n: (p, p.data_ptr(), p._version) for n, p in fast.named_parameters()} == before


def test_flat_buffer_optimizer_between_evaluations(small_bert_config):
    """As ZeRO/FSDP do: parameters re-pointed into one flat buffer and updated through it, training forwards in
    between evaluations. Every evaluation equals HF's with the same weights."""
    hf, fast = _pair(small_bert_config)
    params = list(fast.parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    input_ids, mask = right_padded(fast.config)
    for step in range(3):
        fast.train()
        fast(input_ids, attention_mask=mask).last_hidden_state.sum().backward()
        with torch.no_grad():
            flat.mul_(0.9)  # an update through the buffer: the parameters' version counters do not move
        fast.eval()
        hf.load_state_dict(fast.state_dict())
        with torch.no_grad():
            out, out_hf = fast(input_ids, attention_mask=mask), hf(input_ids, attention_mask=mask)
        _assert_same(out.last_hidden_state, out_hf.last_hidden_state, mask)


def test_half_after_forward_leaves_no_stale_copy(small_bert_config):
    _, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(fast.config)
    with torch.no_grad():
        fast(input_ids, attention_mask=mask)
    fast.to(torch.bfloat16)
    assert not any("_fastbert_derived" in m.__dict__ for m in fast.modules())


def test_torch_func_functional_call_and_vmap_ensembling(small_bert_config):
    hf, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(fast.config)
    members = [copy.deepcopy(fast) for _ in range(3)]
    for i, m in enumerate(members):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1 + 0.1 * i)
    params, buffers = torch.func.stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    fast_before = {n: p for n, p in fast.named_parameters()}

    def run(p, b):
        return torch.func.functional_call(base, (p, b), (input_ids,)).last_hidden_state

    with torch.no_grad():
        ensemble = torch.vmap(run)(params, buffers)
        single = torch.func.functional_call(fast, dict(members[2].named_parameters()), (input_ids,))
    for i, m in enumerate(members):
        hf.load_state_dict(m.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(ensemble[i], hf(input_ids).last_hidden_state, rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(single.last_hidden_state, hf(input_ids).last_hidden_state, rtol=0, atol=1e-5)
    assert {n: p for n, p in fast.named_parameters()} == fast_before


class _ReadersWriter:
    """Many forwards at once, or one weight update: each forward then sees one version of the weights (a torn
    update mid-forward would make any model, HF's included, mix versions)."""

    def __init__(self):
        self.condition, self.readers, self.writer_waiting = threading.Condition(), 0, False

    def read(self):
        with self.condition:
            self.condition.wait_for(lambda: not self.writer_waiting)  # the writer goes first
            self.readers += 1

    def done(self):
        with self.condition:
            self.readers -= 1
            self.condition.notify_all()

    @contextlib.contextmanager
    def write(self):
        with self.condition:
            self.writer_waiting = True
            self.condition.wait_for(lambda: self.readers == 0)
            try:
                yield
            finally:
                self.writer_waiting = False
                self.condition.notify_all()


def test_threads_forwards_with_concurrent_updates(small_bert_config):
    """Forwards (mixed shapes, no_grad and grad) in three threads at once, between which a fourth thread steps an
    optimizer and loads state dicts: no crash, no lost update, each forward equals a serial run with the weights
    it saw."""
    hf, fast = _pair(small_bert_config)
    versions = [copy.deepcopy(fast.state_dict())]
    gate = _ReadersWriter()
    errors, results = [], []
    stop = threading.Event()

    def forwards(seed):
        generator = torch.Generator().manual_seed(seed)
        try:
            for i in range(12):
                batch, seq = (int(torch.randint(1, n, (1,), generator=generator)) for n in (5, 12))
                ids = torch.randint(1, fast.config.vocab_size, (batch, seq), generator=generator)
                mask = (torch.rand(batch, seq, generator=generator) > 0.3).long()
                mask[:, 0] = 1
                gate.read()
                try:
                    version = len(versions) - 1
                    with torch.set_grad_enabled(i % 3 == 0):
                        out = fast(ids, attention_mask=mask).last_hidden_state.detach()
                finally:
                    gate.done()
                results.append((ids, mask, out, version))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def updates():
        optimizer = torch.optim.SGD(fast.parameters(), lr=1e-2)
        while not stop.is_set():
            with gate.write():
                for p in fast.parameters():
                    p.grad = torch.full_like(p, 0.5)
                optimizer.step()
                if len(versions) % 3 == 0:
                    fast.load_state_dict(versions[0])
                versions.append(copy.deepcopy(fast.state_dict()))
            stop.wait(0.002)

    workers = [threading.Thread(target=forwards, args=(s,)) for s in range(3)]
    updater = threading.Thread(target=updates)
    for t in workers + [updater]:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    updater.join()
    assert not errors, errors
    assert len(versions) > 3 and len({v for *_, v in results}) > 1  # the updates did interleave
    for ids, mask, out, version in results:
        hf.load_state_dict(versions[version])
        with torch.no_grad():
            expected = hf(ids, attention_mask=mask).last_hidden_state
        _assert_same(out, expected, mask)


def test_three_dimensional_mask_runs_transformers(small_bert_config):
    hf, fast = _pair(small_bert_config)
    input_ids, mask = right_padded(hf.config)
    mask3d = mask[:, None, :].expand(-1, mask.shape[1], -1).clone()  # [B, S, S]
    with torch.no_grad():
        try:
            out_hf = hf(input_ids, attention_mask=mask3d)
        except Exception as error:  # noqa: BLE001 - whatever transformers does, fastbert does the same
            with pytest.raises(type(error)):
                fast(input_ids, attention_mask=mask3d)
            return
        out = fast(input_ids, attention_mask=mask3d)
    torch.testing.assert_close(out.last_hidden_state, out_hf.last_hidden_state, rtol=0, atol=0)
