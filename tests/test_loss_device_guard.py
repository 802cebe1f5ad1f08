"""Every Triton launch runs under its tensors' device (issue 23, item 2).

A process holding tensors on cuda:1 while the current device is cuda:0 must launch on cuda:1:
kernels/launch.py's `run` enters `device_guard(device)` = torch.cuda.device(device) around every
plan.  Checked here with no GPU: the ops' bodies run on fake cuda:1 tensors (FakeTensorMode makes
them without a device), torch.cuda.device is replaced by a recorder, and the kernel launch itself
(torch.library.wrap_triton) by one that notes which device context is open when it is called.
"""
import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nac_fast.kernels import hamming_triton, launch, nac_noise_triton, nac_triton


class Recorder:
    def __init__(self):
        self.open = []      # device indices of the guards entered and not yet left
        self.launches = []  # (kernel name, the innermost open guard's index or None)

    def device(self, device):
        rec = self

        class Guard:
            def __enter__(self):
                rec.open.append(torch.device(device).index)

            def __exit__(self, *exc):
                rec.open.pop()
                return False
        return Guard()

    def wrap_triton(self, kernel):
        rec = self

        class Launcher:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    rec.launches.append((kernel.__name__, rec.open[-1] if rec.open else None))
                return call
        return Launcher()


def _fake_devices(count: int) -> None:
    """Fake cuda:k tensors need no GPU where CUDA is absent (CI); where it is present the runtime
    checks each device index, so a machine with fewer GPUs than the test's indices skips (the
    logic is what CI checks; a multi-GPU machine runs it for real)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < count:
        pytest.skip(f"fake cuda:{count - 1} tensors need {count} GPUs on a machine with CUDA; this "
                    f"one has {torch.cuda.device_count()} (CI checks it without CUDA)")


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "device", rec.device)
    monkeypatch.setattr(torch.library, "wrap_triton", rec.wrap_triton)
    # the GPU's figures (no GPU here): sm_90, one block per SM
    monkeypatch.setattr(launch, "_cuda_target", lambda index: launch.SM90)
    return rec


def _ops(dev):
    """(name, thunk) of every Triton op's body on `dev` tensors."""
    n, N, D = 70, 300, 32
    a, r, noise = (torch.empty(n, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    keys = torch.empty(N, D, device=dev, dtype=torch.bfloat16)
    lse, g = torch.empty(n, device=dev), torch.empty(n, device=dev)
    ga = torch.empty(n, D, device=dev)

    def fwd(keys):
        return nac_triton.fwd(a, r, noise, keys, 1.1, 0.1, True)

    def bwd(keys):
        q, k = fwd(keys)[3:5]
        return nac_triton.bwd(a, r, noise, keys, lse, ga, g, q, k, 1.1, True, True,
                              keys is not None)
    qw = torch.empty(40, 2, device=dev, dtype=torch.int64)
    gw = torch.empty(90, 2, device=dev, dtype=torch.int64)
    ql = torch.empty(40, device=dev, dtype=torch.int64)
    gl = torch.empty(90, device=dev, dtype=torch.int64)
    seed = torch.empty(1, device=dev, dtype=torch.int64)
    return [("loss fwd, in-batch", lambda: fwd(None)), ("loss fwd, keys", lambda: fwd(keys)),
            ("loss bwd, in-batch", lambda: bwd(None)), ("loss bwd, keys", lambda: bwd(keys)),
            ("noise", lambda: nac_noise_triton.noise(a, seed, 0.1)),
            ("hamming cdist", lambda: hamming_triton.cdist(qw, gw)),
            ("hamming ap", lambda: hamming_triton.average_precision(qw, gw, ql, gl, 100))]


@pytest.mark.parametrize("index", [1, 3])
def test_every_op_launches_under_its_tensors_device(recorder, index):
    _fake_devices(index + 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ops = _ops(torch.device("cuda", index))
        for name, op in ops:
            recorder.launches.clear()
            op()
            assert recorder.launches, f"{name}: no launch recorded"
            outside = [k for k, dev in recorder.launches if dev != index]
            assert not outside, f"{name}: {outside} launched outside torch.cuda.device({index})"
            assert not recorder.open, f"{name}: a device guard was left open"


def test_cpu_tensors_enter_no_cuda_device(recorder):
    """The interpreter's CPU tensors: no torch.cuda call at all (there may be no CUDA)."""
    assert isinstance(launch.device_guard(torch.device("cpu")), contextlib.nullcontext)


def test_a_plan_on_two_devices_is_refused():
    _fake_devices(2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, device="cuda:0")
        y = torch.empty(4, device="cuda:1")
        L = launch.Launch(None, (1,), (x, y), {}, 4, 1)
        with pytest.raises(ValueError, match="one device"):
            launch.launch_device([L])
