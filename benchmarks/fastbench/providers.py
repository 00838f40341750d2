"""What is timed: each provider turns a ``ModelSet`` into a forward ``inputs -> output with .last_hidden_state``.

To add one, append a ``Provider`` to ``PROVIDERS``. ``build`` raises ``Unavailable`` (with the reason) where it cannot
run for a model or dtype: the run reports that and goes on with the others. ``missing`` says why it cannot run in this
environment at all (a package not installed, an API fastbert does not have yet). Every provider but the baseline is
checked against hf-sdpa on real tokens before it is timed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch

from .models import ModelSet, Unavailable, bert_tokenizer, is_fastbert

Forward = Callable[[dict], object]  # inputs (input_ids, attention_mask) -> model output with .last_hidden_state
Log = Callable[[str], None]
BASELINE = "hf-sdpa"


@dataclass(frozen=True)
class Provider:
    name: str
    help: str
    devices: tuple[str, ...]  # devices it runs on
    default_on: tuple[str, ...]  # devices where it is in the default --providers
    build: Callable[[ModelSet, argparse.Namespace, Log], Forward]
    checked: bool = True  # validated against hf-sdpa before timing (all but the baseline)
    missing: Callable[[], str | None] = lambda: None  # why it cannot run in this environment, or None
    quantized: bool = False  # int8 or bf16: checked by pooled cosine (check.check_quantized), not the fp32 rule


def _module_forward(model: torch.nn.Module) -> Forward:
    def forward(inputs):
        with torch.inference_mode():
            return model(**inputs)

    return forward


def _build_hf_compile(ms: ModelSet, opts, log) -> Forward:
    for limit in ("recompile_limit", "cache_size_limit"):  # one graph per shape: allow a sweep's worth
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 256))
    compiled = torch.compile(ms.hf("sdpa"), mode=opts.compile_mode, dynamic=False)
    cudagraphs = ms.device.type == "cuda" and opts.compile_mode == "reduce-overhead"

    def forward(inputs):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            return compiled(**inputs)

    return forward


def _fastbert_model(ms: ModelSet, log) -> torch.nn.Module:
    """fastbert on ``ms``'s weights; Unavailable when fastbert does not accelerate this family (yet)."""
    try:
        model, warned = ms.fastbert()
    except NotImplementedError as e:
        raise Unavailable(f"fastbert does not support {ms.name}: {e}") from e
    for w in warned:
        log(f"  note: building fastbert for {ms.name} warned: {w}")
    if not is_fastbert(model):
        raise Unavailable(f"fastbert.optimize returned {type(model).__name__} unchanged: this fastbert has no "
                          f"adapter for the {ms.family} family, so there is nothing of fastbert's to time")
    return model


def _build_fastbert(ms: ModelSet, opts, log) -> Forward:
    return _module_forward(_fastbert_model(ms, log))


def _build_fastbert_graphs(ms: ModelSet, opts, log) -> Forward:
    import fastbert

    # Each shape of the sweep is a bucket of fastbert's defaults: its graph is captured during the warm-up.
    return _module_forward(fastbert.cuda_graphs(_fastbert_model(ms, log)))


def _build_fastbert_int8(ms: ModelSet, opts, log) -> Forward:
    """fastbert.quantize of the fastbert model, with its guard on the shipped sentences where a tokenizer of the
    model's vocabulary is at hand (BERT's: all-MiniLM-L6-v2's), else without (its output check still runs)."""
    import fastbert

    if ms.device.type != "cpu" or ms.dtype != "fp32":
        raise Unavailable("fastbert.quantize runs float32 models on the CPU")
    model = _fastbert_model(ms, log)
    tokenizer = bert_tokenizer() if ms.config.vocab_size == 30522 else None
    fastbert.quantize(model, guard=tokenizer is not None, tokenizer=tokenizer)
    report = fastbert.info()["int8"]["models"][-1]
    if report["outcome"] != "int8":
        raise Unavailable(f"fastbert.quantize kept {ms.name} in float32: {report.get('why')}")
    figures = ", ".join(f"{k} {report[k]}" for k in ("mean_cosine", "p1_cosine", "min_cosine") if k in report)
    log(f"  fastbert-int8: {report['isa']}; recipe: {report['recipe']}; static activation scales in "
        f"{len(report.get('static_layers') or [])} layers; int8 attention in "
        f"{len(report.get('attention_layers') or [])} layers; float32 layers: {report['float32_layers'] or 'none'}"
        + (f"; guard: {figures}" if figures else "; no guard (no tokenizer)"))
    return _module_forward(model)


