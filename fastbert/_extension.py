"""The torch side of the native extension ``fastbert._C``: loading it, saying what it can run here, and its ops.

``_C`` is torch-free (DESIGN.md section 2): it takes raw pointers, sizes, a dtype code and a CUDA stream. This module
checks the tensors, makes them contiguous, allocates outputs with ``torch.empty`` and registers each kernel with
``torch.library``, so ``torch.compile(fullgraph=True)`` and CUDA graphs see one opaque op. A missing or partial
``_C`` never fails the import: the ``*_unavailable_reasons`` functions say why, and ``fastbert.dispatch`` falls back.
"""

import functools

import torch

from .kernels._common import launch_or_op
from .kernels.embedding import check_embedding_args

try:
    from . import _C

    _IMPORT_ERROR = None
except ImportError as error:  # built without the extension, or for another Python
    _C = None
    _IMPORT_ERROR = f"fastbert._C failed to import ({error}); reinstall fastbert (`pip install -v .` shows its build)"

# dtype codes of csrc/embedding_layer_norm.h's DType.
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_CPU_DTYPES = (torch.float32, torch.bfloat16)


if _C is None:
    _BUILD_INFO = {"cpu": False, "openmp": False, "cuda": False, "cuda_version": None, "archs": [], "ptx": None,
                   "cuda_skip_reason": None, "error": _IMPORT_ERROR}
else:
    _BUILD_INFO = dict(_C.build_info())


def build_info() -> dict:
    """What ``_C`` contains: cpu, openmp, cuda, cuda_version ("13.0"), archs (["sm_75", ...]), ptx ("compute_90"),
    cuda_skip_reason (why CUDA was not built); plus ``error`` when ``_C`` did not import."""
    return {key: list(value) if isinstance(value, list) else value for key, value in _BUILD_INFO.items()}


def cpu_unavailable_reasons() -> list[str]:
    return [_IMPORT_ERROR] if _C is None else []


def cuda_unavailable_reasons(device) -> list[str]:
    """Why ``_C``'s CUDA kernels cannot run on ``device`` ([] when they can). Cheap after the first call per device."""
    if _C is None:
        return [_IMPORT_ERROR]
    if not _BUILD_INFO["cuda"]:
        return [f"fastbert._C was built without CUDA ({_BUILD_INFO['cuda_skip_reason']})"]
    if not torch.cuda.is_available():
        return ["torch sees no CUDA device"]
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return list(_cuda_reasons(index))


