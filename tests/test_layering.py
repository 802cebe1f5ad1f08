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
    "_tensors": set(),          # eager_real, acc_dtype: a leaf the kernels use too
    "ops": {"kernels", "_C", "_build_info", "_files", "_checks", "_tensors"},
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


# ---- the module graph: no import circle, kernels/ below ops ---------------------------------------
# Every module of nac_fast/ and of the top-level kernels/ (installed as nac_fast.kernels), with
# every import statement anywhere in its file (function-local ones included: a lazy import is
# still a dependency, and a circle through one is a circle).  A package's own __init__ that an
# import runs on the way (nac_fast/__init__.py imports the public API) is not an edge: the graph
# holds the modules a file names.
KERNELS = os.path.join(ROOT, "kernels")
# what the Triton kernels may import of nac_fast besides themselves: leaves that import nothing
KERNEL_LEAVES = {"nac_fast._checks", "nac_fast._files", "nac_fast._tensors"}


def _tree_modules(roots=((PKG, "nac_fast"), (KERNELS, "nac_fast.kernels"))):
    """{dotted name: (path, is_package)} of every .py file under the roots."""
    out = {}
    for base, dotted in roots:
        for d, _, names in os.walk(base):
            for n in names:
                if not n.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, n), base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    out[".".join([dotted] + rel[:-1])] = (os.path.join(d, n), True)
                else:
                    out[".".join([dotted] + rel)] = (os.path.join(d, n), False)
    return out


def _edges(name, path, is_pkg, known):
    """The known modules the file at `path` (module `name`) imports, anywhere in it."""
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                mod = ".".join(base + (node.module.split(".") if node.module else []))
            else:
                mod = node.module or ""
            # `from m import x`: the submodule m.x where there is one, else m itself
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # import a.b.c of a module a.b.c or of a name in a.b
                t = t.rpartition(".")[0]
            if t and t != name and t != "nac_fast":  # the root: the public API, not a layer
                out.add(t)
    return out


def _graph(roots=((PKG, "nac_fast"), (KERNELS, "nac_fast.kernels"))):
    known = _tree_modules(roots)
    return {m: _edges(m, p, is_pkg, known) for m, (p, is_pkg) in known.items()}


def _cycle(graph):
    """One import circle of `graph` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_circle():
    """Issue 57: kernels/nac_triton.py and kernels/tuning.py imported each other, ops/loss.py and
    ops/collectives.py too, and ops/* imported nac_fast.kernels lazily while kernels/* imported
    nac_fast.ops back."""
    graph = _graph()
    assert "nac_fast.kernels.nac_triton" in graph and "nac_fast.ops.loss" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_kernels_import_only_leaves_of_nac_fast():
    graph = _graph()
    for m, targets in graph.items():
        if m.startswith("nac_fast.kernels"):
            bad = {t for t in targets if not t.startswith("nac_fast.kernels")} - KERNEL_LEAVES
            assert not bad, f"{m} imports {sorted(bad)}: the kernels import only {KERNEL_LEAVES}"
    for leaf in KERNEL_LEAVES:
        assert not graph[leaf], f"{leaf} is no leaf: it imports {sorted(graph[leaf])}"


def _reaches(graph, a, b):
    seen, todo = set(), [a]
    while todo:
        m = todo.pop()
        if m == b:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return False


@pytest.mark.parametrize("a,b", [
    ("nac_fast.kernels.configs", "nac_fast.kernels.nac_triton"),   # the configurations: a leaf
    ("nac_fast.kernels.tuning", "nac_fast.kernels.nac_triton"),    # the table lookup
    ("nac_fast.kernels.nac_triton", "nac_fast.kernels.autotuner"),  # the autotuner: one way
    ("nac_fast.ops.collectives", "nac_fast.ops.loss"),             # the policy: in dispatch
    ("nac_fast.ops.dispatch", "nac_fast.ops.loss"),
])
def test_the_layers_of_issue_57(a, b):
    assert not _reaches(_graph(), a, b), f"{a} imports {b} (directly or through others)"
    assert _reaches(_graph(), "nac_fast.kernels.autotuner", "nac_fast.kernels.nac_triton")


def test_the_circle_check_sees_function_local_imports(tmp_path):
    """The checker finds a circle closed by an import inside a function, and none without it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n    from .c import g\n    return g\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    from ..sub import a\n    return a\n")
    roots = ((str(pkg), "pkg"),)
    graph = _graph(roots)
    assert graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.sub.a"}
    assert _cycle(graph) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.c", "pkg.sub.a"]
    (pkg / "sub" / "c.py").write_text("def g():\n    return 1\n")
    assert _cycle(_graph(roots)) is None
