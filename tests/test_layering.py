"""The package's imports point down (nac_fast/__init__.py): ops and data import nothing above
them, code statistics sit on ops, train imports ops, data and codestats, eval and index import
those and train, vae imports data and train.  A static check of every module's import statements (relative and absolute),
so a cycle or an upward import fails here rather than as an ImportError somewhere later."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "nac_fast")

# layer -> the top-level parts of nac_fast it may import (besides itself)
ALLOWED = {
    "_checks": set(),           # argument validators: a leaf every layer may use
    "_files": set(),            # atomic writes: a leaf every layer may use
    "_omp": set(),              # the CLIs' OpenMP wait policy: a leaf
    "ops": {"kernels", "_C", "_build_info", "_files", "_checks"},
    "data": {"_files", "_checks"},  # _files: the data list cached between runs (sources/listing.py)
    "codestats": {"ops", "_checks"},
    "train": {"ops", "data", "codestats", "_files", "_checks"},
    "eval": {"ops", "data", "codestats", "train", "_files", "_omp", "_checks"},
    "index": {"ops", "data", "codestats", "train", "_files", "_omp", "_checks"},
    "vae": {"data", "train", "_files", "_omp", "_checks"},  # python -m nac_fast.vae (docs/math.md [M:vae-protocol])
}


def _modules():
    for d, _, names in os.walk(PKG):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(d, n)
                rel = os.path.relpath(p, PKG).split(os.sep)
                yield p, rel


def _imported_parts(path, rel):
    """Top-level nac_fast parts imported by the module at nac_fast/<rel>."""
    tree = ast.parse(open(path).read(), path)
    pkg = ["nac_fast"] + rel[:-1]  # the module's package
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "nac_fast" and len(parts) > 1:
                    out.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")
            if parts[0] != "nac_fast":
                continue
            if len(parts) > 1:
                out.add(parts[1])
            else:  # from nac_fast import x / from .. import x
                out.update(a.name for a in node.names)
    return out


def test_every_layer_is_known():
    layers = {rel[0].removesuffix(".py") for _, rel in _modules() if len(rel) > 1 or
              rel[0] not in ("__init__.py", "_build_info.py")}
    assert layers <= set(ALLOWED), f"add the new part(s) to ALLOWED: {layers - set(ALLOWED)}"


@pytest.mark.parametrize("path,rel", [pytest.param(p, r, id="/".join(r)) for p, r in _modules()
                                      if r[0] not in ("__init__.py", "_build_info.py")])
def test_imports_point_down(path, rel):
    layer = rel[0].removesuffix(".py")
    bad = _imported_parts(path, rel) - ALLOWED[layer] - {layer}
    assert not bad, f"nac_fast/{'/'.join(rel)} ({layer}) imports {sorted(bad)}: upward or sideways"


def test_the_checker_sees_relative_and_absolute_imports(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from ..train import x\nimport nac_fast.eval.cli\nfrom . import y\n"
                 "from nac_fast import index\n")
    assert _imported_parts(str(p), ["ops", "m.py"]) == {"train", "eval", "ops", "index"}
