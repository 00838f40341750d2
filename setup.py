"""Build of fastbert: the pure-Python package plus the torch-free native extension ``fastbert._C``.

``_C`` includes no torch header (DESIGN.md section 2), so ``pip install .`` builds it under build isolation with
only setuptools, wheel and pybind11, and it never breaks against the user's torch. It always has the C++ CPU kernel
(with OpenMP when the compiler supports it) and, when nvcc is found, the CUDA kernel:

- nvcc: ``$CUDA_HOME/bin/nvcc``, ``$CUDA_PATH/bin/nvcc``, else ``nvcc`` on PATH. ``FASTBERT_SKIP_CUDA_BUILD=1`` skips CUDA.
- archs: ``FASTBERT_CUDA_ARCH_LIST`` ("8.0;9.0" or "sm_80,sm_90"), default sm_75, sm_80, sm_86, sm_89, sm_90 (those
  this nvcc knows); SASS for each, plus PTX of the highest so newer GPUs can JIT it.
- cudart is linked statically: importing ``_C`` needs no libcuda, only calling the CUDA kernel needs a driver.

``pip install -v .`` shows the build's summary line; ``fastbert._C.build_info()`` says the same at run time.
"""

import json
import os
import re
import shutil
import subprocess

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup
from setuptools.errors import CompileError, LinkError

CUDA_SOURCES = ["csrc/embedding_layer_norm_cuda.cu"]
# Turing (T4) to Hopper: the GPUs BERT inference runs on today. Newer GPUs JIT the PTX of the highest.
DEFAULT_CUDA_ARCHS = (75, 80, 86, 89, 90)


def find_nvcc() -> tuple[str | None, str]:
    """(nvcc, "") or (None, why not): the places a CUDA toolkit announces itself, in the usual order."""
    if os.environ.get("FASTBERT_SKIP_CUDA_BUILD", "0") not in ("", "0"):
        return None, "FASTBERT_SKIP_CUDA_BUILD is set"
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            nvcc = os.path.join(home, "bin", "nvcc")
            if os.path.isfile(nvcc):
                return nvcc, ""
            return None, f"{variable}={home} has no bin/nvcc"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return nvcc, ""


def nvcc_output(nvcc: str, *args: str) -> str:
    return subprocess.run([nvcc, *args], check=True, capture_output=True, text=True).stdout


def nvcc_library_dirs(nvcc: str) -> list[str]:
    """Where libcudart_static.a lives, as nvcc itself resolves it (its -dryrun LIBRARIES line): robust to nvcc
    being a wrapper script or a symlink outside the toolkit, and to targets/<arch>/lib layouts."""
    dryrun = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                            capture_output=True, text=True).stderr
    line = next((l for l in dryrun.splitlines() if l.startswith("#$ LIBRARIES=")), "")
    return [os.path.normpath(d) for d in re.findall(r'-L"?([^"\s]+)', line) if not d.rstrip("/").endswith("stubs")]


def parse_archs(text: str) -> list[int]:
    """"8.0;9.0", "sm_80,sm_90", "80 90" or "compute_90" -> [80, 90]."""
    archs = []
    for token in filter(None, re.split(r"[;,\s]+", text)):
        match = re.fullmatch(r"(?:sm_|compute_)?(\d+)(?:\.(\d))?", token)
        if match is None:
            raise ValueError(f"FASTBERT_CUDA_ARCH_LIST: cannot read {token!r} (examples: 8.0;9.0 or sm_80,sm_90)")
        major, minor = match.groups()
        archs.append(int(major) * 10 + int(minor) if minor is not None else int(major))
    return sorted(set(archs))


def cuda_archs(nvcc: str) -> list[int]:
    """SASS targets: FASTBERT_CUDA_ARCH_LIST as given (an arch nvcc lacks fails the build loudly), else the
    defaults this nvcc supports (CUDA 13 dropped sm_50..sm_72; older toolkits lack sm_89/sm_90)."""
    requested = os.environ.get("FASTBERT_CUDA_ARCH_LIST", "").strip()
    if requested:
        return parse_archs(requested)
    known = set(parse_archs(nvcc_output(nvcc, "--list-gpu-arch")))
    archs = [arch for arch in DEFAULT_CUDA_ARCHS if arch in known]
    if not archs:
        raise RuntimeError(f"{nvcc} supports none of sm_{DEFAULT_CUDA_ARCHS}; set FASTBERT_CUDA_ARCH_LIST")
    return archs