def _build_ort_int8(ms: ModelSet, opts, log) -> Forward:
    from .ort_provider import build_ort

    return build_ort(ms, opts, log, int8=True)


def _openvino_missing() -> str | None:
    from .openvino_provider import openvino_missing

    return openvino_missing()


def _build_openvino(ms: ModelSet, opts, log, precision: str | None = None) -> Forward:
    from .openvino_provider import build_openvino

    return build_openvino(ms, opts, log, precision)


def _build_fastbert_bf16(ms: ModelSet, opts, log) -> Forward:
    """The fastbert model cast to bf16, in a float32 case: beside OpenVINO's default (bf16 where the CPU has it)."""
    from fastbert import cpu

    if ms.device.type != "cpu" or ms.dtype != "fp32":
        raise Unavailable("fastbert-bf16 is the CPU bf16 column of a float32 case (--dtype bf16 times bf16 cases)")
    if not cpu.native_bf16():
        raise Unavailable("this CPU has no native bf16 (AVX512_BF16 or AMX): bf16 is emulated, slower than float32")
    return _module_forward(_fastbert_model(ms, log).to(torch.bfloat16))


def _build_openvino_int8(ms: ModelSet, opts, log, precision: str | None = None) -> Forward:
    from .openvino_provider import build_openvino_int8

    return build_openvino_int8(ms, opts, log, precision)


def _st_missing(backend: str) -> str | None:
    from .st_provider import st_missing

    return st_missing(backend)


def _build_st_int8(ms: ModelSet, opts, log, backend: str) -> Forward:
    from .st_provider import build_st_int8

    return build_st_int8(ms, opts, log, backend)


def _ort_missing() -> str | None:
    from .ort_provider import ort_missing

    return ort_missing()


def _build_ort(ms: ModelSet, opts, log) -> Forward:
    from .ort_provider import build_ort

    return build_ort(ms, opts, log)


