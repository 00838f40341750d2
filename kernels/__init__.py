"""Triton kernels of fastbert, installed as ``fastbert.kernels``.

One kernel per module, each read top to bottom: the pure-PyTorch ``*_ref``, the ``@triton.jit`` kernel, the launcher
(checks, allocation, grid) and the op registered with ``torch.library`` (the embedding's is registered once, with
fastbert._C's kernel beside it, in ``fastbert/ops/embedding.py``). Each op's module in ``fastbert/ops/`` declares the
``triton`` backend that runs them, and ``fastbert.dispatch`` decides when it does.
``_common`` holds what they share: the launch helper (CUDA tensors: compiled; CPU tensors: Triton's interpreter),
block sizes and warps, argument checks.
"""
