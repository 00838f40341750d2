"""Shared fixtures of the test suite."""

# ---------------------------------------------------------------------------------------------------------------
# Model-level tests (tests/test_model_*.py): fastbert next to transformers.BertModel, and the one comparison rule.
#
# The rule is flash-attention's (tests/models/test_bert.py there): run fastbert and HF in the same dtype, and HF in
# float64 as the reference; fastbert's error must be at most twice HF's own error plus a tiny atol (a fraction of the
# dtype's ulp at the outputs' magnitude, ~4). In fp32 fastbert must also be within 1e-4 of HF. Only real tokens are
# compared: the packed path leaves zeros at padding positions by design, where HF's values carry no meaning.
# ---------------------------------------------------------------------------------------------------------------

import copy
import dataclasses
import faulthandler
import os
import tempfile

import machine_load
import pytest
import torch
import transformers

import fastbert

# Enabled before pytest's own handler, so pytest re-enables it when the session ends: a crash while the interpreter
# exits (Ray's, Spark's or a library's threads after the summary) prints every thread's Python frames.
faulthandler.enable(all_threads=True)

# This machine's GEMM measurements (fastbert/cpu.py) go to a folder of the test session's own: tests and the
# processes they start share it, nothing outside is read or written, and it is removed when the session ends.
_CACHE_DIR = tempfile.TemporaryDirectory(prefix="fastbert-cache-")
os.environ["FASTBERT_CACHE_DIR"] = _CACHE_DIR.name
# A fixed thread count: fastbert's CPU forwards otherwise follow the load of the machine (fastbert/threads.py), and
# tests comparing two forwards bit for bit would depend on what else runs. tests/test_threads.py unsets it.
os.environ.setdefault("FASTBERT_NUM_THREADS", str(torch.get_num_threads()))

@pytest.fixture
def int8_on(fastbert_env):
    """Int8 GEMMs forced on (``FASTBERT_CPU_INT8=on``), so int8 tests do not depend on this CPU's measurement;
    skipped where the int8 linear this CPU's weight bits take cannot run."""
    from fastbert.int8 import choices as int8, linear as int8_linear

    reasons = int8_linear.unavailable_reasons(int8.weight_bits())
    if reasons:
        pytest.skip("; ".join(reasons))
    fastbert_env(FASTBERT_CPU_INT8="on")


@pytest.fixture
def measurements_kept(monkeypatch):
    """Every one-time measurement of this test is trusted, whatever else keeps the machine busy: fastbert reads the
    machine as quiet (tests/machine_load.py). For tests of what the store does with a measurement, not of how
    fastbert tells a busy machine (tests/test_store.py has those)."""
    monkeypatch.setattr(fastbert.threads, "sample", machine_load.Load(others=0))


# dtype -> (atol of the 2x rule, max |fastbert - HF| in that dtype or None)
MODEL_TOLERANCES = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, None),
    torch.bfloat16: (1e-2, None),
}


