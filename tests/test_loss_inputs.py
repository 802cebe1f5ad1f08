"""Bad input is a ValueError/TypeError naming the argument: never a crash, never a silent result."""
import math

import pytest
import torch

import nac_fast

BACKENDS = nac_fast.available_backends("cpu")


def _ok(n=4, D=3, N=5):
    return torch.randn(n, D), torch.randn(n, D), torch.tanh(torch.randn(N, D))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p,exc", [(0.0, ValueError), (0.5, ValueError), (-0.1, ValueError),
                                   (1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                                   ("0.1", TypeError), (True, TypeError), (None, TypeError),
                                   (torch.tensor([0.1, 0.2]), TypeError)])
def test_bad_p(backend, p, exc):
    a, r, q = _ok()
    with pytest.raises(exc, match="p must"):
        nac_fast.nac_loss(a, r, p, backend=backend)
    with pytest.raises(exc, match="p must"):
        nac_fast.nac_mq_loss(a, r, q, p, backend=backend)


def test_p_as_scalar_tensor_is_accepted():
    a, r, _ = _ok()
    noise = nac_fast.draw_noise(a.shape, 0.1)
    assert torch.equal(nac_fast.nac_loss(a, r, torch.tensor(0.1), noise=noise),
                       nac_fast.nac_loss(a, r, 0.1, noise=noise))


@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_mismatches(backend):
    a, r, q = _ok()
    with pytest.raises(ValueError, match="r must have 4 rows"):
        nac_fast.nac_loss(a, r[:3], 0.1, backend=backend)
    with pytest.raises(ValueError, match="r must have D=3"):
        nac_fast.nac_loss(a, torch.randn(4, 2), 0.1, backend=backend)
    with pytest.raises(ValueError, match="queue must have D=3"):
        nac_fast.nac_mq_loss(a, r, torch.randn(5, 2), 0.1, backend=backend)
    with pytest.raises(ValueError, match="r_hat must have 4 rows"):
        nac_fast.nac_mq_loss(a, r[:2], q, 0.1, backend=backend)
    with pytest.raises(ValueError, match="keys must have D=3"):
        nac_fast.nac_loss(a, r, 0.1, keys=torch.randn(5, 4), backend=backend)
    with pytest.raises(ValueError, match="noise must have a's shape"):
        nac_fast.nac_loss(a, r, 0.1, noise=torch.ones(4, 2), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [torch.zeros(4, 3), torch.full((4, 3), 0.5), torch.full((4, 3), 2.0)])
def test_noise_values_must_be_pm1(backend, bad):
    a, r, _ = _ok()
    with pytest.raises(ValueError, match="noise must contain only -1 and \\+1"):
        nac_fast.nac_loss(a, r, 0.1, noise=bad, backend=backend)


