"""The native extension ``fastbert._C``: loading it, and what it can run here.

``_C`` is torch-free (DESIGN.md section 2): it takes raw pointers, sizes, a dtype code and a CUDA stream. Each kernel's
torch side (checks, contiguity, allocation with ``torch.empty``, the op registered with ``torch.library``) lives with
the op it serves: the embedding in ``kernels/embedding.py``, the CPU attention in ``ops/attention_cpu.py``, the
int8 activation quantizer in ``int8/linear.py``, the weight fingerprint in ``derived.py``. A missing or partial ``_C``
never fails the import: the ``*_unavailable_reasons`` functions say why, and the ops' backends fall back.
"""

import functools

import torch


try:
    from . import _C

    _IMPORT_ERROR = None
except ImportError as error:  # built without the extension, or for another Python
    _C = None
    _IMPORT_ERROR = f"fastbert._C failed to import ({error}); reinstall fastbert (`pip install -v .` shows its build)"



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


def cpu_kernel_reasons(symbol: str, what: str, runs_here, needs: str, threaded: bool = True) -> tuple[str, ...]:
    """Why ``_C``'s CPU kernel ``what`` cannot run here (() when it can): no ``_C``, a ``_C`` built before it (no
    ``symbol``), a CPU without what it ``needs`` (``runs_here(_C)`` false), or, ``threaded``, a ``_C`` without OpenMP."""
    if _C is None:
        return (_IMPORT_ERROR,)
    if not hasattr(_C, symbol):
        return (f"fastbert._C predates {what}; reinstall fastbert",)
    if not runs_here(_C):
        return (f"{what} needs {needs}",)
    if threaded and not _BUILD_INFO["openmp"]:
        return (f"fastbert._C was built without OpenMP, so {what} would run on one thread",)
    return ()


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
