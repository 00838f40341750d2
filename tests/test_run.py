"""A forward's ``Run`` (fastbert/run.py): entered once per model forward, read by ops; what the watchers around a
forward give it (the int8 guard's ranges and tally) reaches the forwards inside; a backend that declines a call at
run time hands it to the next backend, which ``info()`` then names."""

import collections
import threading

import pytest
import torch
import transformers
from test_model_api import right_padded

import fastbert
from fastbert import cpu, dispatch, run
from fastbert.ops import attention_cpu


@pytest.fixture
def model(small_bert_config):
    torch.manual_seed(0)
    return fastbert.BertModel(small_bert_config()).eval()


def test_one_run_per_forward_holds_the_plan_and_the_layout(model, monkeypatch):
    seen = []
    embed = type(model).embed

    def watching(self, indices, inputs_embeds):
        seen.append(run.current())
        return embed(self, indices, inputs_embeds)

    monkeypatch.setattr(type(model), "embed", watching)
    input_ids, mask = right_padded(model.config)
    with torch.inference_mode():
        model(input_ids, attention_mask=mask)
        model(input_ids, attention_mask=mask)
    first, second = seen
    assert first is not second and first.plan is second.plan is model.__dict__["_fastbert_plan"]
    assert first.layout.packed and first.layout.tokens == int(mask.sum())
    assert run.current() is None  # (nothing is left behind: the Run ends with its forward)
    assert first.offer is None and first.offers == []


def test_the_watchers_fields_reach_the_forwards_inside(model, monkeypatch):
    seen = []
    embed = type(model).embed
    monkeypatch.setattr(type(model), "embed", lambda self, *a: seen.append(run.current()) or embed(self, *a))
    input_ids, mask = right_padded(model.config)
    with run.Run(tally=collections.Counter(), ranges={}) as watch, torch.inference_mode():
        model(input_ids, attention_mask=mask)
        assert run.current() is watch
    (forward,) = seen
    assert forward is not watch and forward.plan is not None and watch.plan is None
    assert forward.tally is watch.tally and forward.ranges is watch.ranges
    with torch.inference_mode():
        model(input_ids, attention_mask=mask)
    assert seen[-1].tally is None and seen[-1].ranges is None
    assert run.current() is None


def test_runs_are_per_thread(model):
    input_ids, mask = right_padded(model.config)
    seen = {}

    def forward(name):
        with run.Run(tally=collections.Counter()) as watch:
            with torch.inference_mode():
                model(input_ids, attention_mask=mask)
            seen[name] = (watch, run.current())

    threads = [threading.Thread(target=forward, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"][0] is seen["a"][1] and seen["b"][0] is seen["b"][1] and seen["a"][0] is not seen["b"][0]


@pytest.mark.skipif(bool(attention_cpu.attention_cpu_unavailable_reasons()), reason="the C++ CPU attention does not "
                    "run here")
def test_a_declined_call_runs_the_next_backend_and_is_counted(small_bert_config, monkeypatch):
    """unpad=False keeps a padded batch dense: the C++ attention, chosen for the op, declines it (it cannot skip
    padded rows) and torch's SDPA runs it, as transformers computes it; the decline is counted for info() and for
    the forward's watchers."""
    monkeypatch.setattr(dispatch, "_declines", {})
    # (this machine's measured choice between the C++ kernel and SDPA, taken as the kernel: on a busy machine the
    # measurement keeps SDPA)
    monkeypatch.setattr(cpu, "attention_slower_reason", lambda kernel, dtype=None, head_dim=None: None)
    torch.manual_seed(0)
    config = small_bert_config()
    hf = transformers.BertModel(config).eval()
    fast = fastbert.BertModel(config, unpad=False).eval()
    fast.load_state_dict(hf.state_dict())
    decision = dispatch.decide("attention", dispatch._registry["attention"], _attention_call(config))
    assert decision.backend.name == "cpu-ext", decision
    assert [b.name for b in decision.after][-1] == "torch"
    input_ids, mask = right_padded(config)
    with run.Run(tally=collections.Counter()) as watch, torch.inference_mode():
        out = fast(input_ids, attention_mask=mask).last_hidden_state
    declined = fastbert.info()["declined"]
    assert any(key.startswith("attention: cpu-ext declined") for key in declined), declined
    assert watch.tally["attention", "cpu-ext", "declined"] == config.num_hidden_layers
    with torch.inference_mode():
        expected = hf(input_ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], expected[real], rtol=0, atol=1e-4)


def _attention_call(config):
    from fastbert.ops.attention import Call

    head_dim = config.hidden_size // config.num_attention_heads
    return Call(head_dim, (), torch.device("cpu"), torch.float32)