def _small_bert_config(**overrides) -> transformers.BertConfig:
    """A few-layer BERT that runs in milliseconds on CPU; dropout off so train/eval and HF/fastbert agree."""
    values = dict(
        vocab_size=99,
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    values.update(overrides)
    return transformers.BertConfig(**values)


def eager_attention(model: transformers.PreTrainedModel) -> None:
    """Have ``model`` run transformers' eager attention, the plain math (``set_attn_implementation`` from 4.54; before
    it, a float64 model's SDPA runs torch's math kernel, as precise)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, biases and LayerNorm included (HF's init zeroes biases, which would hide a kernel that
    drops one). Weights ~ N(0, 1/fan_in), so attention is neither uniform nor one-hot."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            if "LayerNorm.weight" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embeddings" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


@dataclasses.dataclass
class BertTrio:
    """The same weights three ways: fastbert and HF in ``dtype``, and HF in float64 (eager attention) as reference."""

    config: transformers.BertConfig
    fast: torch.nn.Module
    hf: torch.nn.Module
    ref: torch.nn.Module

    def run(self, *args, **kwargs):
        """(fastbert, HF, reference) outputs for the same inputs, without autograd."""
        with torch.no_grad():
            return self.fast(*args, **kwargs), self.hf(*args, **kwargs), self.ref(*args, **kwargs)


@pytest.fixture
def small_bert_config():
    """Factory: ``small_bert_config(**overrides) -> BertConfig``."""
    return _small_bert_config


@pytest.fixture
def bert_trio():
    """Factory: ``bert_trio(config_or_overrides, dtype=fp32, seed=0, add_pooling_layer=True, unpad=True)``."""

    def make(config=None, dtype=torch.float32, seed=0, add_pooling_layer=True, unpad=True, **overrides):
        if config is None:
            config = _small_bert_config(**overrides)
        torch.manual_seed(seed)
        hf = transformers.BertModel(config, add_pooling_layer=add_pooling_layer).eval()
        _randomize_(hf, seed)
        fast = fastbert.BertModel(config, add_pooling_layer=add_pooling_layer, unpad=unpad).eval()
        fast.load_state_dict(hf.state_dict(), strict=True)
        ref = copy.deepcopy(hf).double()
        eager_attention(ref)  # the plain math, in float64
        return BertTrio(config, fast.to(dtype), hf.to(dtype), ref)

    return make


def _assert_matches_hf(out, out_hf, out_ref, real=None, *, dtype=None, name="output"):
    """fastbert ``out`` vs HF ``out_hf`` (same dtype) and the float64 ``out_ref``, on ``real`` positions only.

    real: bool mask over the leading dims of the outputs (e.g. the attention mask, [B, S]), or None for all.
    """
    dtype = dtype or out.dtype
    atol, max_vs_hf = MODEL_TOLERANCES[dtype]
    assert out.shape == out_hf.shape == out_ref.shape, (name, out.shape, out_hf.shape, out_ref.shape)
    assert out.dtype == out_hf.dtype == dtype, (name, out.dtype, out_hf.dtype)
    if real is not None:
        real = real.bool()
        out, out_hf, out_ref = out[real], out_hf[real], out_ref[real]
    assert torch.isfinite(out).all(), f"{name}: fastbert output has non-finite values"
    out, out_hf, out_ref = out.double(), out_hf.double(), out_ref.double()
    err = (out - out_ref).abs().max().item() if out.numel() else 0.0
    err_hf = (out_hf - out_ref).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * err_hf + atol, (
        f"{name} ({dtype}): fastbert's error vs float64 {err:.3g} > 2 x HF's {err_hf:.3g} + {atol:g}"
    )
    if max_vs_hf is not None and out.numel():
        diff = (out - out_hf).abs().max().item()
        assert diff <= max_vs_hf, f"{name} ({dtype}): max |fastbert - HF| = {diff:.3g} > {max_vs_hf:g}"


@pytest.fixture
def assert_matches_hf():
    """``assert_matches_hf(out, out_hf, out_ref, real=None, dtype=None, name=...)``: the 2x rule above."""
    return _assert_matches_hf


@pytest.fixture
def input_checks_off():
    """Range checks off for one test, back on afterwards whatever happens."""
    before = fastbert.validation.input_checks_enabled()
    fastbert.set_input_checks(False)
    try:
        yield
    finally:
        fastbert.set_input_checks(before)


# ---------------------------------------------------------------------------------------------------------------
# Kernel tests (tests/test_kernels_*.py, tests/test_embedding_ext.py): the devices they run on. A missing GPU skips
# the test at run time, never a probe at import. Their comparison rule is in tests/kernel_checks.py.
# ---------------------------------------------------------------------------------------------------------------


def _device_or_skip(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(name)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def interpreter_unusable() -> str | None:
    """Why Triton's interpreter cannot run here, or None: before Triton 3.9 it calls int() on 1-element numpy
    arrays, which numpy 2.4 made an error (every interpreted attention launch fails)."""
    try:
        import numpy
        import triton
    except ImportError:
        return None
    if _version(triton.__version__) < (3, 9) and _version(numpy.__version__) >= (2, 4):
        return (f"triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__} (int() of a "
                "1-element array; fixed in triton 3.9): interpreted tests skip, the CUDA ones run")
    return None


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """cpu: Triton's interpreter (the C++ CPU kernel in test_embedding_ext.py); cuda: the compiled kernels
    (skipped without a GPU)."""
    why = interpreter_unusable()
    if request.param == "cpu" and why and request.module.__name__.startswith("test_kernels_"):
        pytest.skip(why)
    return _device_or_skip(request.param)


@pytest.fixture
def cuda_device():
    """The current CUDA device, for tests of GPU-only code (skipped without a GPU)."""
    return _device_or_skip("cuda")


READ_BACKS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def read_backs(monkeypatch):
    """Every host read of tensor data during the test, as "<method> on <device type>" (a read of GPU data is a
    device sync; a read of CPU data costs nothing)."""
    counts = []
    for name in READ_BACKS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts.append(f"{_name} on {self.device.type}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.fixture(autouse=True)
def _environment_settings():
    """fastbert reads its environment variables once: each test starts from the environment as it is."""
    fastbert.dispatch.reload_settings()


@pytest.fixture
def fastbert_env(monkeypatch):
    """fastbert_env(FASTBERT_BACKEND="triton", ...): set environment variables for this test and have fastbert read
    them again (undone after the test)."""

    def set_env(**values: str) -> None:
        why = interpreter_unusable()
        if values.get("TRITON_INTERPRET", "0") != "0" and why:
            pytest.skip(why)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        fastbert.dispatch.reload_settings()

    return set_env
