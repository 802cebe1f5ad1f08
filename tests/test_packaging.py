"""Installs of a copy of this checkout into fresh virtual environments: the compiled extension is
built, or the install fails loudly with the true reason, for the oldest pip the README supports
and for the current one.

The regression behind this file: with pip 23.2.1 (python 3.11's stock pip), a current setuptools
and no pyproject.toml, `pip install --no-build-isolation -e .` took pip's legacy path, `setup.py
develop`; setuptools >= 80 implements that by running `pip install -e .` again WITH build
isolation, where torch is missing, so the package was installed without its extension and only
the import-time warning noticed.  pyproject.toml's [build-system] makes every pip >= 21.3 use the
PEP 517/660 hooks, which honour --no-build-isolation, and setup.py fails with the reason when the
extension cannot be built.

Cost (CPU-only extension, NAC_FAST_SKIP_CUDA=1): the metadata tests take seconds; the install
tests one extension build with the oldest pip (about 80 s of CPU, 1.5-4 min of wall time on a
shared 2-core machine), plus venv set-ups and two cheap failing builds.  The build-isolation tests
(oldest and current pip; each a second build and a torch install in pip's throw-away build
environment, about 4 min of wall time each here) run only with NAC_FAST_TEST_ISOLATED_BUILD=1.  Both torches are the version this interpreter runs, from the
configured index, so no other torch is downloaded.
"""
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from _checkout import copy_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLDEST_PIP = "23.2.1"  # the oldest pip the README supports: python 3.11's ensurepip
TORCH = torch.__version__.split("+")[0]  # the index's name for the torch this test runs on
SITE = os.path.dirname(os.path.dirname(torch.__file__))  # where this interpreter's torch lives

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and "CXX" not in os.environ,
                                reason="no C++ compiler to build the extension with")

CHECK_BUILT = r"""
import os, sys, warnings
warnings.simplefilter("error", RuntimeWarning)  # the import-time warning of a missing extension
import torch
import nac_fast, nac_fast._C
from nac_fast import _build_info
where = os.path.realpath(nac_fast.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), where
assert _build_info.EXTENSION is None and _build_info.TORCH == torch.__version__, vars(_build_info)
assert hasattr(torch.ops.nac_fast, "nac_fwd"), "nac_fast._C registered no torch.ops.nac_fast ops"
assert "cpu" in nac_fast.available_backends("cpu"), nac_fast.available_backends("cpu", reasons=True)
g = torch.Generator().manual_seed(0)
a, r = torch.randn(9, 16, generator=g), torch.randn(9, 16, generator=g)
noise = nac_fast.draw_noise((9, 16), 0.1, generator=g)
v = nac_fast.nac_loss(a, r, 0.1, noise=noise, backend="cpu")
w = nac_fast.nac_loss(a, r, 0.1, noise=noise, backend="reference")
assert abs(float(v) - float(w)) < 1e-4 * max(1.0, abs(float(w))), (float(v), float(w))
print("BUILT", where)
"""

# The warning a copy without the extension gives at import, and the 'cpu' backend's reason.
CHECK_REASON = r"""
import os, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import nac_fast
where = os.path.realpath(nac_fast.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), where
said = [str(w.message) for w in caught if "compiled extension" in str(w.message)]
assert len(said) == 1, [str(w.message) for w in caught]
assert "cpu" not in nac_fast.available_backends("cpu")
print("WARNING", said[0])
print("CPU-REASON", nac_fast.available_backends("cpu", reasons=True)["cpu"])
"""


def _child(code, paths, cwd, *args):
    """`code` in this interpreter started with -S: no site-packages processing, hence no editable
    finder of any nac_fast checkout (one would hand its own nac_fast._C to a copy that has
    none); `paths` go first on sys.path, this interpreter's site-packages (torch) last."""
    prelude = f"import sys\nsys.path[:0] = {list(paths)!r}\nsys.path.append({SITE!r})\n"
    return _run([sys.executable, "-S", "-c", prelude + code, *args], cwd=cwd)[1]


