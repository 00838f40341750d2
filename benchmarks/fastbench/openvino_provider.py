"""The ``openvino-int8`` provider: the HF model quantized by OpenVINO's post-training quantization, on the CPU.

    HF model, attn_implementation="eager", fp32, on the shared weights
      -> the ONNX export of the ort provider (``ort_provider.export_onnx``: dynamic batch and sequence axes)
      -> openvino.Core().read_model
      -> nncf.quantize(model_type=TRANSFORMER): 8-bit weights and activations, calibrated here on fastbert's guard
         sentences (``fastbert/data/int8_guard.txt``) tokenized with a tokenizer of the model's vocabulary
      -> compile_model("CPU"), INFERENCE_NUM_THREADS = torch.get_num_threads(), its other settings its defaults
         (on a CPU with bf16 arithmetic, AVX512_BF16 or AMX, that runs the float parts in bf16: the log says)

Optional: skipped with a reason where openvino or nncf is not installed, and for models whose vocabulary has no
tokenizer at hand to calibrate with (BERT's 30522: all-MiniLM-L6-v2's).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings
from types import SimpleNamespace

import torch

from .models import ModelSet, Unavailable, guard_sentences, int8_anchor_tokenizer


def openvino_missing() -> str | None:
    missing = [m for m in ("openvino", "nncf") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install openvino nncf, or the bench extra)"
    return None


def _calibration(tokenizer) -> list[dict]:
    """The guard's sentences as feeds of 8, padded per batch (numpy int64 input_ids and attention_mask)."""
    sentences = guard_sentences()
    feeds = []
    for i in range(0, len(sentences), 8):
        batch = tokenizer(sentences[i:i + 8], padding=True, truncation=True, max_length=128, return_tensors="np")
        feeds.append({"input_ids": batch["input_ids"].astype("int64"),
                      "attention_mask": batch["attention_mask"].astype("int64")})
    return feeds


def build_openvino(ms: ModelSet, opts, log=print, precision: str | None = None):
    """OpenVINO on the float model (the ort provider's ONNX export, no quantization): ``precision`` its
    INFERENCE_PRECISION_HINT ("f32"), or None for its default (bf16 on a CPU with AVX512_BF16 or AMX)."""
    if ms.device.type != "cpu" or ms.dtype != "fp32":
        raise Unavailable("OpenVINO reads the float32 export, on the CPU")
    missing = openvino_missing()
    if missing:
        raise Unavailable(missing)
    import openvino as ov

    from .ort_provider import export_onnx

    core = ov.Core()
    with tempfile.TemporaryDirectory(prefix="fastbench-openvino-") as folder:
        path = os.path.join(folder, "model.onnx")
        export_onnx(ms, path)
        model = core.read_model(path)
    settings = {"INFERENCE_NUM_THREADS": torch.get_num_threads()}
    if precision is not None:
        settings["INFERENCE_PRECISION_HINT"] = precision
    compiled = core.compile_model(model, "CPU", settings)
    name = "openvino" if precision is None else f"openvino-{precision}"
    log(f"  {name}: OpenVINO {ov.__version__}, inference precision {compiled.get_property('INFERENCE_PRECISION_HINT')}"
        + (" (its default here)" if precision is None else ""))
    return _compiled_forward(compiled)


def _compiled_forward(compiled):
    def forward(inputs):
        feed = {"input_ids": inputs["input_ids"].cpu().numpy(),
                "attention_mask": inputs["attention_mask"].cpu().numpy()}
        out = compiled(feed)[0]
        return SimpleNamespace(last_hidden_state=torch.from_numpy(out.copy()))

    return forward


def build_openvino_int8(ms: ModelSet, opts, log=print, precision: str | None = None):
    """``precision``: OpenVINO's INFERENCE_PRECISION_HINT ("f32"), None for its default."""
    tokenizer = int8_anchor_tokenizer(ms, openvino_missing(), "to calibrate with")
    import nncf
    import openvino as ov

    from .ort_provider import export_onnx

    core = ov.Core()
    with tempfile.TemporaryDirectory(prefix="fastbench-openvino-") as folder:
        path = os.path.join(folder, "model.onnx")
        export_onnx(ms, path)
        model = core.read_model(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantized = nncf.quantize(model, nncf.Dataset(_calibration(tokenizer)),
                                      model_type=nncf.ModelType.TRANSFORMER, subset_size=300)
    settings = {"INFERENCE_NUM_THREADS": torch.get_num_threads()}
    if precision is not None:
        settings["INFERENCE_PRECISION_HINT"] = precision
    compiled = core.compile_model(quantized, "CPU", settings)
    # (on CPUs with bf16 arithmetic OpenVINO runs what is not int8 — attention, softmax, LayerNorm — in bf16 unless
    # asked for f32: said, as fastbert keeps them float32)
    name = "openvino-int8" if precision is None else f"openvino-int8-{precision}"
    log(f"  {name}: OpenVINO {ov.__version__}, NNCF {nncf.__version__} (transformer preset), calibrated on "
        f"the guard's sentences; inference precision {compiled.get_property('INFERENCE_PRECISION_HINT')}"
        + (" (its default here)" if precision is None else ""))
    return _compiled_forward(compiled)
