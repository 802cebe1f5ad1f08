"""Build of nac_fast.

    pip install --no-build-isolation -e .        # in an environment that already has torch

The compiled extension `nac_fast._C` holds the fused CPU kernels (csrc/*.cpp) and, when CUDA can
be built, the CUDA kernels (csrc/*.cu).  Like flash-attn and xformers, this file never fails for
lack of nvcc: CUDA is built only when nvcc and a CUDA build of torch are present, or when forced.

Environment:
    NAC_FAST_SKIP_CUDA=1      never build the CUDA kernels
    NAC_FAST_FORCE_CUDA=1     build them even without a visible GPU (fail if impossible)
    NAC_FAST_SKIP_EXT=1       build no extension at all (reference + Triton backends only)
    CUDA_HOME                 the toolkit (nvcc + libcudart); default: torch's guess if usable,
                              else /usr/local/cuda; none usable -> CPU kernels only
    TORCH_CUDA_ARCH_LIST      CUDA archs, default "8.0;9.0" (A100, H100/H200)
    MAX_JOBS                  parallel compile jobs (ninja)
    NAC_FAST_NATIVE=1         add -march=native (the default build runs on any x86-64 and picks
                              AVX-512/AVX2 code paths at run time)
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _cuda_include_dirs():
    """cuBLAS/cuSPARSE headers of the CUDA 13 pip wheels live in site-packages/nvidia/cu13."""
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return [d for d in glob.glob(os.path.join(site, "nvidia", "cu1*", "include")) if os.path.isdir(d)]


def _valid_cuda_home(path) -> bool:
    """A toolkit we can build and link with: nvcc and libcudart under `path`."""
    if not path or not os.path.exists(os.path.join(path, "bin", "nvcc")):
        return False
    return any(glob.glob(os.path.join(path, sub, "libcudart.so*"))
               for sub in ("lib64", "lib", os.path.join("targets", "*", "lib")))


def _cuda_home():
    """The CUDA toolkit to build with, or None.  torch's own guess is not enough: with nvcc on the
    PATH at /usr/local/bin it picks CUDA_HOME=/usr/local, which has no libcudart, and the link
    fails (seen on this project's machines); /usr/local/cuda is the real toolkit there."""
    from torch.utils import cpp_extension
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                 "/usr/local/cuda"):
        if _valid_cuda_home(cand):
            return cand
    return None


def _want_cuda(torch) -> bool:
    if _flag("NAC_FAST_SKIP_CUDA"):
        return False
    home = _cuda_home() if torch.version.cuda is not None else None
    if home is None:
        if _flag("NAC_FAST_FORCE_CUDA"):
            sys.exit("NAC_FAST_FORCE_CUDA=1 but no usable CUDA toolkit (nvcc + libcudart; set "
                     "CUDA_HOME) or no CUDA build of torch")
        print("nac_fast: no usable CUDA toolkit; building the CPU kernels only", file=sys.stderr)
        return False
    from torch.utils import cpp_extension
    os.environ["CUDA_HOME"] = home
    cpp_extension.CUDA_HOME = home  # read by CUDAExtension for the include and library paths
    return True


def extensions():
    if _flag("NAC_FAST_SKIP_EXT"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("nac_fast: torch is not importable at build time; building no extension "
              "(use pip install --no-build-isolation)", file=sys.stderr)
        return [], {}
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    # -fno-trapping-math lets GCC if-convert the selects of nac_math.h (torch builds with it too).
    cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"]
    if _flag("NAC_FAST_NATIVE"):
        cxx.append("-march=native")
    common = dict(include_dirs=[os.path.join(ROOT, "csrc")], extra_link_args=["-fopenmp"])
    if cu and _want_cuda(torch):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "-DNAC_FAST_WITH_CUDA",
                "--expt-relaxed-constexpr"]
        ext = CUDAExtension("nac_fast._C", cpp + cu,
                            extra_compile_args={"cxx": cxx + ["-DNAC_FAST_WITH_CUDA"], "nvcc": nvcc},
                            **{**common, "include_dirs": common["include_dirs"] + _cuda_include_dirs()})
    else:
        ext = CppExtension("nac_fast._C", cpp, extra_compile_args={"cxx": cxx}, **common)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()

setup(
    name="nac_fast",
    version="0.1.0",
    description="Fused kernels, training and evaluation for Neural Activation Coding (ICML 2021)",
    long_description=open(os.path.join(ROOT, "README.md")).read() if os.path.exists(
        os.path.join(ROOT, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["nac_fast", "nac_fast.kernels"] + sorted(
        "nac_fast." + os.path.relpath(os.path.dirname(p), "nac_fast").replace(os.sep, ".")
        for p in glob.glob("nac_fast/*/__init__.py")),
    package_dir={"nac_fast": "nac_fast", "nac_fast.kernels": "kernels"},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "test": ["pytest>=7", "pytest-benchmark", "matplotlib"],
        "triton": ["triton>=3.0"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
