"""fastbert.cuda_graphs: replays match the eager forward, inputs are checked first, graphs follow the weights.

The capture itself needs a GPU (``cuda_device`` tests); the rest runs everywhere. The graph's forward reading no
device data is proven in test_model_inputs.py (``test_graph_safe_forward_reads_no_device_data``).
"""

import copy
import pickle
import warnings

import pytest
import torch
import transformers

import fastbert
from fastbert.graphs import GraphSet
from test_model_parity import mixed_mask, random_inputs


def test_needs_a_fastbert_encoder(small_bert_config):
    with pytest.raises(TypeError, match="model: BertModel holds no fastbert encoder; call fastbert.optimize"):
        fastbert.cuda_graphs(transformers.BertModel(small_bert_config()))


@pytest.mark.parametrize("name, sizes", [("batch_sizes", ()), ("seq_lens", (0, 16))])
def test_bad_buckets(small_bert_config, name, sizes):
    with pytest.raises(ValueError, match=name):
        fastbert.cuda_graphs(fastbert.BertModel(small_bert_config()), **{name: sizes})


def test_on_cpu_runs_eagerly_and_says_so(small_bert_config):
    """Graphs need a GPU: on the CPU the forward is the eager one, with the reason warned and listed by info()."""
    model = fastbert.BertModel(small_bert_config()).eval()
    input_ids, _ = random_inputs(model.config, 3, 9)
    mask = mixed_mask(3, 9)
    with torch.inference_mode():
        expected = model(input_ids, attention_mask=mask)
        assert fastbert.cuda_graphs(model) is model
        with pytest.warns(RuntimeWarning, match="cuda_graphs: the model is on cpu, not a GPU"):
            out = model(input_ids, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=0, atol=0)
    assert any("cuda_graphs" in reason for reason in fastbert.info()["fallbacks"])
    fastbert.cuda_graphs(model, enabled=False)
    assert model._graphs is None


def test_every_encoder_inside_a_head(small_bert_config):
    head = fastbert.optimize(transformers.BertForSequenceClassification(small_bert_config()))
    assert fastbert.cuda_graphs(head, batch_sizes=(4,), seq_lens=(32,)) is head
    assert head.bert._graphs.batch_sizes == (4,) and head.bert._graphs.seq_lens == (32,)


def test_copies_and_pickles_start_without_graphs(small_bert_config):
    model = fastbert.cuda_graphs(fastbert.BertModel(small_bert_config()), batch_sizes=(2, 1), seq_lens=(8,))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone._graphs is not model._graphs and clone._graphs.graphs == {}
        assert (clone._graphs.batch_sizes, clone._graphs.seq_lens) == ((1, 2), (8,))


