"""What the kernel files share: running a kernel on CPU or CUDA tensors, block-size settings, argument checks.

CPU tensors through Triton's interpreter, in a normal process
-------------------------------------------------------------
Triton 3.x decides between compiling and interpreting when ``@triton.jit`` *decorates* a function (at import, for
our kernels and for ``tl.sum``/``tl.max`` in ``triton.language.standard`` alike), from ``TRITON_INTERPRET``. Setting
the variable later (a fixture, ``monkeypatch.setenv``) changes nothing, and forcing it process-wide would also
interpret every CUDA launch and make the dispatch pick Triton for every CPU op. So the kernels are plain
``triton.jit`` functions and the launchers call ``for_device(kernel, device)``:

- CUDA tensors: the compiled kernel, exactly what ``triton.jit`` built, launched with the tensors' GPU current;
- CPU tensors: the same Python source run by Triton's interpreter (``InterpretedFunction``; numpy, slow: for tests,
  and for ``fastbert.dispatch`` under ``TRITON_INTERPRET=1``). A CPU tensor can run a Triton kernel no other way.
  While such a launch runs, a ``@triton.jit`` device function called from the kernel (``tl.sum``, our helpers) is
  run by its interpreted twin: the same thing ``TRITON_INTERPRET=1`` at import would have built. The interpreter
  patches ``triton.language`` while a launch runs; this patches ``JITFunction.__call__`` the same way, and makes
  sure every patch is undone afterwards, so CUDA kernels compiled later in the process are unaffected (tested).
  Interpreted launches are serialized by a lock.

If ``TRITON_INTERPRET=1`` is set before triton is imported, every kernel is an ``InterpretedFunction`` already and
runs as Triton documents (CUDA tensors included). Without triton installed (a Linux-only dependency) these modules
still import, so the ``*_ref`` functions and the torch path work; launching a kernel raises a RuntimeError.
"""

import contextlib
import functools
import threading
import types

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is not installed
    HAS_TRITON = False
    JITFunction = None


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            "fastbert's Triton kernels need the triton package (pip install triton; Linux only). "
            "The torch backend (FASTBERT_BACKEND=torch) runs without it."
        )


if not HAS_TRITON:

    class _MissingTriton:
        """Stands in for the triton module: kernels can be defined (``@triton.jit`` returns the function), and
        anything else (``triton.cdiv`` in a launcher) raises ``require_triton``'s error."""

        @staticmethod
        def jit(fn):
            return fn

        def __getattr__(self, name):
            require_triton()

    triton = _MissingTriton()
    tl = types.SimpleNamespace(constexpr=object)  # kernel signatures annotate with tl.constexpr


_interpreted: dict = {}  # python function -> its InterpretedFunction
_interpret_lock = threading.Lock()


def _interpreted_twin(fn):
    if fn not in _interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted[fn] = InterpretedFunction(fn)
    return _interpreted[fn]


def _call_interpreted(self, *args, **kwargs):
    # Replaces JITFunction.__call__ during an interpreted launch: a device function called from the kernel. Does what
    # InterpretedFunction.__call__ does, but undoes its patches of triton.language on return: Triton leaves them in
    # place (harmless when every kernel is interpreted), and they would break the next compilation of a CUDA kernel.
    from triton.runtime.interpreter import _patch_lang

    scope = _patch_lang(self.fn)
    try:
        return _interpreted_twin(self.fn).rewrite()(*args, **kwargs)
    finally:
        if scope is not None:  # Triton 3.9 returns the scope of what it patched
            scope.restore()


@contextlib.contextmanager
def _device_functions_interpreted():
    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original


# a * b + c contracted into one FMA in compiled kernels (one rounding instead of two: faster and at least as
# accurate). Triton 3.9 defaults to it with a warning that 3.10 will not; pinned so every version builds the same.
ENABLE_FP_FUSION = True


