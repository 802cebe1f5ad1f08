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
import importlib.util
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def load_build_flags():
    """csrc/build_flags.py: the compiler flags and toolkit discovery, shared with
    bench/cuda_resources.py (loaded by path: csrc/ is not a package)."""
    spec = importlib.util.spec_from_file_location("nac_build_flags",
                                                  os.path.join(ROOT, "csrc", "build_flags.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FLAGS = load_build_flags()


def _cuda_home():
    """The CUDA toolkit to build with, or None (FLAGS.find_cuda_home says why torch's guess is
    not taken as is)."""
    from torch.utils import cpp_extension
    return FLAGS.find_cuda_home(cpp_extension.CUDA_HOME)


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
    cxx = list(FLAGS.CXX_FLAGS) + (FLAGS.NATIVE_CXX_FLAGS if _flag("NAC_FAST_NATIVE") else [])
    common = dict(include_dirs=[os.path.join(ROOT, "csrc")], extra_link_args=["-fopenmp"])
    if cu and _want_cuda(torch):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", FLAGS.DEFAULT_CUDA_ARCHS)
        # No --use_fast_math (csrc/build_flags.py: precision note).
        ext = CUDAExtension(FLAGS.EXTENSION_NAME, cpp + cu,
                            extra_compile_args={"cxx": cxx + [FLAGS.CUDA_DEFINE],
                                                "nvcc": list(FLAGS.NVCC_FLAGS)},
                            **{**common, "include_dirs": common["include_dirs"]
                               + FLAGS.cuda_wheel_include_dirs(torch.__file__)})
    else:
        ext = CppExtension(FLAGS.EXTENSION_NAME, cpp, extra_compile_args={"cxx": cxx}, **common)
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
        for p in glob.glob("nac_fast/*/**/__init__.py", recursive=True)),
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