@pytest.mark.parametrize("family", ["bert", "gte", "modernbert"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_static_forward_matches_eager(small_bert_config, backend, family, fastbert_env):
    """What a graph captures and replays, run eagerly on CPU: the bucket's forward built on zeroed buffers (as at
    capture), then fed one call after another, each equal to that call's eager forward. A layout or bound computed
    from the buffers before they are fed (the key bounds once were) fails this; so would rotary tables or a window
    taken from them. Triton runs through its interpreter (the path a GPU graph captures), and torch's SDPA path too."""
    from fastbert.graphs import StaticForward
    from test_families import FAMILIES, inputs

    fastbert_env(FASTBERT_BACKEND=backend, TRITON_INTERPRET="1")
    if family == "bert":
        model = fastbert.BertModel(small_bert_config(hidden_size=52, num_attention_heads=2, intermediate_size=80))
    elif family in FAMILIES:
        model = fastbert.AutoModel.from_config(FAMILIES[family].config)
    else:
        pytest.skip(f"{family} needs transformers 5.x")
    model.eval()
    static = StaticForward(4, 16, torch.device("cpu"))
    with torch.inference_mode():
        static.forward(model)  # built before any input, as a capture is
        for batch, seq_len, seed in [(3, 11, 0), (4, 16, 1), (1, 5, 2)]:
            input_ids, _ = inputs(model.config, batch, seq_len, seed=seed)
            mask = mixed_mask(batch, seq_len)
            if batch > 1:
                mask[-1] = 0  # a fully padded row
            eager = model(input_ids, attention_mask=mask)
            indices, layout = fastbert.inputs.prepare(model, dict(input_ids=input_ids, attention_mask=mask,
                                                                  token_type_ids=None, position_ids=None,
                                                                  inputs_embeds=None), unpad=False)
            static.feed(indices, layout)
            out = static.forward(model)
            real = mask.bool()
            torch.testing.assert_close(out.last_hidden_state[:batch, :seq_len][real], eager.last_hidden_state[real],
                                       rtol=0, atol=1e-5)
            if family == "bert":
                torch.testing.assert_close(out.pooler_output[:batch][real[:, 0]], eager.pooler_output[real[:, 0]],
                                           rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch, seq_len, bucket", [(1, 1, (1, 16)), (3, 16, (4, 16)), (4, 17, (4, 32)),
                                                    (8, 100, (8, 128)), (9, 8, None), (2, 129, None)])
def test_buckets(batch, seq_len, bucket):
    """The smallest bucket holding the call (the bucket's padding has position 0: the position table never limits
    it)."""
    assert GraphSet((1, 2, 4, 8), (16, 32, 128))._bucket(batch, seq_len) == bucket


# --- on a GPU ------------------------------------------------------------------------------------------------------


# fp32 (no TF32 by default): the replay and the eager forward may differ only by the GEMMs cuBLAS picks for the
# bucket's row count, well within the 1e-4 of fp32 parity.
ATOL = 1e-4


def _graphed(model, device):
    return fastbert.cuda_graphs(model.to(device).eval(), batch_sizes=(2, 4, 16), seq_lens=(16, 64))


@pytest.mark.parametrize("host_inputs", [False, True], ids=["device-inputs", "host-inputs"])
def test_cuda_replay_matches_eager(cuda_device, small_bert_config, host_inputs):
    """Calls of several shapes, in and across buckets: the replay equals the eager dense forward on real tokens, and
    earlier outputs stay valid after later replays."""
    model = fastbert.BertModel(small_bert_config()).to(cuda_device).eval()
    shapes = [(3, 9), (4, 16), (1, 5), (12, 40), (3, 9)]
    calls = []
    for batch, seq_len in shapes:
        input_ids, token_type_ids = random_inputs(model.config, batch, seq_len)
        mask = mixed_mask(batch, seq_len)
        calls.append([t if host_inputs else t.to(cuda_device) for t in (input_ids, mask, token_type_ids)])
    with torch.inference_mode():
        model.unpad = False  # the eager dense forward: the same kernels on the same rows
        expected = [model(ids, attention_mask=mask, token_type_ids=tt) for ids, mask, tt in calls]
        _graphed(model, cuda_device)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fastbert")  # no fallback: every call replays
            outs = [model(ids, attention_mask=mask, token_type_ids=tt) for ids, mask, tt in calls]
    assert len(model._graphs.graphs) == 3
    for (ids, mask, _), out, ref in zip(calls, outs, expected):
        real = mask.bool().to(cuda_device)
        assert out.last_hidden_state.shape == ref.last_hidden_state.shape
        torch.testing.assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], rtol=0, atol=ATOL)
        torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=0, atol=ATOL)


def test_cuda_head_and_tuple_outputs(cuda_device, small_bert_config):
    head = fastbert.optimize(transformers.BertForSequenceClassification(small_bert_config()))
    head.to(cuda_device).eval()
    input_ids, _ = random_inputs(head.config, 3, 11)
    mask = mixed_mask(3, 11)
    with torch.inference_mode():
        head.bert.unpad = False
        expected = head(input_ids.to(cuda_device), attention_mask=mask.to(cuda_device)).logits
        _graphed(head, cuda_device)
        logits = head(input_ids, attention_mask=mask).logits
        as_tuple = head.bert(input_ids, attention_mask=mask, return_dict=False)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    assert isinstance(as_tuple, tuple) and as_tuple[0].shape == (3, 11, head.config.hidden_size)


