"""Build of nac_fast: the compiled extension nac_fast._C and the package layout.  The metadata
(version, dependencies, extras) and the build requirements are in pyproject.toml.

    pip install --no-build-isolation -e .   # against this environment's torch (what `make setup`
                                            # does); needs setuptools>=64 and torch, ninja helps
    pip install -e .                        # pip builds in a throw-away environment with the
                                            # newest torch: the extension is compiled against it

The compiled extension `nac_fast._C` holds the fused CPU kernels (csrc/*.cpp) and, when CUDA can
be built, the CUDA kernels (csrc/*.cu).  Like flash-attn and xformers, this file never fails for
lack of nvcc: CUDA is built only when nvcc and a CUDA build of torch are present, or when forced.

The C++ part is built unless NAC_FAST_SKIP_EXT=1 says otherwise, and a build that cannot make it
FAILS, with the reason in a banner on stderr: torch not importable at build time, no working C++
compiler/linker with OpenMP, a compile error.  pip shows the output of a failed build and hides
that of a successful one, so a build that left the extension out on its own would be silent (the
bug of pip < 25 + setuptools >= 80 without pyproject.toml: `setup.py develop` re-ran pip with
build isolation, where torch was missing, and installed the package without its extension).
With NAC_FAST_SKIP_EXT=1 the package installs without the extension and runs on the 'reference'
backend (and 'triton' on GPU).

What the build decided is written to nac_fast/_build_info.py (generated, not in git): the
package's import-time warning quotes it, so it gives the same reason as the build (extension
skipped, last build failed, CUDA left out, or the torch the extension was compiled against when
another torch cannot load it).

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
    NAC_FAST_DEBUG_INFO=1     keep the -g of Python's compiler flags (the default build adds -g0:
                              debug information about doubles the C++ compile time)
    CXX, CC                   the C++ compiler (torch's ninja build: $CXX, default c++) and the
                              C compiler/linker driver (Python's sysconfig unless $CC/$LDSHARED)
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import setuptools
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext as _plain_build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join(ROOT, "nac_fast", "_build_info.py")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _say(msg: str) -> None:
    print(f"nac_fast: {msg}", file=sys.stderr, flush=True)


def load_build_flags():
    """csrc/build_flags.py: the compiler flags and toolkit discovery, shared with
    tools/cuda_resources.py (loaded by path: csrc/ is not a package)."""
    spec = importlib.util.spec_from_file_location("nac_build_flags",
                                                  os.path.join(ROOT, "csrc", "build_flags.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FLAGS = load_build_flags()


# --- what was decided, for the package's import-time warning -----------------------------------

def write_build_info(extension, cuda, torch_version) -> None:
    """nac_fast/_build_info.py: EXTENSION (None when nac_fast._C is built, else why not), CUDA
    (None when its CUDA kernels are, else why not), TORCH (the torch it is compiled against)."""
    text = ('"""What setup.py decided for this copy of nac_fast (generated at build time, not in '
            'git).\nnac_fast quotes it when its compiled extension is missing or does not load."""'
            f"\nEXTENSION = {extension!r}\nCUDA = {cuda!r}\nTORCH = {torch_version!r}\n")
    try:
        with open(BUILD_INFO) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(BUILD_INFO, "w") as f:
        f.write(text)


def fail(reason: str):
    """Stop the build: a banner with the reason on stderr (pip prints a failed build's output),
    and the reason recorded for the package's import-time warning."""
    write_build_info(f"not built: the last build failed: {reason}", None, None)
    bar = "=" * 78
    body = "\n".join(textwrap.fill(p, 78, subsequent_indent="  ", break_on_hyphens=False,
                                    break_long_words=False) for p in (
        f"nac_fast: ERROR: the compiled extension nac_fast._C cannot be built: {reason}",
        "Fix that and build again, or install without the extension: set NAC_FAST_SKIP_EXT=1 "
        "(e.g. NAC_FAST_SKIP_EXT=1 pip install --no-build-isolation -e .); nac_fast then runs "
        "on its 'reference' backend (and 'triton' on GPU) and says so at import."))
    raise SystemExit(f"\n{bar}\n{body}\n{bar}")


# --- the toolchain check -----------------------------------------------------------------------

