"""A kernel's own bound statements, run apart (tests/test_loss_numerics.py,
tests/test_hamming_gpu.py): the ``start = ...`` / ``end = ...`` lines of a Triton kernel's
source, compiled into a small probe kernel with the same argument types, so that their int32
arithmetic can be run at sizes no test could allocate (under TRITON_INTERPRET=1)."""
from __future__ import annotations

import importlib.util
import inspect
import textwrap


def bound_statements(kernel) -> str:
    """The kernel's ``start = ...`` and ``end = ...`` lines (exactly one of each)."""
    src = inspect.getsource(getattr(kernel, "fn", kernel))
    lines = [ln.strip() for ln in src.splitlines() if ln.strip().startswith(("start = ", "end = "))]
    assert len(lines) == 2, lines
    return "\n".join(lines)


def bounds_probe(kernel, tmp_path, *, pid: str, ints: tuple, stores: tuple,
                 constexprs: tuple = ()):
    """probe[(programs,)](out, *ints, *constexprs): for program `pid` = program_id(0), runs the
    kernel's bound statements with `ints` as runtime int arguments (do_not_specialize: int32
    below 2^31, as the kernel types them) and `constexprs`, then stores each expression of
    `stores` as int64 at out[len(stores) * pid + i]."""
    name = getattr(kernel, "fn", kernel).__name__
    params = ", ".join(list(ints) + [f"{c}: tl.constexpr" for c in constexprs])
    lines = [f"    {pid} = tl.program_id(0)", textwrap.indent(bound_statements(kernel), " " * 4)]
    lines += [f"    tl.store(out_ptr + {len(stores)} * {pid} + {i}, ({e}).to(tl.int64))"
              for i, e in enumerate(stores)]
    path = tmp_path / f"probe_{name}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n"
                    f"@triton.jit(do_not_specialize={list(ints)!r})\n"
                    f"def probe(out_ptr, {params}):\n" + "\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.probe