def _flat(text):
    return " ".join(text.split())


def _env(**extra):
    """The caller's environment (its pip configuration, its index) minus what would change the
    build or the import: the package's build flags, PYTHONPATH, TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NAC_FAST_") and k not in ("PYTHONPATH", "TRITON_INTERPRET",
                                                          "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env.update(NAC_FAST_SKIP_CUDA="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.update(extra)
    return env


def _run(argv, cwd, env=None, ok=True, timeout=900):
    out = subprocess.run(argv, cwd=cwd, env=env or _env(), capture_output=True, text=True,
                         timeout=timeout)
    text = out.stdout + out.stderr
    if ok:
        assert out.returncode == 0, f"{argv}\n" + text[-6000:]
    return out.returncode, text



def _venv(path, pip_args, *packages):
    """A fresh venv (from this interpreter's base Python) with the pip `pip_args` install and the
    newest setuptools, plus `packages`."""
    _run([sys.executable, "-m", "venv", path], cwd=os.path.dirname(path))
    py = os.path.join(path, "bin", "python")
    _run([py, "-m", "pip", "install", "-q", *pip_args], cwd=path)
    _run([py, "-m", "pip", "install", "-q", "--upgrade", "setuptools", *packages], cwd=path)
    return py


def _pip_version(py):
    return _run([py, "-m", "pip", "--version"], cwd=os.path.dirname(py))[1].split()[1]


# --- metadata against the tree (no build) -----------------------------------------------------

def _pyproject():
    import tomllib  # the suite runs on Python >= 3.11 (the Makefile's venv)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _name(req):
    return re.match(r"[A-Za-z0-9_.\-]+", req).group().lower().replace("_", "-")


IMPORT_NAMES = {"pillow": "PIL", "scikit-learn": "sklearn", "faiss-cpu": "faiss",
                "nvidia-dali-cuda130": "nvidia.dali", "pytest-xdist": "xdist"}


def _third_party_imports():
    """Top-level modules that nac_fast/ and kernels/ import, less the standard library and
    nac_fast itself."""
    import ast
    found = {}
    for top in ("nac_fast", "kernels"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                if not f.endswith(".py") or f == "_build_info.py":
                    continue
                tree = ast.parse(open(os.path.join(d, f)).read())
                for node in ast.walk(tree):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module] if isinstance(node, ast.ImportFrom) and node.module
                             and node.level == 0 else [])
                    for n in names:
                        mod = n.split(".")[0]
                        if mod not in sys.stdlib_module_names and mod not in ("nac_fast",
                                                                              "kernels"):
                            found.setdefault(mod, os.path.relpath(os.path.join(d, f), ROOT))
    return found


def test_dependencies_are_the_real_ones():
    proj = _pyproject()["project"]
    deps = {_name(r) for r in proj["dependencies"]}
    assert {"torch", "torchvision", "numpy", "pillow", "tqdm"} <= deps, deps
    assert "torch>=2.4" in proj["dependencies"], proj["dependencies"]  # never pinned newer
    extras = proj["optional-dependencies"]
    # every third-party module the package imports is a dependency or in an extra (triton comes
    # with torch's Linux wheels and has its own extra)
    declared = {IMPORT_NAMES.get(n, n).split(".")[0].lower()
                for n in deps | {_name(r) for rs in extras.values() for r in rs}}
    missing = {m: where for m, where in _third_party_imports().items()
               if m.lower() not in declared}
    assert not missing, missing
    # the dependencies (whose markers hold here) are importable in this environment
    for r in proj["dependencies"]:
        if ";" in r and "python_version < '3.11'" in r and sys.version_info >= (3, 11):
            continue
        importlib_import(IMPORT_NAMES.get(_name(r), _name(r)))


def importlib_import(name):
    import importlib
    importlib.import_module(name)


def test_extras():
    extras = {k: {_name(r) for r in v}
              for k, v in _pyproject()["project"]["optional-dependencies"].items()}
    assert {"dali", "dev"} <= set(extras), extras
    # nothing in nac_fast/ imports scikit-learn (test_dependencies_are_the_real_ones would then
    # ask for it): only scripts/make_image_folder.py's digits need it, a tool of [dev]
    assert "eval" not in extras and "sklearn" not in _third_party_imports(), extras
    assert "scikit-learn" in extras["dev"], extras["dev"]
    assert "faiss-cpu" in extras["bench"], extras
    assert {"pytest", "tensorboard", "ninja"} <= extras["dev"], extras["dev"]
    assert any(n.startswith("nvidia-dali") for n in extras["dali"]), extras["dali"]
    # make setup installs the tools of [dev] itself: the Makefile's PY_DEPS
    make = open(os.path.join(ROOT, "Makefile")).read()
    py_deps = re.search(r"^PY_DEPS\s*\?=\s*((?:.*\\\n)*.*)$", make, re.M).group(1)
    listed = {_name(w.strip('"')) for w in py_deps.replace("\\\n", " ").split()}
    assert extras["dev"] <= listed, extras["dev"] - listed
    assert "tensorboard" in listed


def test_build_system():
    bs = _pyproject()["build-system"]
    names = {_name(r) for r in bs["requires"]}
    assert {"setuptools", "wheel", "torch", "ninja"} <= names, names
    assert bs["build-backend"] == "setuptools.build_meta"


def test_license_is_mit():
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text, text[:200]
    assert "license" in _pyproject()["project"]["dynamic"]
    assert re.search(r'"license_expression": "MIT"', open(os.path.join(ROOT, "setup.py")).read())


def test_setup_packages_cover_every_subpackage(tmp_path):
    """setup.py's packages and package_dir, read from setup() in a copy of the tree: every folder
    with an __init__.py under nac_fast/ and kernels/ is a package, configs/*.toml is data."""
    tree = copy_tree(str(tmp_path / "src"))
    code = ("import json, setuptools\nseen = {}\nsetuptools.setup = lambda **kw: seen.update(kw)\n"
            "exec(compile(open('setup.py').read(), 'setup.py', 'exec'), {'__file__': "
            "__import__('os').path.abspath('setup.py'), '__name__': '__main__'})\n"
            "print('SETUP-KW', json.dumps({k: seen[k] for k in ('packages', 'package_dir', "
            "'package_data')}))\n")
    import json
    out = _run([sys.executable, "-c", code], cwd=tree, env=_env(NAC_FAST_SKIP_EXT="1"))[1]
    got = json.loads(out.split("SETUP-KW", 1)[1].splitlines()[0])
    want = set()
    for top, pkg in (("nac_fast", "nac_fast"), ("kernels", "nac_fast.kernels")):
        for d, dirs, files in os.walk(os.path.join(tree, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(d, os.path.join(tree, top))
                want.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    assert {"nac_fast.ops", "nac_fast.train", "nac_fast.eval", "nac_fast.data",
            "nac_fast.data.loaders", "nac_fast.data.sources", "nac_fast.kernels"} <= want, want
    assert want <= set(got["packages"]), sorted(want - set(got["packages"]))
    assert got["package_dir"]["nac_fast.kernels"] == "kernels", got["package_dir"]
    assert got["package_dir"]["nac_fast.configs"] == "configs", got["package_dir"]
    assert got["package_data"]["nac_fast.configs"] == ["*.toml"], got["package_data"]
    manifest = open(os.path.join(ROOT, "MANIFEST.in")).read()  # the sdist has the C++/CUDA sources
    assert "recursive-include csrc" in manifest and "*.h" in manifest, manifest


# --- installs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def old_pip_venv(tmp_path_factory):
    """pip 23.2.1, the newest setuptools and ninja in the venv; torch (and numpy) are this
    interpreter's, through a .pth line naming its site-packages, appended after the venv's own:
    no second 5 GB torch, and the venv's pip and setuptools are the ones used."""
    path = tmp_path_factory.mktemp("oldpip") / "venv"
    py = _venv(str(path), [f"pip=={OLDEST_PIP}"], "ninja")
    assert _pip_version(py) == OLDEST_PIP
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                cwd=str(path))[1].strip()
    with open(os.path.join(site, "zz_torch_of_the_test_runner.pth"), "w") as f:
        f.write(SITE + "\n")
    yield py
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def new_pip_venv(tmp_path_factory):
    """The newest pip and setuptools, no torch."""
    path = tmp_path_factory.mktemp("newpip") / "venv"
    yield _venv(str(path), ["--upgrade", "pip"])
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_oldest_pip_editable_no_build_isolation_builds_the_extension(old_pip_venv, tmp_path):
    """The README's build command with the oldest pip: the extension is built and loads."""
    tree = copy_tree(str(tmp_path / "src"))
    _, log = _run([old_pip_venv, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                   "-e", tree], cwd=str(tmp_path))
    assert "setup.py develop" not in log, log[-3000:]  # the legacy path that lost the extension
    _, out = _run([old_pip_venv, "-c", CHECK_BUILT, tree], cwd=str(tmp_path))
    assert "BUILT" in out, out


@pytest.mark.skipif(os.environ.get("NAC_FAST_TEST_ISOLATED_BUILD", "0") in ("", "0"),
                    reason="a second extension build and a torch install in pip's isolated "
                           "build environment (~3-5 min): NAC_FAST_TEST_ISOLATED_BUILD=1 runs it")
@pytest.mark.slow
def test_current_pip_build_isolation_builds_the_extension(new_pip_venv, tmp_path):
    """pip's default (build isolation, the build requirements of pyproject.toml installed in a
    throw-away environment) with the current pip, torch pinned by --build-constraint to the torch
    the wheel is then imported with (an extension is compiled against one torch)."""
    tree = copy_tree(str(tmp_path / "src"))
    pins = tmp_path / "build-constraints.txt"
    pins.write_text(f"torch=={TORCH}\n")
    dist = str(tmp_path / "dist")
    _run([new_pip_venv, "-m", "pip", "wheel", "--no-deps", "--build-constraint", str(pins),
          "-w", dist, tree], cwd=str(tmp_path))
    wheels = os.listdir(dist)
    assert len(wheels) == 1 and re.search(r"-cp\d+-cp\d+\w*-linux_\w+\.whl$", wheels[0]), wheels
    target = str(tmp_path / "site")
    _run([new_pip_venv, "-m", "pip", "install", "--no-deps", "--target", target,
          os.path.join(dist, wheels[0])], cwd=str(tmp_path))
    out = _child(CHECK_BUILT, [target], str(tmp_path), target)
    assert "BUILT" in out, out


@pytest.mark.skipif(os.environ.get("NAC_FAST_TEST_ISOLATED_BUILD", "0") in ("", "0"),
                    reason="a second extension build and a torch install in pip's isolated "
                           "build environment (~3-5 min): NAC_FAST_TEST_ISOLATED_BUILD=1 runs it")
@pytest.mark.slow
def test_oldest_pip_build_isolation_builds_the_extension(old_pip_venv, tmp_path):
    """pip's default (build isolation) with the oldest pip: no --build-constraint there, so torch
    is pinned for the build environment through PIP_CONSTRAINT (which that pip applies to it)."""
    tree = copy_tree(str(tmp_path / "src"))
    pins = tmp_path / "constraints.txt"
    pins.write_text(f"torch=={TORCH}\n")
    dist = str(tmp_path / "dist")
    _run([old_pip_venv, "-m", "pip", "wheel", "--no-deps", "-w", dist, tree], cwd=str(tmp_path),
         env=_env(PIP_CONSTRAINT=str(pins)))
    wheels = os.listdir(dist)
    assert len(wheels) == 1 and re.search(r"-cp\d+-cp\d+\w*-linux_\w+\.whl$", wheels[0]), wheels
    target = str(tmp_path / "site")
    _run([old_pip_venv, "-m", "pip", "install", "--no-deps", "--target", target,
          os.path.join(dist, wheels[0])], cwd=str(tmp_path))
    out = _child(CHECK_BUILT, [target], str(tmp_path), target)
    assert "BUILT" in out, out


def _assert_loud_failure(log, tree, cwd, expect):
    """The failed install printed the banner with `expect` in its reason, and the copy's import
    warning (from the reason recorded in nac_fast/_build_info.py) gives the same reason."""
    flat = _flat(log)
    assert "nac_fast: ERROR: the compiled extension nac_fast._C cannot be built:" in flat, log
    assert expect in flat, log[-4000:]
    assert "NAC_FAST_SKIP_EXT=1" in flat, log[-4000:]
    out = _child(CHECK_REASON, [tree], cwd, tree)
    warning = _flat(out.split("WARNING", 1)[1].split("CPU-REASON", 1)[0])
    reason = re.search(r"\(not built: the last build failed: (.*)\); the fused", warning)
    assert reason, warning
    assert expect in reason.group(1), warning
    assert reason.group(1) in flat, (reason.group(1), log[-4000:])  # the same words as the build


@pytest.mark.slow
def test_no_compiler_fails_loudly_with_the_reason(old_pip_venv, tmp_path):
    tree = copy_tree(str(tmp_path / "src"))
    rc, log = _run([old_pip_venv, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                    "-e", tree], cwd=str(tmp_path),
                   env=_env(CXX="/bin/false", CC="/bin/false"), ok=False)
    assert rc != 0, log[-3000:]
    _assert_loud_failure(log, tree, str(tmp_path), "no working C++ compiler")
    assert not [f for f in os.listdir(os.path.join(tree, "nac_fast")) if f.startswith("_C")]


@pytest.mark.slow
def test_torch_missing_at_build_time_fails_loudly_with_the_reason(new_pip_venv, tmp_path):
    tree = copy_tree(str(tmp_path / "src"))
    rc, log = _run([new_pip_venv, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                    "-e", tree], cwd=str(tmp_path), ok=False)
    assert rc != 0, log[-3000:]
    _assert_loud_failure(log, tree, str(tmp_path),
                         "torch is not importable in the build environment")


@pytest.mark.slow
def test_skip_ext_installs_without_it_and_says_why(old_pip_venv, tmp_path):
    """NAC_FAST_SKIP_EXT=1: a pure-Python wheel, and its import warning names the flag."""
    tree = copy_tree(str(tmp_path / "src"))
    dist = str(tmp_path / "dist")
    _run([old_pip_venv, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist,
          tree], cwd=str(tmp_path), env=_env(NAC_FAST_SKIP_EXT="1"))
    wheels = os.listdir(dist)
    assert len(wheels) == 1 and wheels[0].endswith("-py3-none-any.whl"), wheels
    # Every module of the tree is in the wheel: nac_fast/ at any depth, kernels/ as
    # nac_fast/kernels/ (a folder without __init__.py would be left out: the package layout
    # setup.py finds is every folder with one).
    with zipfile.ZipFile(os.path.join(dist, wheels[0])) as whl:
        have = set(whl.namelist())
    want = set()
    for top, dest in (("nac_fast", "nac_fast"), ("kernels", "nac_fast/kernels")):
        for d, dirs, files in os.walk(os.path.join(tree, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            rel = os.path.relpath(d, os.path.join(tree, top))
            want |= {os.path.normpath(os.path.join(dest, rel, f)) for f in files
                     if f.endswith(".py")}
    want |= {f"nac_fast/configs/{f}" for f in os.listdir(os.path.join(tree, "configs"))
             if f.endswith(".toml")}
    assert "nac_fast/_build_info.py" in want and "nac_fast/kernels/__init__.py" in want, want
    assert want <= have, sorted(want - have)
    target = str(tmp_path / "site")
    _run([old_pip_venv, "-m", "pip", "install", "--no-deps", "--target", target,
          os.path.join(dist, wheels[0])], cwd=str(tmp_path))
    out = _child(CHECK_REASON, [target], str(tmp_path), target)
    assert "not built: NAC_FAST_SKIP_EXT=1 was set when nac_fast was built" in _flat(out), out