_PROBE = '#include <omp.h>\nextern "C" int nac_fast_probe() { return omp_get_max_threads(); }\n'


def _env_note() -> str:
    set_vars = [f"{v}={os.environ[v]}" for v in ("CXX", "CC", "LDSHARED") if v in os.environ]
    return f" (set in the environment: {', '.join(set_vars)})" if set_vars else ""


def toolchain_problem(cmd) -> str | None:
    """None when a two-line C++ file using OpenMP compiles and links into a shared library with
    the tools the real build uses (torch's ninja build compiles with $CXX, default c++; setuptools
    links with the compiler object of `cmd`), else what failed."""
    from torch.utils import cpp_extension
    tmp = tempfile.mkdtemp(prefix="nac_fast_probe_")
    try:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write(_PROBE)
        if getattr(cmd, "use_ninja", False) and cpp_extension.is_ninja_available():
            get_cxx = getattr(cpp_extension, "get_cxx_compiler", None)
            cxx = get_cxx() if get_cxx else os.environ.get("CXX", "c++")
            obj = os.path.join(tmp, "probe.o")
            try:
                out = subprocess.run([cxx, "-fPIC", "-fopenmp", "-c", src, "-o", obj],
                                     capture_output=True, text=True, timeout=300)
            except OSError as exc:
                return f"no working C++ compiler: {cxx!r} cannot be run ({exc}){_env_note()}"
            if out.returncode != 0:
                said = (out.stderr or out.stdout).strip()[-600:] or "no output"
                return (f"no working C++ compiler with OpenMP: {cxx!r} failed on a two-line "
                        f"test file using <omp.h> (exit status {out.returncode}: {said})"
                        f"{_env_note()}")
            objects = [obj]
        else:
            try:
                objects = cmd.compiler.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
            except Exception as exc:  # CompileError/LinkError, OSError, ...
                return (f"no working C++ compiler with OpenMP: compiling a two-line test file "
                        f"using <omp.h> failed ({exc}){_env_note()}")
        try:
            cmd.compiler.link_shared_object(objects, os.path.join(tmp, "probe.so"),
                                            extra_postargs=["-fopenmp"], target_lang="c++")
        except Exception as exc:  # CompileError/LinkError, OSError, ...
            return (f"no working linker: linking a two-line C++/OpenMP test file into a shared "
                    f"library failed ({exc}){_env_note()}")
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def checked_build_ext(base):
    """`base` (torch's BuildExtension) that checks the toolchain first and turns a failed build
    into fail()'s banner."""
    class build_ext(base):
        def build_extensions(self):
            problem = toolchain_problem(self)
            if problem:
                fail(problem)
            try:
                super().build_extensions()
            except Exception as exc:  # the compiler's own messages are printed above
                fail(f"compiling it failed ({type(exc).__name__}: {exc}); the compiler's "
                     "messages are above")
    return build_ext


def failing_build_ext(reason):
    class build_ext(_plain_build_ext):
        def run(self):
            fail(reason)
    return build_ext


# --- the extension -----------------------------------------------------------------------------

def _cuda_home():
    """The CUDA toolkit to build with, or None (FLAGS.find_cuda_home says why torch's guess is
    not taken as is)."""
    from torch.utils import cpp_extension
    return FLAGS.find_cuda_home(cpp_extension.CUDA_HOME)


def cuda_reason(torch) -> str | None:
    """None when the CUDA kernels are to be built, else why not (an error under
    NAC_FAST_FORCE_CUDA=1, unless NAC_FAST_SKIP_CUDA=1 is set too)."""
    if _flag("NAC_FAST_SKIP_CUDA"):
        return "NAC_FAST_SKIP_CUDA=1 was set when nac_fast was built"
    if torch.version.cuda is None:
        why = f"the torch it was built against ({torch.__version__}) is a CPU-only build"
    elif _cuda_home() is None:
        why = ("no usable CUDA toolkit (nvcc + libcudart under $CUDA_HOME, $CUDA_PATH, torch's "
               "guess or /usr/local/cuda) when nac_fast was built")
    else:
        from torch.utils import cpp_extension
        home = _cuda_home()
        os.environ["CUDA_HOME"] = home
        cpp_extension.CUDA_HOME = home  # read by CUDAExtension for the include and library paths
        return None
    if _flag("NAC_FAST_FORCE_CUDA"):
        fail(f"NAC_FAST_FORCE_CUDA=1 but {why} (set CUDA_HOME, or use a CUDA build of torch)")
    _say(f"{why}: building the CPU kernels only")
    return why


