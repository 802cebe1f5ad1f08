"""Compiler flags and toolkit discovery of the nac_fast._C extension: one definition for setup.py
(the build) and tools/cuda_resources.py (ptxas' per-kernel register/spill/shared-memory report),
so the report describes the code that is built.

Plain Python, standard library only, no side effects at import.  csrc/ is not a package: both
users load this file by path (load_build_flags() in setup.py, _build_flags() in the bench script).

Precision note for NVCC_FLAGS: no --use_fast_math.  It turns tanhf into MUFU.TANH (relative error
~2^-11) and expf into an unscaled MUFU.EX2 (error growing with |x|), far outside the 1e-5 fp32
budget the CPU kernel is tested to; no fast intrinsic is used without a measured error table.
"""
from __future__ import annotations

import glob
import os

DEFAULT_CUDA_ARCHS = "8.0;9.0"  # TORCH_CUDA_ARCH_LIST when unset: A100, H100/H200

# Host C++ (.cpp).  -fno-trapping-math lets GCC if-convert the selects of nac_math.h (torch
# builds with it too).
CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"]
NATIVE_CXX_FLAGS = ["-march=native"]  # NAC_FAST_NATIVE=1
# Python's sysconfig CFLAGS, which torch's BuildExtension puts first on the command line, carry -g:
# debug information about doubles the C++ compile time and makes the object files and
# nac_fast._C many times larger.  -g0, later on the line, drops it (NAC_FAST_DEBUG_INFO=1 keeps it).
NO_DEBUG_INFO_FLAGS = ["-g0"]
CUDA_DEFINE = "-DNAC_FAST_WITH_CUDA"  # on both compilers when the CUDA kernels are built

# nvcc (.cu), on top of what torch's BuildExtension adds (torch_nvcc_flags below).
NVCC_FLAGS = ["-O3", "-lineinfo", CUDA_DEFINE, "--expt-relaxed-constexpr"]

EXTENSION_NAME = "nac_fast._C"


def torch_nvcc_flags(torch_version: str) -> list:
    """The nvcc flags torch.utils.cpp_extension.BuildExtension adds to NVCC_FLAGS for a
    CUDAExtension (besides -I, -c/-o and the -gencode list): its COMMON_NVCC_FLAGS (the
    __CUDA_NO_HALF_* defines and --expt-relaxed-constexpr), the extension defines and, since our
    flags name no -std, its default C++ standard: c++20 from torch 2.12 on (pytorch#176659),
    c++17 before.  Needs torch importable."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    std = "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"
    return list(COMMON_NVCC_FLAGS) + [
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=" + EXTENSION_NAME.rsplit(".", 1)[-1], std]


def csrc_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def cuda_wheel_include_dirs(torch_file: str) -> list:
    """cuBLAS/cuSPARSE headers of the CUDA 13 pip wheels live in site-packages/nvidia/cu13."""
    site = os.path.dirname(os.path.dirname(torch_file))
    return [d for d in glob.glob(os.path.join(site, "nvidia", "cu1*", "include")) if os.path.isdir(d)]


def valid_cuda_home(path) -> bool:
    """A toolkit we can build and link with: nvcc and libcudart under `path`."""
    if not path or not os.path.exists(os.path.join(path, "bin", "nvcc")):
        return False
    return any(glob.glob(os.path.join(path, sub, "libcudart.so*"))
               for sub in ("lib64", "lib", os.path.join("targets", "*", "lib")))


def find_cuda_home(torch_guess=None):
    """The CUDA toolkit to build with, or None.  torch's own guess (torch_guess, its
    cpp_extension.CUDA_HOME) is not enough: with nvcc on the PATH at /usr/local/bin it picks
    CUDA_HOME=/usr/local, which has no libcudart, and the link fails (seen on this project's
    machines); /usr/local/cuda is the real toolkit there."""
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), torch_guess,
                 "/usr/local/cuda"):
        if valid_cuda_home(cand):
            return cand
    return None
