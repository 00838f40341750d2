"""The ``st-onnx-int8`` and ``st-openvino-int8`` providers: sentence-transformers' own int8 backends, used as its
documentation shows a user, on the shared weights.

    the HF model (fp32, the shared weights) and a tokenizer of its vocabulary, saved as a sentence-transformers
    folder (Transformer, mean Pooling)
      st-onnx-int8:     SentenceTransformer(folder, backend="onnx") (optimum's ONNX export), then
                        export_dynamic_quantized_onnx_model(model, "avx512_vnni" | "avx512" | "avx2"): onnxruntime's
                        dynamic quantization with optimum's preset for the CPU's widest int8 instructions
      st-openvino-int8: SentenceTransformer(folder, backend="openvino") (optimum-intel's export), then
                        export_static_quantized_openvino_model(model, OVQuantizationConfig()): NNCF's post-training
                        quantization, calibrated on fastbert's guard sentences (the bench's openvino-int8 uses the
                        same ones; sentence-transformers pads them to 384 tokens, as it does its default dataset)
      reloaded from the quantized file with torch's thread count (onnxruntime: intra-op threads, no spinning between
      calls, as the ort provider; OpenVINO: INFERENCE_NUM_THREADS, as openvino-int8), its other settings
      sentence-transformers' (OpenVINO: PERFORMANCE_HINT=LATENCY); the forward is the backend model
      sentence-transformers' ``encode`` calls (``model[0].auto_model``) on the bench's inputs.

Optional: each is skipped with a reason where sentence-transformers' extra is not installed. On 2026-11-26 pip
resolves them only with transformers < 4.58 (optimum-onnx 0.1.0 and optimum-intel 1.27.0), so they run in a second
environment (benchmarks/README.md).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import tempfile
import warnings
from types import SimpleNamespace

import torch

from .models import ModelSet, guard_sentences, int8_anchor_tokenizer

# (export_static_quantized_openvino_model needs datasets, which neither extra installs)
BACKEND_PACKAGES = {"onnx": ("optimum", "optimum.onnxruntime", "onnxruntime"),
                    "openvino": ("optimum", "optimum.intel", "openvino", "nncf", "datasets")}


def st_missing(backend: str) -> str | None:
    """Why sentence-transformers' ``backend`` ("onnx" or "openvino") cannot run here, or None."""
    missing = []
    for name in ("sentence_transformers",) + BACKEND_PACKAGES[backend]:
        parent = name.rpartition(".")[0]
        if parent in missing:  # (find_spec of a submodule imports its parent)
            continue
        if importlib.util.find_spec(name) is None:
            missing.append(name)
    if missing:
        return (f"{', '.join(missing)} not installed: pip install 'sentence-transformers[{backend}]'"
                + (" datasets" if backend == "openvino" else "") + ", which on 2026-11-26 resolves only with "
                "transformers < 4.58 (a second environment: benchmarks/README.md)")
    return None


def _onnx_preset() -> str:
    """optimum's dynamic-quantization preset for this CPU's widest int8 instructions (what a user picks)."""
    flags = open("/proc/cpuinfo", encoding="utf-8").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512_vnni" in flags:
        return "avx512_vnni"
    return "avx512" if " avx512f" in flags else "avx2"


def _save_st_folder(ms: ModelSet, tokenizer, folder: str) -> None:
    from sentence_transformers import SentenceTransformer, models

    hf_folder = os.path.join(folder, "hf")
    ms.hf("eager").save_pretrained(hf_folder)
    tokenizer.save_pretrained(hf_folder)
    transformer = models.Transformer(hf_folder, max_seq_length=ms.spec.max_seq_len)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), "mean")
    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(os.path.join(folder, "st"))


def _calibration_folder(folder: str) -> str:
    """The guard's sentences as a local dataset (train.csv, column "sentence") that ``datasets`` loads by path."""
    path = os.path.join(folder, "calibration")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "train.csv"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence"])
        writer.writerows([sentence] for sentence in guard_sentences())
    return path


def _ort_session_options():
    """The ort provider's settings: torch's thread count, one inter-op thread, no spinning between calls (spinning
    threads would take the cores from the provider timed next)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = torch.get_num_threads(), 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def build_st_int8(ms: ModelSet, opts, log, backend: str):
    tokenizer = int8_anchor_tokenizer(ms, st_missing(backend), "to save with the model")
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    name = f"st-{backend}-int8"
    # (the folder lives as long as the forward: the backends may read their files after loading, as OpenVINO maps
    # its weights)
    folder = tempfile.TemporaryDirectory(prefix=f"fastbench-{name}-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _save_st_folder(ms, tokenizer, folder.name)
        st_folder = os.path.join(folder.name, "st")
        exported = SentenceTransformer(st_folder, backend=backend, device="cpu")
        if backend == "onnx":
            preset = _onnx_preset()
            sentence_transformers.export_dynamic_quantized_onnx_model(exported, preset, st_folder)
            file_name, how = f"onnx/model_qint8_{preset}.onnx", f"dynamic quantization, optimum's {preset} preset"
            settings = {"session_options": _ort_session_options(), "provider": "CPUExecutionProvider"}
        else:
            from optimum.intel import OVQuantizationConfig

            sentence_transformers.export_static_quantized_openvino_model(
                exported, OVQuantizationConfig(), st_folder, dataset_name=_calibration_folder(folder.name),
                dataset_config_name="default", dataset_split="train", column_name="sentence")
            file_name = "openvino/openvino_model_qint8_quantized.xml"
            how = "NNCF static quantization (OVQuantizationConfig()), calibrated on the guard's sentences"
            settings = {"ov_config": {"INFERENCE_NUM_THREADS": torch.get_num_threads()}}
        model = SentenceTransformer(st_folder, backend=backend, device="cpu",
                                    model_kwargs={"file_name": file_name, **settings})
        backend_model = model[0].auto_model
    log(f"  {name}: sentence-transformers {sentence_transformers.__version__}, {how}; "
        f"{torch.get_num_threads()} threads")

    def forward(inputs, _files=folder):  # (the folder held: see above)
        out = backend_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        return SimpleNamespace(last_hidden_state=torch.as_tensor(out.last_hidden_state))

    return forward
