"""Forward plans (fastbert/plan.py): a forward reuses the previous one's decisions, and whatever they depend on —
hooks, wrapped modules, training mode, requires_grad, settings, dtype — changes them at the very next forward."""

import collections
import copy

import pytest
import torch
import transformers
from test_model_api import right_padded

import fastbert
from fastbert import _extension, dispatch, plan


@pytest.fixture
def pair(small_bert_config):
    torch.manual_seed(0)
    hf = transformers.BertModel(small_bert_config(hidden_dropout_prob=0.1)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf, fastbert.optimize(copy.deepcopy(hf))


def _run(model, **kwargs):
    input_ids, mask = right_padded(model.config)
    with torch.inference_mode():
        return model(input_ids, attention_mask=mask, **kwargs).last_hidden_state[mask.bool()]


def _same(fast, hf):
    torch.testing.assert_close(_run(fast), _run(hf), rtol=0, atol=1e-5)


def test_decisions_are_taken_once(pair, monkeypatch):
    hf, fast = pair
    taken = []
    decide = dispatch.decide
    monkeypatch.setattr(dispatch, "decide", lambda op, *args: taken.append(op) or decide(op, *args))
    _run(fast)
    layers = fast.config.num_hidden_layers
    assert taken.count("embedding") == 1 and taken.count("attention") == 1  # (one attention decision for all layers)
    assert taken.count("layer_norm") == 2 * layers and taken.count("bias_act") == layers
    first = len(taken)
    _run(fast)
    _run(fast, output_hidden_states=True)
    assert len(taken) == first


def test_a_hook_added_between_forwards_runs(pair):
    hf, fast = pair
    _same(fast, hf)
    seen = []
    dense = fast.encoder.layer[1].intermediate.dense
    handle = dense.register_forward_hook(lambda module, args, out: seen.append(out.shape) or out * 2)
    hf_handle = hf.encoder.layer[1].intermediate.dense.register_forward_hook(lambda m, a, out: out * 2)
    _same(fast, hf)
    assert seen
    handle.remove(), hf_handle.remove()
    count = len(seen)
    _same(fast, hf)
    assert len(seen) == count


def test_a_module_wrapped_between_forwards_is_called(pair):
    peft = pytest.importorskip("peft")
    hf, fast = pair
    _same(fast, hf)
    config = peft.LoraConfig(r=2, target_modules=["value", "dense"], init_lora_weights=False)
    torch.manual_seed(3)
    fast_lora = peft.get_peft_model(fast, config)
    torch.manual_seed(3)
    hf_lora = peft.get_peft_model(hf, config)
    torch.testing.assert_close(_run(fast_lora.base_model.model), _run(hf_lora.base_model.model), rtol=0, atol=1e-5)


def test_training_mode_and_requires_grad_change_the_path(pair):
    hf, fast = pair
    _same(fast, hf)
    fast.train()  # dropout 0.1 is active from the next forward on
    assert not torch.equal(_run(fast), _run(fast))
    fast.eval()
    _same(fast, hf)
    input_ids, mask = right_padded(fast.config)
    out = fast(input_ids, attention_mask=mask).last_hidden_state  # gradients: the reference ops, autograd through
    assert out.requires_grad
    fast.requires_grad_(False)
    assert not fast(input_ids, attention_mask=mask).last_hidden_state.requires_grad


def test_settings_and_dtype_change_the_plan(pair, fastbert_env):
    hf, fast = pair
    _run(fast)
    plan = fast.__dict__["_fastbert_plan"]
    fastbert_env(FASTBERT_BACKEND="torch")
    _run(fast)
    assert fast.__dict__["_fastbert_plan"] is not plan
    plan = fast.__dict__["_fastbert_plan"]
    fast.to(torch.bfloat16)
    _run(fast)
    assert fast.__dict__["_fastbert_plan"] is not plan


def _changes():
    """Changes to a tree that its key sees, each as (what, change(model))."""
    def replace_child(m):
        m.encoder.layer[-1].output.dropout = torch.nn.Dropout(0.1)

    def replace_parameter(m):
        m.encoder.layer[0].output.dense.bias = torch.nn.Parameter(m.encoder.layer[0].output.dense.bias.detach())

    return [
        ("nothing", lambda m: None),
        ("a forward hook", lambda m: m.encoder.layer[-1].register_forward_hook(lambda *args: None)),
        ("a backward hook", lambda m: m.pooler.register_full_backward_hook(lambda *args: None)),
        ("training", lambda m: m.encoder.layer[0].attention.train()),
        ("a child replaced", replace_child),
        ("a child added", lambda m: m.encoder.register_module("extra", torch.nn.Identity())),
        ("a child set to None", lambda m: m.encoder.register_module("pooler_too", None)),
        ("a parameter replaced", replace_parameter),
        ("a parameter added", lambda m: m.pooler.register_parameter("extra", torch.nn.Parameter(torch.ones(2)))),
        ("requires_grad", lambda m: m.embeddings.word_embeddings.weight.requires_grad_(False)),
        ("a dropout's p", lambda m: setattr(m.encoder.layer[0].output.dropout, "p", 0.5)),
        ("a forward set on an instance", lambda m: setattr(m.pooler, "forward", m.pooler.forward)),
        ("children reordered (an OrderedDict)", lambda m: setattr(
            m.encoder.layer[0], "_modules", collections.OrderedDict(reversed(m.encoder.layer[0]._modules.items())))),
    ]


@pytest.mark.parametrize("what, change", _changes(), ids=[what for what, _ in _changes()])
def test_the_native_tree_match_is_the_keys_equality(pair, what, change):
    """``plan.same_structure`` (fastbert._C's ``module_tree_matches``, which compares the tree with a key as it reads
    it) says what ``structure_ref(model) == key`` says, after each change a plan must see, and of the changed tree
    with its own key."""
    matches = getattr(_extension._C, "module_tree_matches", None)
    if matches is None:
        pytest.skip("fastbert._C is not built here")
    fast = copy.deepcopy(pair[1])
    key = plan.structure_ref(fast)
    assert matches(fast, key) and plan.same_structure(fast, key)
    change(fast)
    assert matches(fast, key) == (plan.structure_ref(fast) == key) == (what == "nothing")
    assert matches(fast, plan.structure_ref(fast))
    assert not matches(fast, key[:-1]) and not matches(fast, key + key[-1:]) and not matches(fast, ())


def test_the_native_module_tree_is_the_reference(pair):
    """fastbert._C's ``module_tree`` (csrc/module_tree.cpp) builds ``plan.structure_ref``'s tuple, field by field,
    on a tree with hooks of every kind, a None parameter and a None child, dropouts' p, a forward set on an
    instance, frozen parameters and an OrderedDict of children (as older torch kept); a module without nn.Module's
    attributes raises the same KeyError."""
    module_tree = getattr(_extension._C, "module_tree", None)
    if module_tree is None:
        pytest.skip("fastbert._C is not built here")
    _, fast = pair
    assert module_tree(fast) == plan.structure_ref(fast)
    layer = fast.encoder.layer[0]
    layer.attention.register_forward_hook(lambda *args: None)
    layer.register_forward_pre_hook(lambda *args: None)
    layer.output.register_full_backward_hook(lambda *args: None)
    layer.output.register_full_backward_pre_hook(lambda *args: None)
    layer.output.dense.bias.requires_grad_(False)
    layer.output.dense.register_parameter("unused", None)
    layer.register_module("absent", None)
    layer.intermediate.forward = layer.intermediate.forward
    layer.attention._modules = collections.OrderedDict(reversed(layer.attention._modules.items()))
    fast.train()
    built, reference = module_tree(fast), plan.structure_ref(fast)
    assert built == reference
    assert [entry[0] for entry in built] == [entry[0] for entry in reference]
    assert _extension._C.module_tree_matches(fast, reference)
    broken = torch.nn.Module()
    del broken.__dict__["training"]
    for structure in (module_tree, plan.structure_ref):
        with pytest.raises(KeyError, match="training"):
            structure(broken)