def test_cuda_graphs_follow_the_weights(cuda_device, small_bert_config):
    """A weight written in place (the fused QKV weight is derived from it) or moved: recaptured, never stale."""
    model = _graphed(fastbert.BertModel(small_bert_config()), cuda_device)
    input_ids, _ = random_inputs(model.config, 2, 10)
    with torch.inference_mode():
        before = model(input_ids).last_hidden_state
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight.mul_(2)
    with torch.inference_mode():
        after = model(input_ids).last_hidden_state
    model.double()  # moves every parameter: recaptured in float64
    with torch.inference_mode():
        in_double = model(input_ids).last_hidden_state
        fastbert.cuda_graphs(model, enabled=False)
        eager = model(input_ids).last_hidden_state
    assert not torch.equal(before, after)
    assert in_double.dtype == torch.float64
    torch.testing.assert_close(after.double(), eager, rtol=0, atol=ATOL)
    torch.testing.assert_close(in_double, eager, rtol=0, atol=1e-10)


def test_cuda_checks_and_eager_cases(cuda_device, small_bert_config):
    model = _graphed(fastbert.BertModel(small_bert_config()), cuda_device)
    input_ids, _ = random_inputs(model.config, 2, 10)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="input_ids out of range"):
            model(input_ids.index_fill(1, torch.tensor([3]), 99))
        with pytest.warns(RuntimeWarning, match="beyond the largest bucket"):
            model(random_inputs(model.config, 17, 4)[0])
        with pytest.warns(RuntimeWarning, match="output_hidden_states given"):
            out = model(input_ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    with pytest.warns(RuntimeWarning, match="gradients are required"):
        model(input_ids)


def test_what_invalidates_the_graphs(small_bert_config):
    """The state compared before each replay (no GPU needed to compute it): unchanged by eager inference forwards,
    changed by an in-place write, a dtype change, replaced parameters, clear_caches and a forward with gradients."""
    model = fastbert.BertModel(small_bert_config()).eval()
    input_ids, _ = random_inputs(model.config, 2, 6)

    def forward():
        with torch.inference_mode():
            model(input_ids)

    def watched():
        forward()  # (a capture's warm-up builds the derived weights)
        graphs = GraphSet((2,), (16,))
        graphs._watch(model)
        return graphs

    graphs = watched()
    forward()
    assert graphs._weights_state() == graphs.state
    changes = {
        "in place": lambda: model.encoder.layer[0].attention.self.key.bias.add_(1),
        "dtype": lambda: model.double(),
        "replaced": lambda: model.load_state_dict(model.state_dict(), assign=True),
        "clear_caches": lambda: fastbert.clear_caches(model),
        "gradients": lambda: model(input_ids).last_hidden_state.sum().backward(),
    }
    for name, change in changes.items():
        graphs = watched()
        with torch.no_grad() if name != "gradients" else torch.enable_grad():
            change()
        assert graphs._weights_state() != graphs.state, name


@pytest.mark.parametrize("family", ["roberta", "distilbert", "electra", "gte", "modernbert"])
def test_cuda_replay_other_families(cuda_device, family):
    """RoBERTa-family positions (computed from the caller's ids before padding to the bucket), DistilBERT (no
    pooler, no token types), ELECTRA (a projection after the embeddings), GTE and ModernBERT (rotary tables and the
    window built inside the graph): replays equal the eager dense forward."""
    from test_families import FAMILIES, inputs

    if family not in FAMILIES:
        pytest.skip(f"{family} needs transformers 5.x")

    config = FAMILIES[family].config
    model = fastbert.AutoModel.from_config(config).to(cuda_device).eval()
    model.unpad = False
    input_ids, mask = inputs(config, 3, 10)
    with torch.inference_mode():
        expected = model(input_ids.to(cuda_device), attention_mask=mask.to(cuda_device))
        _graphed(model, cuda_device)
        out = model(input_ids, attention_mask=mask)
    assert len(model._graphs.graphs) == 1
    real = mask.bool().to(cuda_device)
    torch.testing.assert_close(out.last_hidden_state[real], expected.last_hidden_state[real], rtol=0, atol=ATOL)
