"""The Triton kernels import in every install mode, and a failed import says why.

`nac_fast.kernels` is the checkout's top-level kernels/ folder: setup.py installs it as
nac_fast/kernels in a wheel and maps it in an editable install, and nac_fast/__init__.py registers
it when the package runs from a source tree (PYTHONPATH=<checkout>, `setup.py build_ext
--inplace`: the GPU suite's way).  In this dev checkout the editable finder supplies the
subpackage and would hide a failure of the other modes, so each mode runs in a child interpreter
started with -S (no site-packages processing, hence no editable finder of this checkout) on a copy
of the tree, with only torch's site-packages directory appended to sys.path.
"""
import importlib.util
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

import nac_fast
from _checkout import copy_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.dirname(os.path.dirname(torch.__file__))  # where torch, triton, numpy live
HAS_TRITON = importlib.util.find_spec("triton") is not None

CHECK = r"""
import warnings
warnings.simplefilter("ignore", RuntimeWarning)   # no compiled extension in these copies
import nac_fast, torch
import nac_fast.kernels.nac_triton as k
assert os.path.realpath(k.__file__).startswith(os.path.realpath(EXPECT)), (k.__file__, EXPECT)
assert os.path.realpath(nac_fast.__file__).startswith(os.path.realpath(PKG)), nac_fast.__file__
why = nac_fast.available_backends("cpu", reasons=True)
assert why["triton"] is None, why
g = torch.Generator().manual_seed(0)
a, r = torch.randn(7, 16, generator=g), torch.randn(7, 16, generator=g)
noise = nac_fast.draw_noise((7, 16), 0.1, generator=g)
v = nac_fast.nac_loss(a, r, 0.1, noise=noise, backend="triton")
w = nac_fast.nac_loss(a, r, 0.1, noise=noise, backend="reference")
assert abs(float(v) - float(w)) < 1e-5, (float(v), float(w))
print("OK", k.__file__)
"""



