"""Derived weights (the stacked QKV weight, oneDNN's packed weights) never serve values other than the parameters'
current ones, whoever writes them: PEFT merges, every optimizer torch ships (fused ones included), collectives,
another process sharing the memory, a write landing during a build, a writer thread beside inference threads.
Each case runs the real library and compares with transformers holding the same weights, in both CPU GEMM modes."""

import copy
import gc
import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from test_model_api import right_padded

import fastbert
from fastbert import derived
from fastbert import cpu_gemm

CONFIG = dict(vocab_size=99, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
              max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(params=["onednn", "torch"])
def gemm(request, fastbert_env):
    """Both CPU GEMM libraries: oneDNN (packed weights cached per Linear) and F.linear (the stacked QKV cached)."""
    if request.param == "onednn" and cpu_gemm.unavailable_reasons(torch.float32):
        pytest.skip("; ".join(cpu_gemm.unavailable_reasons(torch.float32)))
    fastbert_env(FASTBERT_CPU_GEMM=request.param)
    return request.param


def _models(seed: int = 0):
    """(HF BertModel, fastbert.optimize of a copy): random weights, biases and LayerNorms included."""
    torch.manual_seed(seed)
    hf = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf, fastbert.optimize(copy.deepcopy(hf))


INPUTS = right_padded(transformers.BertConfig(**CONFIG), batch=4, seq_len=12)


def _infer(model) -> torch.Tensor:
    input_ids, mask = INPUTS
    with torch.inference_mode():
        return model(input_ids, attention_mask=mask).last_hidden_state[mask.bool()]


def _assert_current(fast, hf) -> None:
    """fastbert's output is what the weights ``fast`` holds now give: bit for bit what derived weights rebuilt from
    them give, and within the fp32 tolerance of transformers with the same weights."""
    out = _infer(fast)
    fastbert.clear_caches(fast)
    torch.testing.assert_close(out, _infer(fast), rtol=0, atol=0)
    hf.load_state_dict(fast.state_dict())
    torch.testing.assert_close(out, _infer(hf), rtol=0, atol=1e-4)


def _has_derived(model) -> bool:
    return any(m.__dict__.get(derived.ATTRIBUTE) for m in model.modules())


# --- PEFT merges -------------------------------------------------------------------------------------------------

LORA = dict(r=4, lora_alpha=8, target_modules=["query", "key", "value", "dense"], init_lora_weights=False)


@pytest.mark.parametrize("recipe", ["from_pretrained+merge_and_unload", "get_peft_model+merge_and_unload",
                                    "merge_adapter+unload"])
def test_peft_merge_after_inference(gemm, recipe, tmp_path):
    """The deployment recipes, after the base model already ran inference: PEFT writes the merged weights through
    ``.data`` and (in the first two) no forward ever sees the LoRA wrappers."""
    peft = pytest.importorskip("peft")
    hf, fast = _models()
    before = _infer(fast)
    assert _has_derived(fast)
    torch.manual_seed(1)
    if recipe == "from_pretrained+merge_and_unload":
        peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**LORA)).save_pretrained(tmp_path)
        merged = peft.PeftModel.from_pretrained(fast, tmp_path).merge_and_unload()
    elif recipe == "get_peft_model+merge_and_unload":
        merged = peft.get_peft_model(fast, peft.LoraConfig(**LORA)).merge_and_unload()
    else:
        lora = peft.get_peft_model(fast, peft.LoraConfig(**LORA))
        lora.merge_adapter()
        merged = lora.unload()
    assert merged is fast
    assert (_infer(fast) - before).abs().max() > 1e-2  # the merge changed the outputs
    _assert_current(fast, hf)


# --- optimizers ----------------------------------------------------------------------------------------------------


def _optimizers():
    """(class, fused) for every optimizer torch ships that takes dense gradients, fused where it has the option."""
    cases = []
    for name, cls in sorted(vars(torch.optim).items()):
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        if cls is torch.optim.SparseAdam:  # sparse gradients only
            continue
        cases.append(pytest.param(cls, False, id=name))
        if "fused" in inspect.signature(cls.__init__).parameters:
            cases.append(pytest.param(cls, True, id=f"{name}-fused"))
    return cases


@pytest.mark.parametrize("optimizer_class, fused", _optimizers())
def test_optimizer_step_between_inferences(gemm, optimizer_class, fused):
    """Inference, a step with no training forward in between (gradients set directly), inference: the second
    forward uses the stepped weights. Fused optimizers write without moving version counters."""
    hf, fast = _models()
    _infer(fast)
    params = [p for p in fast.parameters() if optimizer_class is not torch.optim.Muon or p.dim() == 2]
    options = {"fused": True} if fused else {}
    if optimizer_class is torch.optim.LBFGS:
        options["max_iter"] = 1  # one step like the others (20 iterations on a fixed gradient blow the weights up)
    optimizer = optimizer_class(params, lr=0.05, **options)
    generator = torch.Generator().manual_seed(2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    before = {n: p.detach().clone() for n, p in fast.named_parameters()}
    if optimizer_class is torch.optim.LBFGS:
        optimizer.step(lambda: sum((p * p.grad).sum() for p in params))
    else:
        optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in fast.named_parameters())
    _assert_current(fast, hf)