def has_openmp(compiler, tmp_dir: str) -> bool:
    """Whether this compiler builds and links an OpenMP program with -fopenmp (gcc and Linux clang do; Apple clang
    and compilers without libgomp/libomp do not: those get a single-threaded CPU kernel)."""
    os.makedirs(tmp_dir, exist_ok=True)
    source = os.path.join(tmp_dir, "openmp_check.cpp")
    with open(source, "w") as f:
        f.write("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
    try:
        objects = compiler.compile([source], output_dir=tmp_dir, extra_postargs=["-fopenmp"])
        compiler.link_executable(objects, "openmp_check", output_dir=tmp_dir, extra_postargs=["-fopenmp"])
    except (CompileError, LinkError):
        return False
    return True


class BuildExt(build_ext):
    """pybind11's build_ext, plus OpenMP detection and the .cu sources compiled by nvcc and linked in."""

    def build_extensions(self):
        (ext,) = self.extensions
        # Always rebuild: what gets built depends on the environment (FASTBERT_* variables, nvcc), which the
        # source-timestamp check behind an up-to-date build/ directory cannot see.
        self.force = True
        openmp = has_openmp(self.compiler, os.path.join(self.build_temp, "openmp_check"))
        if openmp:
            ext.extra_compile_args.append("-fopenmp")
            ext.extra_link_args.append("-fopenmp")

        nvcc, skip_reason = find_nvcc()
        if nvcc is None:
            ext.define_macros.append(("FASTBERT_CUDA_SKIP_REASON", json.dumps(skip_reason)))
            summary = f"CUDA skipped: {skip_reason}"
        else:
            summary = self.add_cuda(ext, nvcc)
        print(f"fastbert._C: CPU kernel with OpenMP {'yes' if openmp else 'no'}; {summary}", flush=True)
        super().build_extensions()

    def add_cuda(self, ext: Pybind11Extension, nvcc: str) -> str:
        """Compile the .cu files into objects linked into ``ext`` with a static cudart; returns the summary."""
        version = re.search(r"release (\d+\.\d+)", nvcc_output(nvcc, "--version")).group(1)
        archs = cuda_archs(nvcc)
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        os.makedirs(self.build_temp, exist_ok=True)
        for source in CUDA_SOURCES:
            obj = os.path.join(self.build_temp, os.path.basename(source) + ".o")
            # No --use_fast_math: the LayerNorm keeps IEEE division and sqrt. --threads 0: one nvcc job per arch.
            command = [nvcc, "-c", source, "-o", obj, "-O3", "-std=c++17", "-DNDEBUG", "-Icsrc", "--threads", "0",
                       "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", *gencode]
            print(" ".join(command), flush=True)
            if subprocess.run(command).returncode != 0:
                raise RuntimeError(f"nvcc failed on {source} (output above); FASTBERT_SKIP_CUDA_BUILD=1 builds "
                                   "the CPU kernel only")
            ext.extra_objects.append(obj)
        ext.define_macros += [
            ("FASTBERT_WITH_CUDA", None),
            ("FASTBERT_CUDA_VERSION", json.dumps(version)),
            ("FASTBERT_CUDA_ARCHS", json.dumps(" ".join(f"sm_{a}" for a in archs))),
            ("FASTBERT_CUDA_PTX", json.dumps(f"compute_{archs[-1]}")),
        ]
        ext.library_dirs += nvcc_library_dirs(nvcc)
        ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
        # Keep the static cudart's symbols private to _C: exported, they could bind to (or be bound by) the
        # libcudart.so that torch loads RTLD_GLOBAL, mixing two CUDA runtimes' state.
        ext.extra_link_args.append("-Wl,--exclude-libs,ALL")
        return (f"CUDA {version} ({nvcc}): SASS {', '.join(f'sm_{a}' for a in archs)}, "
                f"PTX compute_{archs[-1]}")


setup(
    # Every package under fastbert/ (found, so a new one cannot be left out of the wheel), and kernels/ installed as
    # fastbert.kernels, never as a top-level `kernels`: PyPI has a package of that name (transformers >= 5.25 depends
    # on it), and kernels/ has no __init__.py so that, from the repository root, it never shadows that package
    # (fastbert/_checkout.py). fastbert.kernels is therefore a namespace package, found by path like any other.
    packages=["fastbert", *(f"fastbert.{name}" for name in find_packages("fastbert")), "fastbert.kernels",
              "fastbert.data"],
    package_dir={"fastbert": "fastbert", "fastbert.kernels": "kernels"},
    package_data={"fastbert.data": ["*.txt"]},  # the int8 guard's sentences
    ext_modules=[
        Pybind11Extension(
            "fastbert._C",
            ["csrc/bindings.cpp", "csrc/attention_cpu.cpp", "csrc/attention_int8_cpu.cpp",
             "csrc/embedding_layer_norm_cpu.cpp", "csrc/fingerprint.cpp", "csrc/gemm_cpu.cpp",
             "csrc/gemm_int8_cpu.cpp", "csrc/layer_norm_cpu.cpp", "csrc/module_tree.cpp", "csrc/parameter_state.cpp",
             "csrc/quantize_cpu.cpp", "csrc/token_indices.cpp"],
            include_dirs=["csrc"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