def _child(code, paths, cwd, expect, pkg, site_dirs=(), extra_env=None):
    prelude = (f"import os, sys, site\nsys.path[:0] = {list(paths)!r}\nsys.path.append({SITE!r})\n"
               # first on the path, so that its .pth files import their own modules (an editable
               # install's finder module has the same name as this checkout's)
               + "".join(f"sys.path.insert(0, {d!r}); site.addsitedir({d!r})\n"
                         for d in site_dirs)
               + f"EXPECT = {expect!r}\nPKG = {pkg!r}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(TRITON_INTERPRET="1", **(extra_env or {}))
    out = subprocess.run([sys.executable, "-S", "-c", prelude + code], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _pip(*args, cwd):
    env = dict(os.environ, NAC_FAST_SKIP_EXT="1")  # the Python packaging is what is tested here
    out = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.mark.slow
def test_source_tree_with_pythonpath(tmp_path):
    tree = copy_tree(str(tmp_path / "src"))
    out = _child(CHECK, [tree], str(tmp_path), os.path.join(tree, "kernels"),
                 os.path.join(tree, "nac_fast"))
    assert "OK" in out


@pytest.mark.slow
def test_wheel(tmp_path):
    tree = copy_tree(str(tmp_path / "src"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), tree,
         cwd=str(tmp_path))
    wheels = os.listdir(tmp_path / "dist")
    assert len(wheels) == 1 and wheels[0].endswith(".whl"), wheels
    target = str(tmp_path / "site")
    _pip("install", "--no-deps", "--no-compile", "--ignore-installed", "--target", target,
         str(tmp_path / "dist" / wheels[0]), cwd=str(tmp_path))
    out = _child(CHECK, [target], str(tmp_path), os.path.join(target, "nac_fast", "kernels"),
                 os.path.join(target, "nac_fast"))
    assert "OK" in out


@pytest.mark.slow
def test_editable_install(tmp_path):
    tree = copy_tree(str(tmp_path / "src"))
    prefix = str(tmp_path / "prefix")
    # --ignore-installed: without it pip uninstalls the running environment's nac_fast first
    _pip("install", "--no-deps", "--no-build-isolation", "--ignore-installed", "--prefix", prefix,
         "-e", tree,
         cwd=str(tmp_path))
    site_dir = sysconfig.get_path("purelib", vars={"base": prefix, "platbase": prefix})
    out = _child(CHECK, [], str(tmp_path), os.path.join(tree, "kernels"),
                 os.path.join(tree, "nac_fast"), site_dirs=[site_dir])
    assert "OK" in out


@pytest.mark.slow
def test_failed_triton_import_is_reported_not_swallowed(tmp_path):
    """A kernels module that fails to import: a RuntimeWarning with the exception, the reason in
    available_backends(reasons=True), and backend="triton" refused with that reason."""
    tree = copy_tree(str(tmp_path / "src"))
    with open(os.path.join(tree, "kernels", "nac_triton.py"), "a") as f:
        f.write("\nraise ImportError('planted failure 4711')\n")
    code = r"""
import warnings
import nac_fast, torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    why = nac_fast.available_backends("cpu", reasons=True)["triton"]
assert why and "planted failure 4711" in why, why
assert any("planted failure 4711" in str(w.message) for w in caught), [str(w.message) for w in caught]
assert "triton" not in nac_fast.available_backends("cpu")
try:
    nac_fast.nac_loss(torch.randn(3, 4), torch.randn(3, 4), 0.1, backend="triton")
except ValueError as exc:
    assert "planted failure 4711" in str(exc), exc
else:
    raise AssertionError("backend='triton' was accepted")
print("OK")
"""
    assert "OK" in _child(code, [tree], str(tmp_path), "", "")


def test_triton_backend_present_where_triton_is_installed():
    """In this test run Triton is installed and TRITON_INTERPRET=1 (conftest), so the Triton
    backend must be there: a broken import fails here instead of skipping every Triton test."""
    why = nac_fast.available_backends("cpu", reasons=True)["triton"]
    assert why is None, why


SOURCE_TREE_CHECK = r"""
import importlib, os, sys
root, dev = os.path.realpath(sys.argv[1]), sys.argv[2]
# the source tree alone, as on the GPU machine (nothing installed there): drop the finders of a
# setuptools editable install, which map nac_fast.kernels to kernels/ through setup.py's
# package_dir and would hide a tree that cannot import it
sys.meta_path = [f for f in sys.meta_path
                 if "__editable__" not in (getattr(f, "__module__", "") or "")
                 and "__editable__" not in (getattr(type(f), "__module__", "") or "")]
import nac_fast
where = os.path.dirname(os.path.realpath(nac_fast.__file__))
assert where == os.path.join(root, "nac_fast"), f"nac_fast imported from {where}, not from {root}"
importlib.import_module("nac_fast.kernels.nac_triton")
why = nac_fast.available_backends(dev, reasons=True)
missing = {b: why[b] for b in (["triton", "cuda"] if dev == "cuda" else ["triton"]) if why[b]}
assert not missing, f"available_backends({dev!r}) lacks {missing}"
if dev == "cuda":
    assert nac_fast.ops.dispatch.cuda_extension_built(), "nac_fast._C missing or built without CUDA"
print(f"nac_fast from {where}; nac_fast.kernels.nac_triton imports; available_backends({dev!r}) "
      f"= {nac_fast.available_backends(dev)}")
"""


def test_source_tree_has_its_devices_backends():
    """The GPU suite's build stage runs this after `setup.py build_ext --inplace` (JUnit
    pytest_build.xml): from this source tree alone (PYTHONPATH, an editable install's finders
    dropped), nac_fast and nac_fast.kernels.nac_triton import, and available_backends of
    NAC_FAST_TEST_DEVICE has 'triton' and, on 'cuda', 'cuda' with nac_fast._C built with CUDA.
    A missing backend or extension fails it, with the dispatcher's reason."""
    dev = os.environ.get("NAC_FAST_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run([sys.executable, "-c", SOURCE_TREE_CHECK, ROOT, dev], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)


@pytest.mark.slow
def test_gpu_suite_build_stage_import_path(tmp_path):
    """The GPU suite's build stage, in its CPU mode (NAC_FAST_SUITE_CPU=1), on a copy of the tree:
    the import test above, as the GPU machine runs it after `build_ext --inplace`."""
    tree = copy_tree(str(tmp_path / "src"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(NAC_FAST_SUITE_CPU="1", NAC_FAST_SUITE_RESULTS=str(tmp_path / "res"),
               PYTHON=sys.executable)
    out = subprocess.run(["bash", os.path.join(tree, "bench", "gpu_suite.sh"), "build"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert any(line.startswith("SUITE build PASS") for line in out.stdout.splitlines()), \
        out.stdout[-4000:]