def test_optimizer_hook_moves_only_stepped_tracked_parameters():
    """The step hook moves the versions of parameters a derived tensor was built from and that the step updated
    (a gradient), nothing else: a parameter of another model, or one without a gradient, is left alone."""
    _, fast = _models()
    _infer(fast)
    other = torch.nn.Parameter(torch.randn(3))
    no_grad = fast.encoder.layer[0].attention.self.key.weight
    stepped = fast.encoder.layer[0].attention.self.query.weight
    optimizer = torch.optim.AdamW([other, no_grad, stepped], lr=0.1, fused=True)
    other.grad, stepped.grad = torch.ones(3), torch.ones_like(stepped)
    versions = [p._version for p in (other, no_grad, stepped)]
    optimizer.step()
    assert [p._version for p in (other, no_grad, stepped)] == [versions[0], versions[1], versions[2] + 1]


# --- collectives and shared memory ---------------------------------------------------------------------------------


def _broadcast_worker(rank: int, init_file: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        hf, fast = _models(seed=rank)  # the ranks start with different weights
        _infer(fast)
        for p in fast.parameters():
            dist.broadcast(p.data, src=0)  # into the parameters' memory, as DDP's and FSDP's syncs do
        out = _infer(fast)
        gathered = [torch.empty_like(out) for _ in range(2)]
        dist.all_gather(gathered, out)
        hf.load_state_dict(fast.state_dict())
        torch.save({"gathered": gathered, "expected": _infer(hf)}, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def test_broadcast_into_parameters_on_two_processes(gemm, tmp_path):
    mp.spawn(_broadcast_worker, args=(str(tmp_path / "init"), str(tmp_path / "results")), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"results.{rank}", weights_only=True)
        torch.testing.assert_close(result["gathered"][0], result["gathered"][1], rtol=0, atol=0)
        torch.testing.assert_close(result["gathered"][rank], result["expected"], rtol=0, atol=1e-4)


def _hogwild_writer(model) -> None:
    # Another process trains the shared model: its optimizer's hook moves this process's version counters only.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.3)
    optimizer.step()


def test_shared_memory_written_by_another_process(gemm):
    hf, fast = _models()
    fast.share_memory()
    before = _infer(fast)
    writer = mp.get_context("spawn").Process(target=_hogwild_writer, args=(fast,))
    writer.start()
    writer.join(timeout=120)
    assert writer.exitcode == 0
    assert (_infer(fast) - before).abs().max() > 1e-2
    _assert_current(fast, hf)


# --- a write landing while a derived tensor is being built ---------------------------------------------------------


def test_write_during_build_is_not_cached_as_current(gemm, monkeypatch):
    """Deterministic interleaving: every build finishes reading the parameters, then an in-place write lands
    (another thread's optimizer step) before the entry is published. The next forward must not use that entry."""
    hf, fast = _models()
    racing = {"on": True}

    def write_after(build):
        def racing_build(*params):
            value = build(*params)
            if racing["on"]:
                with torch.no_grad():
                    for p in params:  # (params are detached aliases: the write moves the parameters' versions)
                        p.add_(0.01)
            return value
        return racing_build

    monkeypatch.setattr(derived, "cached", _wrap_builds(derived.cached, write_after))
    _infer(fast)
    racing["on"] = False
    _assert_current(fast, hf)


def _wrap_builds(cached, wrap):
    def patched(owner, name, params, build):
        return cached(owner, name, params, wrap(build))
    return patched


# --- threads writing while others infer ----------------------------------------------------------------------------


WRITERS = {
    "sgd": lambda fast, optimizer, state: optimizer.step(),
    "adamw-fused": lambda fast, optimizer, state: optimizer.step(),
    "load_state_dict": lambda fast, optimizer, state: fast.load_state_dict(state),
    "data-copy": lambda fast, optimizer, state: [p.data.copy_(state[n]) for n, p in fast.named_parameters()],
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_inference_threads_beside_a_writer_thread(gemm, writer):
    """A model served while it is updated: two inference threads run non-stop while a writer applies 12 updates.
    Every call that started after an update returned and ended before the next began must equal transformers with
    the weights of that update (calls overlapping an update may see either; HF's may too)."""
    hf, fast = _models()
    generator = torch.Generator().manual_seed(3)
    params = list(fast.parameters())
    optimizer = (torch.optim.AdamW(params, lr=0.01, fused=True) if writer == "adamw-fused"
                 else torch.optim.SGD(params, lr=0.05))
    states = [copy.deepcopy(fast.state_dict())]
    log = {"writes": [], "calls": []}  # (start, end) of each write; (start, end, output) of each call
    done = threading.Event()

    def write():
        for _ in range(12):
            time.sleep(0.02)
            for p in params:
                p.grad = 0.2 * torch.randn(p.shape, generator=generator)
            new = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in states[-1].items()}
            start = time.perf_counter()
            WRITERS[writer](fast, optimizer, new)
            log["writes"].append((start, time.perf_counter()))
            states.append(copy.deepcopy(fast.state_dict()))
        done.set()

    def infer():
        while not done.is_set():
            start = time.perf_counter()
            out = _infer(fast)
            log["calls"].append((start, time.perf_counter(), out))

    threads = [threading.Thread(target=write)] + [threading.Thread(target=infer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writes, checked, wrong = log["writes"], 0, 0
    for start, end, out in log["calls"]:
        after = [i for i, (_, w_end) in enumerate(writes) if w_end < start]
        version = after[-1] + 1 if after else 0
        if version < len(writes) and writes[version][0] < end:
            continue  # the next write overlapped the call
        hf.load_state_dict(states[version])
        checked += 1
        wrong += not torch.allclose(out, _infer(hf), rtol=0, atol=1e-4)
    assert checked >= 12, checked
    assert wrong == 0, f"{wrong} of {checked} calls that started after an update returned used other weights"


def test_dtype_conversion_racing_inference_never_corrupts_memory(tmp_path):
    """``.to(bfloat16)``/``.to(float32)`` in one thread while another runs inference (a subprocess: memory
    corruption would abort it). transformers raises dtype errors in the overlapping calls and survives; so must
    fastbert: exceptions are allowed, a crash is not."""
    script = textwrap.dedent("""
        import copy, threading, time, torch, transformers, fastbert
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=99, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                         intermediate_size=128, max_position_embeddings=64)
        model = fastbert.optimize(transformers.BertModel(config).eval())
        ids = torch.randint(1, 99, (4, 16)); mask = torch.ones_like(ids); mask[1:, 10:] = 0
        stop, calls, errors = time.monotonic() + 4, [0], [0]
        def convert():
            while time.monotonic() < stop:
                model.to(torch.bfloat16); model.to(torch.float32)
        def infer():
            while time.monotonic() < stop:
                try:
                    with torch.inference_mode():
                        model(ids, attention_mask=mask)
                    calls[0] += 1
                except (RuntimeError, TypeError, ValueError):
                    errors[0] += 1
        threads = [threading.Thread(target=convert), threading.Thread(target=infer), threading.Thread(target=infer)]
        [t.start() for t in threads]; [t.join() for t in threads]
        print("calls", calls[0], "errors", errors[0])
    """)
    # cwd elsewhere: `python -c` puts the working directory first on sys.path, and the tests use the installed package.
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "calls" in result.stdout


# --- parameters replaced -------------------------------------------------------------------------------------------


def test_replaced_parameters_are_released_without_a_forward(gemm):
    """``load_state_dict(assign=True)`` after inference: the replaced parameters and what was derived from them
    are freed right away, not kept until the next forward."""
    hf, fast = _models()
    _infer(fast)
    old = [weakref.ref(p) for p in fast.parameters()]
    fast.load_state_dict({k: v.clone() for k, v in hf.state_dict().items()}, assign=True)
    gc.collect()
    assert all(ref() is None for ref in old)
    assert not _has_derived(fast)
    _assert_current(fast, hf)


def test_the_native_parameter_state_is_the_reference():
    """fastbert._C's ``parameter_state`` (csrc/parameter_state.cpp) gives ``derived.state_ref``'s tuple: parameters,
    inference tensors (no version counter), bfloat16, empty and meta tensors, none at all; a write through ``.data``
    (which moves no version) changes both alike; a CPU tensor that is not contiguous, or whose memory was freed,
    goes to the reference; an error the reference raises is raised too."""
    if getattr(derived._extension._C, "parameter_state", None) is None:
        pytest.skip("fastbert._C is not built here")
    linear = torch.nn.Linear(13, 7)
    with torch.inference_mode():
        frozen = torch.randn(5, 3)
    cases = [tuple(linear.parameters()), (frozen,), (torch.randn(9, dtype=torch.bfloat16), torch.empty(0)), ()]
    for params in cases:
        assert derived.state(params) == derived.state_ref(params)
    before = derived.state(tuple(linear.parameters()))
    linear.bias.data[2] += 1.0  # (28 bytes: read whole)
    after = derived.state(tuple(linear.parameters()))
    assert after[0] == before[0] and after[2] != before[2] and after == derived.state_ref(tuple(linear.parameters()))
    strided = torch.randn(4, 6).t()
    assert derived._parameter_state((strided,)) is None and derived.state((strided,)) == derived.state_ref((strided,))
    assert derived.state((torch.randn(3, device="meta"),)) == derived.state_ref((torch.randn(3, device="meta"),))
    freed = torch.nn.Parameter(torch.randn(64, 64))
    freed.untyped_storage().resize_(0)  # (as FSDP frees a sharded parameter's memory: an address of 0, nbytes kept)
    for state in (derived.state, derived.state_ref):
        with pytest.raises(ValueError, match="null data pointer"):
            state((freed,))
    with pytest.raises(AttributeError) as native:
        derived.state((torch.randn(3), "not a tensor"))
    with pytest.raises(AttributeError) as reference:
        derived.state_ref((torch.randn(3), "not a tensor"))
    assert str(native.value) == str(reference.value)