def _runs_on(capability: int, archs: list[str], ptx: str | None) -> bool:
    """CUDA's compatibility rules: SASS for sm_XY runs on X.Z with Z >= Y (same major); PTX for compute_N is
    JIT-compiled for any device >= N."""
    sass = [int(arch.removeprefix("sm_")) for arch in archs]
    if any(arch // 10 == capability // 10 and arch <= capability for arch in sass):
        return True
    return ptx is not None and int(ptx.removeprefix("compute_")) <= capability


@functools.cache
def _cuda_reasons(index: int) -> tuple[str, ...]:
    archs, ptx = _BUILD_INFO["archs"], _BUILD_INFO["ptx"]
    major, minor = torch.cuda.get_device_capability(index)
    if not _runs_on(major * 10 + minor, archs, ptx):
        also_ptx = f" and PTX {ptx}" if ptx else ""
        return (f"fastbert._C was built for {', '.join(archs)}{also_ptx}, this GPU is sm_{major}{minor} "
                f"(reinstall with FASTBERT_CUDA_ARCH_LIST={major}.{minor})",)
    with torch.cuda.device(index):
        problem = _C.cuda_probe()  # e.g. a driver older than the CUDA runtime _C was built with
    return (f"fastbert._C's CUDA kernels cannot run on cuda:{index}: {problem}",) if problem else ()


def has_fingerprint() -> bool:
    return _C is not None and hasattr(_C, "fingerprint")


def fingerprint(tensors: list[torch.Tensor]) -> int:
    """``_C.fingerprint`` of contiguous CPU tensors (the caller holds them while this reads their memory)."""
    return _C.fingerprint([t.data_ptr() for t in tensors], [t.numel() * t.element_size() for t in tensors])


def _check_embedding_args(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps):
    """The op's contract (kernels/embedding.py's ``check_embedding_args``: metadata only, fake tensors too), plus
    what ``_C`` itself takes: int64 ids, cpu or cuda tensors, and on CPU float32 or bfloat16 only."""
    check_embedding_args(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)
    for name, ids in (("input_ids", input_ids), ("position_ids", position_ids), ("token_type_ids", token_type_ids)):
        if ids.dtype != torch.int64:
            raise TypeError(f"{name} must be int64 for fastbert._C, got {ids.dtype}")
    if word.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fastbert._C runs on cpu and cuda tensors, not {word.device.type}")
    if word.device.type == "cpu" and word.dtype not in _CPU_DTYPES:
        raise TypeError(f"the C++ CPU kernel takes float32 or bfloat16, not {word.dtype}")


def _embedding_layer_norm_launch(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias,
                                 eps) -> torch.Tensor:
    # The kernel reads raw pointers, so every tensor is pinned first: a detached alias holds the storage and the
    # dtype it has now, even if another thread re-points the parameter meanwhile (``model.to(torch.bfloat16)``
    # swaps and frees parameters' storage). Everything below reads the aliases only: a conversion racing this call
    # gives a consistent old call or a dtype error, never a kernel writing past its output.
    tensors = [t.detach() for t in (input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias)]
    input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias = tensors
    _check_embedding_args(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)
    if _C is None:
        raise RuntimeError(_IMPORT_ERROR)
    # The kernels read raw pointers as dense row-major arrays; contiguous() is free when they already are.
    tensors = [t.contiguous() for t in tensors]
    out = torch.empty((input_ids.shape[0], word.shape[1]), dtype=word.dtype, device=word.device)
    if out.numel() == 0:
        return out
    args = (out.data_ptr(), *(t.data_ptr() for t in tensors), out.shape[0], out.shape[1], word.shape[0],
            position.shape[0], token_type.shape[0], float(eps), _DTYPE_CODES[word.dtype])
    if word.device.type == "cuda":
        with torch.cuda.device(word.device):
            _C.embedding_layer_norm_cuda(*args, torch.cuda.current_stream().cuda_stream)
    else:
        _C.embedding_layer_norm_cpu(*args, torch.get_num_threads())
    return out


@torch.library.custom_op("fastbert::embedding_layer_norm_ext", mutates_args=())
def _embedding_layer_norm_op(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    token_type_ids: torch.Tensor,
    word: torch.Tensor,
    position: torch.Tensor,
    token_type: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    return _embedding_layer_norm_launch(input_ids, position_ids, token_type_ids, word, position, token_type, weight,
                                        bias, eps)


@_embedding_layer_norm_op.register_fake
def _(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps):
    _check_embedding_args(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)
    return word.new_empty((input_ids.shape[0], word.shape[1]))


def embedding_layer_norm(input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps):
    """``LayerNorm(word[input_ids] + position[position_ids] + token_type[token_type_ids]) * weight + bias``.

    input_ids, position_ids, token_type_ids: [tokens] int64 (dense [B*S] or packed); word: [vocab, hidden],
    position: [max_positions, hidden], token_type: [type_vocab, hidden], weight, bias: [hidden], one float dtype
    (float32/bfloat16 on CPU, also float16 on CUDA), one device. Returns [tokens, hidden]; statistics in fp32.
    Indices outside a table are clamped into it (callers validate ranges first). Raises TypeError/ValueError
    before any launch when the arguments do not fit; non-contiguous inputs are copied, not refused.
    """
    return launch_or_op(_embedding_layer_norm_launch, _embedding_layer_norm_op,
                        input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, eps)


def attention_cpu_unavailable_reasons() -> list[str]:
    """Why ``attention_cpu`` cannot run here ([] when it can): a property of this build and CPU, found once."""
    return list(_attention_cpu_reasons())


@functools.cache
def _attention_cpu_reasons() -> tuple[str, ...]:
    if _C is None:
        return (_IMPORT_ERROR,)
    if not hasattr(_C, "attention_cpu"):
        return ("fastbert._C predates the CPU attention kernel; reinstall fastbert",)
    if not _C.attention_cpu_isas():
        return ("fastbert's CPU attention kernel needs an x86-64 CPU with AVX2 and FMA",)
    if not _BUILD_INFO["openmp"]:
        return ("fastbert._C was built without OpenMP, so its CPU attention would run on one thread",)
    return ()


def attention_cpu_isas() -> list[str]:
    """The instruction sets the CPU attention can run with here, fastest first ("avx512", "avx2")."""
    return [] if attention_cpu_unavailable_reasons() else list(_C.attention_cpu_isas())


def _check_attention_cpu_args(qkv, seqlens, relative_bias, window, columns, isa=""):
    if qkv.device.type != "cpu" or qkv.dtype != torch.float32 or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be a float32 CPU tensor [tokens, 3, heads, head_dim], got {tuple(qkv.shape)} "
                         f"{qkv.dtype} on {qkv.device}")
    if any(length < 0 for length in seqlens) or sum(seqlens) != qkv.shape[0]:
        raise ValueError(f"seqlens must be >= 0 and add up to qkv's {qkv.shape[0]} tokens, got {list(seqlens)}")
    if relative_bias is not None and (relative_bias.dtype != torch.float32 or relative_bias.device.type != "cpu"
                                      or relative_bias.dim() != 2 or relative_bias.shape[0] != qkv.shape[2]
                                      or relative_bias.shape[1] % 2 == 0):
        raise ValueError(f"relative_bias must be a float32 CPU tensor [heads, 2 * radius + 1] = [{qkv.shape[2]}, odd], "
                         f"got {tuple(relative_bias.shape)} {relative_bias.dtype} on {relative_bias.device}")
    if isa and isa not in attention_cpu_isas():
        raise ValueError(f"isa must be one of {attention_cpu_isas()} on this CPU, or '' for the fastest, got {isa!r}")
    if window is not None and window < 0:
        raise ValueError(f"window must be None or >= 0, got {window}")
    if columns is not None and (columns.dtype != torch.int32 or columns.shape != (qkv.shape[0],)
                                or columns.device.type != "cpu"):
        raise ValueError(f"columns must be an int32 CPU tensor [{qkv.shape[0]}], got {tuple(columns.shape)} "
                         f"{columns.dtype} on {columns.device}")


def _attention_cpu_launch(qkv, seqlens, relative_bias, window, columns, isa="") -> torch.Tensor:
    tensors = [None if t is None else t.detach().contiguous() for t in (qkv, relative_bias, columns)]
    qkv, relative_bias, columns = tensors
    _check_attention_cpu_args(qkv, seqlens, relative_bias, window, columns, isa)
    reasons = attention_cpu_unavailable_reasons()
    if reasons:
        raise RuntimeError(reasons[0])
    heads, head_dim = qkv.shape[2], qkv.shape[3]
    out = qkv.new_empty(qkv.shape[0], heads, head_dim)
    _C.attention_cpu(out.data_ptr(), qkv.data_ptr(), list(seqlens), heads, head_dim,
                     0 if relative_bias is None else relative_bias.data_ptr(),
                     0 if relative_bias is None else (relative_bias.shape[1] - 1) // 2,
                     -1 if window is None else window, 0 if columns is None else columns.data_ptr(),
                     head_dim ** -0.5, torch.get_num_threads(), isa)
    return out


@torch.library.custom_op("fastbert::attention_cpu", mutates_args=())
def _attention_cpu_op(qkv: torch.Tensor, seqlens: list[int], relative_bias: torch.Tensor | None,
                      window: int | None, columns: torch.Tensor | None, isa: str) -> torch.Tensor:
    return _attention_cpu_launch(qkv, seqlens, relative_bias, window, columns, isa)


@_attention_cpu_op.register_fake
def _(qkv, seqlens, relative_bias, window, columns, isa):
    _check_attention_cpu_args(qkv, seqlens, relative_bias, window, columns, isa)
    return qkv.new_empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])


def attention_cpu(qkv: torch.Tensor, seqlens, relative_bias: torch.Tensor | None = None, window: int | None = None,
                  columns: torch.Tensor | None = None, isa: str = "") -> torch.Tensor:
    """Padding-free float32 attention on the CPU, forward only (csrc/attention_cpu.h; reference:
    ``kernels/attention.py``'s ``attention_varlen_ref``): qkv [T, 3, H, D] -> [T, H, D], sequence b the next
    ``seqlens[b]`` rows. relative_bias: None or float32 [H, 2R + 1] by distance j - i clamped to [-R, R]; window:
    None or the largest distance a query sees; columns: None (distances between offsets) or int32 [T], the tokens'
    columns (a mask with holes); isa: one of ``attention_cpu_isas()``, "" for the fastest (tests run each). Raises
    ValueError before the kernel runs when the arguments do not fit."""
    return launch_or_op(_attention_cpu_launch, _attention_cpu_op, qkv, list(seqlens), relative_bias, window, columns,
                        isa)