def test_noise_type_errors():
    a, r, _ = _ok()
    with pytest.raises(TypeError, match="noise"):
        nac_fast.nac_loss(a, r, 0.1, noise=[[1.0] * 3] * 4)
    with pytest.raises(TypeError, match="noise"):
        nac_fast.nac_loss(a, r, 0.1, noise=torch.ones(4, 3, dtype=torch.bool))
    # integer +-1 noise is fine: the loss of the same float noise, flips included
    nac_fast.nac_loss(a, r, 0.1, noise=torch.ones(4, 3, dtype=torch.int8))
    m = nac_fast.draw_noise((4, 3), 0.3, generator=torch.Generator().manual_seed(2))
    assert (m == -1).any() and (m == 1).any()
    for dtype in (torch.int8, torch.int32, torch.int64):
        assert torch.equal(nac_fast.nac_loss(a, r, 0.1, noise=m.to(dtype)),
                           nac_fast.nac_loss(a, r, 0.1, noise=m)), dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_and_rank_errors(backend):
    a, r, q = _ok()
    with pytest.raises(TypeError, match="a must have a floating dtype"):
        nac_fast.nac_loss(a.long(), r, 0.1, backend=backend)
    with pytest.raises(TypeError, match="r must have a floating dtype"):
        nac_fast.nac_loss(a, r.int(), 0.1, backend=backend)
    with pytest.raises(TypeError, match="queue must have a floating dtype"):
        nac_fast.nac_mq_loss(a, r, q.long(), 0.1, backend=backend)
    with pytest.raises(TypeError, match="r must have a's dtype"):
        nac_fast.nac_loss(a, r.double(), 0.1, backend=backend)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        nac_fast.nac_loss(a.numpy(), r, 0.1, backend=backend)
    with pytest.raises(ValueError, match="a must be 2-D"):
        nac_fast.nac_loss(a[0], r[0], 0.1, backend=backend)
    with pytest.raises(ValueError, match="r must be 2-D"):
        nac_fast.nac_loss(a, r[None], 0.1, backend=backend)
    with pytest.raises(TypeError, match="queue must be a torch.Tensor"):
        nac_fast.nac_mq_loss(a, r, None, 0.1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    a, r, q = _ok()
    with pytest.raises(ValueError, match="a must be non-empty"):
        nac_fast.nac_loss(a[:0], r[:0], 0.1, backend=backend)
    with pytest.raises(ValueError, match="queue must be non-empty"):
        nac_fast.nac_mq_loss(a, r, q[:0], 0.1, backend=backend)
    with pytest.raises(ValueError, match="a must be non-empty"):
        nac_fast.nac_loss(a[:, :0], r[:, :0], 0.1, backend=backend)


def test_mixed_devices():
    a, r, q = _ok()
    with pytest.raises(ValueError, match="r is on meta but a is on cpu"):
        nac_fast.nac_loss(a, r.to("meta"), 0.1)
    with pytest.raises(ValueError, match="queue is on meta"):
        nac_fast.nac_mq_loss(a, r, q.to("meta"), 0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["a", "r", "keys"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs(backend, which, value):
    a, r, q = _ok()
    t = {"a": a, "r": r, "keys": q}[which]
    t[1, 2] = value
    with pytest.raises(ValueError, match=f"{which} contains NaN or inf"):
        nac_fast.nac_loss(a, r, 0.1, keys=q, backend=backend)
    if which == "keys":
        with pytest.raises(ValueError, match="queue contains NaN or inf"):
            nac_fast.nac_mq_loss(a, r, q, 0.1, backend=backend)


def test_reduction_backend_l2_queue_errors():
    a, r, q = _ok()
    with pytest.raises(ValueError, match="reduction must be one of"):
        nac_fast.nac_loss(a, r, 0.1, reduction="avg")
    with pytest.raises(ValueError, match="backend must be one of .* available here"):
        nac_fast.nac_loss(a, r, 0.1, backend="tpu")
    with pytest.raises(ValueError, match="backend 'cuda' is not available for cpu tensors"):
        nac_fast.nac_loss(a, r, 0.1, backend="cuda")
    with pytest.raises(ValueError, match="l2 must be a finite float >= 0"):
        nac_fast.nac_mq_loss(a, r, q, 0.1, l2=-1.0)
    with pytest.raises(ValueError, match="l2 must be"):
        nac_fast.nac_mq_loss(a, r, q, 0.1, l2=math.nan)
    with pytest.raises(ValueError, match="queue must not require grad"):
        nac_fast.nac_mq_loss(a, r, q.requires_grad_(), 0.1)
    with pytest.raises(TypeError, match="device must be"):
        nac_fast.available_backends(3)


def test_direct_op_calls_are_checked():
    """torch.ops entry points check shapes too (a RuntimeError, not a crash)."""
    if "cpu" not in BACKENDS:
        pytest.skip("no compiled extension")
    a, r, _ = _ok()
    with pytest.raises(RuntimeError, match="noise must have a's shape"):
        torch.ops.nac_fast.nac_fwd(a, r, torch.ones(2, 2), None, 1.0, 0.0, False)
    with pytest.raises(RuntimeError, match="keys must be a non-empty"):
        torch.ops.nac_fast.nac_fwd(a, r, torch.ones(4, 3), torch.ones(0, 3), 1.0, 0.0, False)


def test_vi_loss_checks_inputs():
    a, r, _ = _ok()
    with pytest.raises(ValueError, match="r must have 4 rows"):
        nac_fast.nac_vi_loss(a, r[:1], 0.1)
    with pytest.raises(ValueError, match="p must"):
        nac_fast.nac_vi_loss(a, r, 0.7)


def test_draw_noise_and_channel_scale_check_p():
    with pytest.raises(ValueError, match="p must"):
        nac_fast.draw_noise((2, 2), 0.6)
    for bad in (0.0, 0.5, 0.7):
        with pytest.raises(ValueError, match="p must"):
            nac_fast.channel_scale(bad)
    assert nac_fast.channel_scale(0.1) == pytest.approx(0.5 * math.log(9.0))


def test_works_without_compiled_extension_with_one_warning():
    """Without nac_fast._C the package imports, warns once (not per call) and runs 'auto' on the
    reference backend.  Run in a fresh interpreter where importing the extension fails."""
    import os
    import subprocess
    import sys
    code = (
        "import sys, warnings\n"
        "sys.modules['nac_fast._C'] = None  # makes 'from . import _C' raise ImportError\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import torch, nac_fast\n"
        "    a, r = torch.randn(6, 4, requires_grad=True), torch.randn(6, 4)\n"
        "    for _ in range(3):\n"
        "        nac_fast.nac_loss(a, r, 0.1).backward()\n"
        "    mine = [x for x in w if 'compiled extension not available' in str(x.message)]\n"
        "print(len(mine), nac_fast.available_backends('cpu'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1 ['reference']"


# ---- value-check policy (nac_fast.ops.loss.CHECK_VALUES, NAC_FAST_CHECK_INPUTS) ---------------------

@pytest.mark.parametrize("env,mode", [("", "auto"), ("auto", "auto"), (" AUTO ", "auto"),
                                      ("1", True), ("true", True), ("on", True),
                                      ("0", False), ("false", False), ("off", False)])
def test_check_inputs_env_values(env, mode):
    got = nac_fast.ops.loss._parse_check_values(env)
    assert got == mode and type(got) is type(mode)


def test_check_inputs_env_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="NAC_FAST_CHECK_INPUTS must be 0, 1 or auto"):
        nac_fast.ops.loss._parse_check_values("2")


def test_value_checks_policy_by_device():
    from nac_fast.ops.loss import value_checks, value_checks_on
    on = {}
    for mode in ("auto", True, False):
        with value_checks(mode):
            on[mode] = {dev: value_checks_on(torch.device(dev)) for dev in ("cpu", "cuda", "meta")}
    assert on["auto"] == {"cpu": True, "cuda": False, "meta": False}   # no host sync on a GPU
    assert on[True] == {"cpu": True, "cuda": True, "meta": False}
    assert on[False] == {"cpu": False, "cuda": False, "meta": False}
    assert nac_fast.ops.loss.CHECK_VALUES == "auto"                         # restored


def test_check_values_off_skips_value_checks_but_not_metadata_checks():
    a, r, q = _ok()
    a[0, 0] = math.nan
    with nac_fast.ops.loss.value_checks(False):
        assert math.isnan(nac_fast.nac_loss(a, r, 0.1, keys=q).item())   # NaN reaches the loss
        nac_fast.nac_loss(a, r, 0.1, noise=torch.full((4, 3), 2.0))      # unchecked noise
        with pytest.raises(ValueError, match="r must have 4 rows"):
            nac_fast.nac_loss(a, r[:3], 0.1)
        with pytest.raises(TypeError, match="r must have a's dtype"):
            nac_fast.nac_loss(a, r.double(), 0.1)
    with pytest.raises(ValueError, match="a contains NaN or inf"):    # back to "auto": checked
        nac_fast.nac_loss(a, r, 0.1)


def test_check_values_global_switch_and_bad_values(monkeypatch):
    a, r, _ = _ok()
    a[0, 0] = math.inf
    monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", False)   # the documented switch
    nac_fast.nac_loss(a, r, 0.1)
    monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", True)
    with pytest.raises(ValueError, match="a contains NaN or inf"):
        nac_fast.nac_loss(a, r, 0.1)
    monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", "yes")
    with pytest.raises(ValueError, match="CHECK_VALUES must be True, False or 'auto'"):
        nac_fast.nac_loss(a, r, 0.1)
    with pytest.raises(ValueError, match="mode must be True, False or 'auto'"):
        with nac_fast.ops.loss.value_checks(1):
            pass


def test_step_value_checks_follow_the_policy(monkeypatch):
    from nac_fast.train.methods import step_value_checks
    for outer, inner in (("auto", False), (False, False), (True, True)):
        monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", outer)
        with step_value_checks():
            assert nac_fast.ops.loss.CHECK_VALUES is inner
        assert nac_fast.ops.loss.CHECK_VALUES == outer