def extensions():
    """(ext_modules, cmdclass), the decision recorded in nac_fast/_build_info.py."""
    if _flag("NAC_FAST_SKIP_EXT"):
        why = "NAC_FAST_SKIP_EXT=1 was set when nac_fast was built"
        _say(f"{why}: building no compiled extension; nac_fast will run on its 'reference' "
             "backend (and 'triton' on GPU)")
        write_build_info(f"not built: {why}", None, None)
        return [], {}
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except Exception as exc:  # ImportError, or a torch whose own libraries do not load
        why = (f"torch is not importable in the build environment ({type(exc).__name__}: {exc}). "
               "With --no-build-isolation pip builds in the current environment: install torch "
               "(>=2.4) there first, or leave out --no-build-isolation (pip then builds against "
               "the newest torch in a temporary environment)")
        write_build_info(f"not built: the last build failed: {why}", None, None)
        # Fail in build_ext, not here: the metadata steps (egg_info, sdist) need no torch.
        return [Extension(FLAGS.EXTENSION_NAME, cpp)], {"build_ext": failing_build_ext(why)}
    cxx = list(FLAGS.CXX_FLAGS)
    cxx += [] if _flag("NAC_FAST_DEBUG_INFO") else FLAGS.NO_DEBUG_INFO_FLAGS
    cxx += FLAGS.NATIVE_CXX_FLAGS if _flag("NAC_FAST_NATIVE") else []
    common = dict(include_dirs=[os.path.join(ROOT, "csrc")], extra_link_args=["-fopenmp"])
    no_cuda = cuda_reason(torch) if cu else "no CUDA sources"
    if no_cuda is None:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", FLAGS.DEFAULT_CUDA_ARCHS)
        # No --use_fast_math (csrc/build_flags.py: precision note).
        ext = CUDAExtension(FLAGS.EXTENSION_NAME, cpp + cu,
                            extra_compile_args={"cxx": cxx + [FLAGS.CUDA_DEFINE],
                                                "nvcc": list(FLAGS.NVCC_FLAGS)},
                            **{**common, "include_dirs": common["include_dirs"]
                               + FLAGS.cuda_wheel_include_dirs(torch.__file__)})
    else:
        ext = CppExtension(FLAGS.EXTENSION_NAME, cpp, extra_compile_args={"cxx": cxx}, **common)
    write_build_info(None, no_cuda, torch.__version__)  # before build_py copies it into a wheel
    return [ext], {"build_ext": checked_build_ext(BuildExtension.with_options(use_ninja=True))}


def packages():
    """nac_fast and every subpackage of it at any depth (a folder with __init__.py), and the
    top-level kernels/ folder as nac_fast.kernels (with its subpackages), mapped by package_dir:
    a file moved between subpackages needs no edit here."""
    found = ["nac_fast"] + [f"nac_fast.{p}" for p in find_packages(os.path.join(ROOT, "nac_fast"))]
    found += ["nac_fast.kernels"] + [f"nac_fast.kernels.{p}"
                                     for p in find_packages(os.path.join(ROOT, "kernels"))]
    found += ["nac_fast.configs"]  # configs/*.toml, package data (no modules)
    return sorted(found)


def license_metadata() -> dict:
    """MIT (LICENSE): a PEP 639 expression on setuptools >= 77, the older License field before
    (pyproject.toml lists the license as dynamic: why)."""
    major = int(re.match(r"\d+", setuptools.__version__).group())
    return {"license_expression": "MIT"} if major >= 77 else {"license": "MIT"}


ext_modules, cmdclass = extensions()

setup(
    packages=packages(),
    package_dir={"nac_fast": "nac_fast", "nac_fast.kernels": "kernels",
                 "nac_fast.configs": "configs"},
    # the training recipes (nac_fast.train.config reads them from nac_fast/configs in a wheel)
    package_data={"nac_fast.configs": ["*.toml"], "nac_fast.kernels": ["tuned/*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
    **license_metadata(),
)
