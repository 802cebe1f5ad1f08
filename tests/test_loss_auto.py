"""backend="auto" never picks the slower CPU path (issue 23, item 6).

The fused CPU kernel widens bf16 to fp32; with the keys' gradient (the in-batch loss, or keys
requiring a gradient) it runs 4 fp32 GEMMs where the eager reference runs 3 bf16 ones on the CPU's
AVX512-BF16 units, and was 1.10-1.97x slower (bench/results/loss_cpu.csv).  There "auto" picks
the reference, and says why (dispatch.explain_auto); everywhere else the fused kernel.
"""
import pytest
import torch

import nac_fast
from nac_fast.ops import dispatch

pytestmark = pytest.mark.skipif("cpu" not in nac_fast.available_backends("cpu"),
                                reason="the compiled CPU kernel is not built")


def _t(dtype, grad=True, rows=8):
    return torch.randn(rows, 16, dtype=dtype).requires_grad_(grad)


def test_bf16_with_keys_gradient_runs_the_reference():
    a = _t(torch.bfloat16)
    assert dispatch.resolve_backend("auto", a, keys=None) == "reference"
    assert dispatch.resolve_backend("auto", a, keys=_t(torch.bfloat16, rows=32)) == "reference"
    assert "reference" in dispatch.explain_auto(a, keys=None)
    assert "bf16" in dispatch.explain_auto(a, keys=None)


@pytest.mark.parametrize("case", ["fp32", "fp16", "queue", "no_grad", "a_without_grad",
                                  "keys_unsaid"])
def test_everything_else_runs_the_fused_kernel(case):
    a = _t(torch.float32 if case == "fp32" else torch.float16 if case == "fp16"
           else torch.bfloat16, grad=case != "a_without_grad")
    kw = dict(keys=None)
    if case == "queue":   # NAC-MQ: the queue takes no gradient
        kw = dict(keys=_t(torch.bfloat16, grad=False, rows=64))
    if case == "keys_unsaid":
        kw = {}
    if case == "no_grad":
        with torch.no_grad():
            assert dispatch.resolve_backend("auto", a, **kw) == "cpu"
        return
    assert dispatch.resolve_backend("auto", a, **kw) == "cpu"
    assert "'cpu'" in dispatch.explain_auto(a, **kw)


def test_explicit_backends_are_kept():
    a = _t(torch.bfloat16)
    assert dispatch.resolve_backend("cpu", a, keys=None) == "cpu"