def _compile_missing() -> str | None:
    return None if hasattr(torch, "compile") else f"torch {torch.__version__} has no torch.compile"


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in [
        Provider("hf-eager", "the transformers model, attn_implementation='eager'", ("cpu", "cuda"), ("cpu", "cuda"),
                 lambda ms, opts, log: _module_forward(ms.hf("eager"))),
        Provider(BASELINE, "the transformers model, attn_implementation='sdpa' (the baseline of speedup_vs_hf_sdpa "
                 "and the reference of the output check)", ("cpu", "cuda"), ("cpu", "cuda"),
                 lambda ms, opts, log: _module_forward(ms.hf("sdpa")), checked=False),
        Provider("hf-compile", "torch.compile(hf-sdpa model, mode=--compile-mode, dynamic=False); default on cuda, "
                 "--compile (or --providers) adds it on cpu (inductor C++ codegen; compiles once per shape)",
                 ("cpu", "cuda"), ("cuda",), _build_hf_compile, missing=_compile_missing),
        Provider("fastbert", "fastbert.BertModel(config) (unpad=True) on the same weights; other families: "
                 "fastbert.optimize(HF model), unavailable where it leaves the model unchanged", ("cpu", "cuda"),
                 ("cpu", "cuda"), _build_fastbert),
        Provider("fastbert-graphs", "fastbert.cuda_graphs(fastbert model): the encoder replayed from CUDA graphs "
                 "(cuda only)", ("cuda",), ("cuda",), _build_fastbert_graphs),
        Provider("ort", "onnxruntime (CPU, fp32): the HF model exported to ONNX with eager attention and fused by "
                 "onnxruntime.transformers.optimizer (model_type='bert'); threads = torch's; needs onnxruntime",
                 ("cpu",), ("cpu",), _build_ort, missing=_ort_missing),
        Provider("fastbert-int8", "fastbert.quantize(fastbert model): int8 GEMMs through oneDNN, guarded on real "
                 "sentences where a tokenizer of its vocabulary is at hand (cpu, fp32); checked by pooled cosine",
                 ("cpu",), (), _build_fastbert_int8, quantized=True),
        Provider("ort-int8", "ort, then onnxruntime.quantization.quantize_dynamic (s8 weights per channel, 7-bit "
                 "without VNNI/AMX); checked by pooled cosine; needs onnxruntime", ("cpu",), (), _build_ort_int8,
                 missing=_ort_missing, quantized=True),
        Provider("fastbert-bf16", "the fastbert model cast to bf16, beside OpenVINO's default in a float32 case (cpu "
                 "with native bf16); checked by pooled cosine", ("cpu",), (), _build_fastbert_bf16, quantized=True),
        Provider("openvino", "OpenVINO on the ort provider's float32 ONNX export, at its default precision (bf16 on a "
                 "CPU with AVX512_BF16 or AMX); checked by pooled cosine; needs openvino", ("cpu",), (),
                 _build_openvino, missing=_openvino_missing, quantized=True),
        Provider("openvino-f32", "openvino with INFERENCE_PRECISION_HINT=f32; checked by pooled cosine; needs "
                 "openvino", ("cpu",), (), lambda ms, opts, log: _build_openvino(ms, opts, log, "f32"),
                 missing=_openvino_missing, quantized=True),
        Provider("openvino-int8", "OpenVINO: the ort provider's ONNX export, nncf.quantize (8-bit, transformer "
                 "preset) calibrated on fastbert's guard sentences, compiled for the CPU; checked by pooled cosine; "
                 "needs openvino and nncf", ("cpu",), (), _build_openvino_int8, missing=_openvino_missing,
                 quantized=True),
        Provider("openvino-int8-f32", "openvino-int8 with INFERENCE_PRECISION_HINT=f32: what is not int8 (attention, "
                 "softmax, LayerNorm) in float32, as fastbert-int8 runs it, where openvino-int8's default may be bf16",
                 ("cpu",), (), lambda ms, opts, log: _build_openvino_int8(ms, opts, log, "f32"),
                 missing=_openvino_missing, quantized=True),
        Provider("st-onnx-int8", "sentence-transformers' ONNX backend as its documentation shows: the model saved as "
                 "a sentence-transformers folder, export_dynamic_quantized_onnx_model with optimum's preset for the "
                 "CPU (avx512_vnni, avx512 or avx2); checked by pooled cosine; needs sentence-transformers[onnx]",
                 ("cpu",), (), lambda ms, opts, log: _build_st_int8(ms, opts, log, "onnx"),
                 missing=lambda: _st_missing("onnx"), quantized=True),
        Provider("st-openvino-int8", "sentence-transformers' OpenVINO backend as its documentation shows: "
                 "export_static_quantized_openvino_model(OVQuantizationConfig()) calibrated on fastbert's guard "
                 "sentences; checked by pooled cosine; needs sentence-transformers[openvino]", ("cpu",), (),
                 lambda ms, opts, log: _build_st_int8(ms, opts, log, "openvino"),
                 missing=lambda: _st_missing("openvino"), quantized=True),
    ]
}


def build_forwards(ms: ModelSet, names: list[str], opts, log, keep_going: bool = False) -> tuple[dict, dict]:
    """({provider: forward}, {provider: reason it did not build}) for the providers ``names`` on ``ms``.

    ``Unavailable`` is a reason; any other exception propagates, unless ``keep_going`` (--keep-going) turns it into a
    reason too (never for the baseline: without it no case can be checked).
    """
    forwards, skipped = {}, {}
    for name in names:
        try:
            forwards[name] = PROVIDERS[name].build(ms, opts, log)
        except Unavailable as e:
            skipped[name] = str(e)
        except Exception as e:
            if not keep_going or name == BASELINE:
                raise
            skipped[name] = f"error while building: {type(e).__name__}: {e}"
    return forwards, skipped


def provider_missing(name: str) -> str | None:
    """Why provider ``name`` cannot run in this environment (never raises)."""
    try:
        return PROVIDERS[name].missing()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