class _Launcher:
    """``for_device(kernel, device)[grid](*args, **meta)``: launches ``kernel`` the way ``device`` needs."""

    def __init__(self, kernel, device: torch.device):
        self.device = device
        self.interpret = device.type == "cpu" and isinstance(kernel, JITFunction)
        self.kernel = _interpreted_twin(kernel.fn) if self.interpret else kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs.setdefault("enable_fp_fusion", ENABLE_FP_FUSION)
            if self.interpret:
                with _interpret_lock, _device_functions_interpreted():
                    return self.kernel[grid](*args, **kwargs)
            if self.device.type == "cuda":
                # Triton launches on the current device and stream: make that the tensors' GPU.
                with torch.cuda.device(self.device):
                    return self.kernel[grid](*args, **kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@functools.lru_cache(maxsize=None)
def for_device(kernel, device: torch.device) -> _Launcher:
    """The launchable form of ``kernel`` for tensors on ``device``: interpreted on CPU, compiled on CUDA (one per
    kernel and device, built once: a launch costs host time on every layer)."""
    require_triton()
    return _Launcher(kernel, device)


def _probe():
    pass


# Whether triton.jit builds interpreted kernels in this process (TRITON_INTERPRET set before import): asked of
# triton.jit itself, as the kernel modules decorate right after importing this one.
_INTERPRET_ALL = HAS_TRITON and not isinstance(triton.jit(_probe), JITFunction)


def interpreting(device: torch.device) -> bool:
    """Whether a launch on ``device`` runs under the interpreter (then small blocks keep the tests fast)."""
    return device.type == "cpu" or _INTERPRET_ALL


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The largest row a one-row-per-program kernel (LayerNorm, embedding) holds in registers: 64 KiB of fp32 would
# spill badly; BERT hidden sizes go to 4096 at most (8192 for the largest RoBERTa-likes).
MAX_FUSED_SIZE = 65536


def direct_launch(*tensors: torch.Tensor | None) -> bool:
    """Whether to call a kernel's launcher directly instead of its registered op: in eager code on plain tensors (no
    torch.compile or export tracing, no fake-tensor or other dispatch mode, no torch.func transform on any argument),
    where the op's dispatcher only adds host time (~6-13 µs a call: at small batches a GPU forward is bound by host
    time). Tracing, fake tensors and torch.func need the op (its fake implementation, schema and fallbacks)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(
        t is None or (type(t) in plain and not torch._C._functorch.is_functorch_wrapped_tensor(t)) for t in tensors
    )


def launch_or_op(launch, op, *args):
    """``launch(*args)`` where ``direct_launch`` allows it (eager, plain tensors), else the registered ``op(*args)``."""
    return (launch if direct_launch(*(a for a in args if isinstance(a, torch.Tensor))) else op)(*args)


@functools.lru_cache(maxsize=None)
def calculate_settings(n: int) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for a kernel that holds one row of ``n`` elements per program.

    BLOCK_SIZE is ``n`` rounded up to a power of two (loads are masked past ``n``); warps grow with the row so each
    thread keeps a handful of elements in registers: 4 up to 1024 elements (BERT-base/large rows), then 8, 16, 32.
    """
    require_triton()
    block = triton.next_power_of_2(n)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"a row of {n} elements exceeds the fused kernels' limit of {MAX_FUSED_SIZE}")
    if block >= 32768:
        num_warps = 32
    elif block >= 8192:
        num_warps = 16
    elif block >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return block, num_warps


# ---------------------------------------------------------------------------------------------------------------
# Argument checks shared by the launchers and the fake (meta) implementations. They read metadata only (no sync).
# ---------------------------------------------------------------------------------------------------------------


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, shape: tuple[int, ...]) -> None:
    """``t`` has ``ref``'s dtype and device and the given shape."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides {tuple(t.stride())}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Compiling without a GPU: the interpreter runs a kernel's Python, not what the compiler makes of it (constexpr
# branches, types across loop iterations, shared memory, register pressure). Triton ships the whole toolchain,
# ptxas included, so a kernel can be built for a GPU target on any machine; the tests do it for sm_90 (H100).
# ---------------------------------------------------------------------------------------------------------------

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.bool: "*i1",
}


def compilable(kernel) -> bool:
    """Whether ``kernel`` can be compiled in this process (not if TRITON_INTERPRET=1 was set at import)."""
    return HAS_TRITON and isinstance(kernel, JITFunction)


def compile_for_gpu(kernel, *args, arch: int = 90, num_warps: int = 4, num_stages: int = 3, **constexprs):
    """Build ``kernel`` for CUDA compute capability ``arch`` (90: H100) as a launch with these arguments would, on
    any machine (no GPU needed). Tensors stand for pointers (their dtype, and whether ``data_ptr()`` is 16-byte
    aligned: ``torch.empty(0)`` is), ints for i32/i64 scalars (constexprs when equal to 1, 16-divisible when they
    are), floats for fp32: the specialization a real launch computes. Returns the compiled kernel, whose
    ``metadata.shared`` is its shared memory in bytes and ``asm["cubin"]`` the binary."""
    require_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    if not compilable(kernel):
        raise RuntimeError("TRITON_INTERPRET=1 was set when triton was imported: kernels are interpreted only here")
    names = kernel.arg_names
    if len(args) + len(constexprs) != len(names):
        raise TypeError(f"{kernel.__name__} takes {len(names)} arguments, got {len(args)} + {len(constexprs)}")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    signature, constants, attrs = {}, dict(constexprs), {}
    for index, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, float):
            signature[name] = "fp32"
            continue
        if not isinstance(value, (torch.Tensor, int)):
            raise TypeError(f"{name}: cannot type {value!r}")
        # Specialize exactly as JITFunction.run does. The 16-divisibility hints matter: without them Triton emits
        # scalar instead of vector loads and ptxas allocates registers differently, so a build without them says
        # nothing about the spills of the kernel a GPU runs (the attention's fp32 config was picked from such a
        # build and spilled 656 bytes per thread in the real one). Also types bool tensors as Triton does (*u1).
        kind, spec = _specialize(backend, value)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(index,)] = backend.parse_attr(spec)
    for name in constexprs:
        signature[name] = "constexpr"
    source = ASTSource(kernel, {name: signature[name] for name in names}, constexprs=constants, attrs=attrs)
    return triton.compile(
        source,
        target=target,
        options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=ENABLE_FP_FUSION),
    )


def _specialize(backend, value) -> tuple:
    """(type, specialization) of a launch argument, by Triton's own rules where this Triton exposes them."""
    try:
        from triton.runtime.jit import native_specialize_impl  # Triton >= 3.4
    except ImportError:  # older Triton: the same rules, written out
        if isinstance(value, torch.Tensor):
            return _POINTER_TYPES[value.dtype], "D" if value.data_ptr() % 16 == 0 else ""
        if isinstance(value, bool) or value == 1:
            return "constexpr", value
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), "D" if value % 16 == 0 else ""
    return native_specialize_impl(type(backend), value, False, True, True)
