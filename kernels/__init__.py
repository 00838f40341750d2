"""Triton kernels of fastbert, installed as ``fastbert.kernels``.

One op per module, each read top to bottom: the pure-PyTorch ``*_ref``, the ``@triton.jit`` kernel, the launcher
(checks, allocation, grid) and the op registered with ``torch.library``. ``fastbert.dispatch`` decides when they run.
``_common`` holds what they share: the launch helper (CUDA tensors: compiled; CPU tensors: Triton's interpreter),
block sizes and warps, argument checks.
"""
