"""The ``ort`` and ``ort-int8`` providers: the HF model exported to ONNX and run by onnxruntime on the CPU.

    HF model, attn_implementation="eager", fp32, on the shared weights
      -> torch.onnx.export (TorchScript exporter, opset 17), inputs input_ids and attention_mask [batch, seq] with
         dynamic batch and seq axes, output last_hidden_state
      -> onnxruntime.transformers.optimizer.optimize_model(model_type="bert", num_heads, hidden_size): fuses the
         embedding + LayerNorm (EmbedLayerNormalization), attention (Attention), residual + LayerNorm
         (SkipLayerNormalization) and bias + GELU (BiasGelu)
      -> ort-int8 only: onnxruntime.quantization.quantize_dynamic, s8 weights per channel (7-bit without VNNI/AMX),
         u8 activations quantized per call (MatMulInteger / DynamicQuantizeLinear)
      -> onnxruntime.InferenceSession, CPUExecutionProvider, intra-op threads = torch.get_num_threads()

The export traces the model once, on a batch of 2 with one padded row, so that neither the batch size nor the padding
mask is specialised into the graph; every case's output is still checked against hf-sdpa before it is timed, like any
provider's. ORT's intra-op threads do not spin between calls (``session.intra_op.allow_spinning=0``): providers are
interleaved in one process, and spinning workers would steal the cores from the next provider's call.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import warnings
from types import SimpleNamespace

import torch

from .models import ModelSet, Unavailable

FUSED_OPS = ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu")


def ort_missing() -> str | None:
    """Why the ort provider cannot run in this environment, or None."""
    missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                "(pip install onnxruntime onnx, or the bench extra)")
    return None


class _LastHiddenState(torch.nn.Module):
    """input_ids, attention_mask -> last_hidden_state: the graph ORT runs."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def export_onnx(ms: ModelSet, path: str) -> None:
    """HF eager attention, fp32, on the shared weights, to ``path`` with dynamic [batch, seq] axes."""
    model = ms.new_hf("eager", "fp32").cpu()
    wrapper = _LastHiddenState(model).eval()
    seq = 16
    ids = torch.randint(3, ms.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))  # > pad ids
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq // 2:] = 0  # a padded row: the padding mask must be traced, not folded away
    ids = ids.masked_fill(mask == 0, ms.config.pad_token_id or 0)
    axes = {0: "batch", 1: "seq"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings about Python control flow on shapes
        torch.onnx.export(wrapper, (ids, mask), path, input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"], opset_version=17, do_constant_folding=True,
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes},
                          dynamo=False)


def build_ort(ms: ModelSet, opts, log=print, int8: bool = False):
    """The forward of the ort provider for ``ms`` (``int8``: of ort-int8): raises Unavailable where it cannot run."""
    reason = ort_missing()
    if reason:
        raise Unavailable(reason)
    if ms.device.type != "cpu":
        raise Unavailable("runs on the CPU only (onnxruntime's CPUExecutionProvider)")
    if ms.dtype != "fp32":
        raise Unavailable(f"runs fp32 only (this case is {ms.dtype})")
    import onnxruntime as ort

    folder = tempfile.TemporaryDirectory(prefix="fastbench-ort-")
    try:
        path = _fused_onnx(ms, folder.name, log)
        if int8:
            path = _quantized_onnx(path, log)
        so = ort.SessionOptions()
        so.intra_op_num_threads = torch.get_num_threads()
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    finally:
        folder.cleanup()  # the session holds the model in memory

    def forward(inputs):
        feed = {"input_ids": inputs["input_ids"].cpu().numpy(),
                "attention_mask": inputs["attention_mask"].cpu().numpy()}
        (out,) = session.run(["last_hidden_state"], feed)
        return SimpleNamespace(last_hidden_state=torch.from_numpy(out))

    return forward


def _fused_onnx(ms: ModelSet, folder: str, log) -> str:
    """Export ``ms`` and fuse it with ORT's BERT optimizer; the fused model's path."""
    from onnxruntime.transformers import optimizer

    hidden, _, _, heads = ms.sizes
    raw, fused = os.path.join(folder, "model.onnx"), os.path.join(folder, "model.opt.onnx")
    t0 = time.perf_counter()
    try:
        export_onnx(ms, raw)
        t1 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimized = optimizer.optimize_model(raw, model_type="bert", num_heads=heads, hidden_size=hidden)
        stats = optimized.get_fused_operator_statistics()
        optimized.save_model_to_file(fused)
        del optimized
    except Exception as e:  # an exporter or optimizer limitation: report it, run the other providers
        raise Unavailable(f"ONNX export/optimization of {ms.name} failed: {type(e).__name__}: {e}") from e
    counts = ", ".join(f"{op} {stats.get(op, 0)}" for op in FUSED_OPS)
    log(f"  ort: exported {ms.name} (eager attention, fp32) in {t1 - t0:.1f} s, optimized in "
        f"{time.perf_counter() - t1:.1f} s; fused ops: {counts}")
    missing = [op for op in FUSED_OPS if not stats.get(op)]
    if missing:
        log(f"  note: ort: optimize_model fused no {', '.join(missing)} for {ms.name} "
            "(those parts run as separate ONNX ops)")
    return fused


def _quantized_onnx(fused: str, log) -> str:
    """ORT's dynamic int8 quantization of the fused model, per channel, as ORT advises for transformers: 7-bit
    weights (``reduce_range``) on CPUs without VNNI/AMX, where u8 x s8 products saturate; the quantized path."""
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from fastbert.int8.choices import weight_bits

    out = fused.replace(".opt.onnx", ".int8.onnx")
    reduce_range = weight_bits() == 7
    # (the fused graph's contrib ops carry no shape inference: their outputs are float32, as ORT's message advises)
    quantize_dynamic(fused, out, weight_type=QuantType.QInt8, per_channel=True, reduce_range=reduce_range,
                     extra_options={"DefaultTensorType": TensorProto.FLOAT})
    log(f"  ort-int8: quantize_dynamic per channel, {'7' if reduce_range else '8'}-bit weights")
    return out
