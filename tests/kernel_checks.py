"""The comparison rule of the kernel tests (tests/test_kernels_*.py): ``from kernel_checks import ...``.

Rule (flash-attention's): fp32 within ``fp32_tol`` (1e-5 unless a test says otherwise) of the fp32 reference; fp16/bf16
error vs the fp32 reference at most twice that of PyTorch computing in the same dtype, plus ``ATOL[dtype]``.
The ``device`` fixture (cpu: Triton's interpreter; cuda: the compiled kernels) is in conftest.py.
"""

import pytest
import torch

ATOL = {torch.float16: 5e-4, torch.bfloat16: 4e-3}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


def max_error(out: torch.Tensor, ref32: torch.Tensor) -> float:
    """max |out - ref32| in fp32; 0 for empty tensors."""
    return (out.float() - ref32).abs().max().item() if out.numel() else 0.0


def assert_close_to_ref(out, ref32, same_dtype, fp32_tol=1e-5):
    """``out`` vs the fp32 reference ``ref32``; ``same_dtype`` is PyTorch's result in ``out``'s dtype."""
    assert out.dtype == same_dtype.dtype and out.shape == ref32.shape
    assert not out.isnan().any()
    err = (out.float() - ref32).abs()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref32, atol=fp32_tol, rtol=fp32_tol)
    elif out.dtype == torch.bfloat16 and out.device.type == "cpu":
        # Triton 3.9's interpreter casts fp32 -> bf16 by truncation (GPUs round to nearest even), so on CPU each
        # bf16 output may be off by up to one bf16 ulp (2**-7 relative) of the exact value: checked per element.
        ulp = torch.ldexp(torch.ones_like(ref32), torch.frexp(ref32)[1] - 8)
        assert (err <= ulp + ATOL[out.dtype]).all(), (err - ulp).max()
    else:
        assert err.max().item() <= 2 * max_error(same_dtype, ref32) + ATOL[out.dtype]


def cubin_resources(compiled) -> tuple[int, int] | None:
    """(registers, stack bytes) per thread of a kernel built by ``compile_for_gpu``, read from its cubin with the
    cuobjdump Triton ships; None where that tool is missing. Stack bytes > 0 means ptxas spilled registers."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return None if found is None else (int(found.group(1)), int(found.group(2)))
