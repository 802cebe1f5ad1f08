"""The momentum queue (nac_fast/ops/queue.py CodeQueue, kernels/queue_triton.py), one class
per subject:

- TestFusedEnqueue: the fused enqueue (CodeQueue.enqueue_tanh) gives the plain-PyTorch path's
  codes and pointer at awkward sizes, across the ring's end, in every queue dtype.
- TestQueueState: a checkpoint's bad queue entries are named errors before the queue changes;
  the Triton enqueue of codes gives the reference's bits in every dtype pairing.

Under TRITON_INTERPRET=1 (CI) the kernels run on CPU tensors; bench/gpu_suite.sh runs this file
with NAC_FAST_TEST_DEVICE=cuda.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import nac_fast
from nac_fast import CodeQueue


# ==== the fused enqueue ===========================================================================

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")


def ulps32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x - y| in units of float32's spacing at y (x, y float32)."""
    return (x.double() - y.double()).abs() / torch.finfo(torch.float32).eps / y.double().abs(
    ).clamp(min=torch.finfo(torch.float32).tiny)


def pair(M, D, qdt, start=0):
    """Two queues with the same state: one for each backend."""
    g = torch.Generator().manual_seed(M * 1000 + D)
    codes = torch.tanh(torch.randn(M, D, generator=g, dtype=torch.float64)).to(qdt)
    qs = []
    for _ in range(2):
        q = CodeQueue(M, D, device=DEVICE, dtype=qdt)
        q.codes.copy_(codes.to(DEVICE))
        q.ptr.fill_(start)
        qs.append(q)
    return qs


def check_same(qt, qr, in_dtype):
    assert int(qt.ptr) == int(qr.ptr)
    assert int(qt._arrived) == 0  # the counter is left zero for the next call
    ct, cr = qt.codes.cpu(), qr.codes.cpu()
    if ct.dtype == torch.float64 or in_dtype == torch.float64:
        torch.testing.assert_close(ct, cr, rtol=1e-14, atol=1e-15)
    elif ct.dtype == torch.float32:
        assert float(ulps32(ct, cr).max()) <= 2.0
    else:  # rounded to 16 bits: equal, or one unit apart where fp32's 2 ulp crossed a tie
        diff = (ct.float() - cr.float()).abs()
        unit = torch.finfo(ct.dtype).eps * cr.float().abs().clamp(min=torch.finfo(ct.dtype).tiny)
        assert bool((diff <= unit).all())
        assert float((diff > 0).float().mean()) < 0.01


class TestFusedEnqueue:
    """The momentum queue's fused enqueue (kernels/queue_triton.py, CodeQueue.enqueue_tanh): the
    same codes and write pointer as the plain-PyTorch path (cat, tanh in float32, index_copy_ at the
    pointer), at awkward sizes, across the ring's end, in every queue dtype; the arrival counter
    left zero; bad input refused before the queue changes.

    Under TRITON_INTERPRET=1 (CI) the kernel runs on CPU tensors; bench/gpu_suite.sh may run this
    file with NAC_FAST_TEST_DEVICE=cuda."""
    pytestmark = pytest.mark.skipif(
        "triton" not in nac_fast.available_backends(DEVICE),
        reason=f"the Triton kernels on {DEVICE} tensors (CPU: needs triton and TRITON_INTERPRET=1)")

    @pytest.mark.parametrize("qdt", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
    @pytest.mark.parametrize("M,D,n0,n1,start", [
        (1, 1, 1, 0, 0),            # a one-slot queue
        (3, 3, 1, 2, 2),            # wraps at once
        (97, 16, 40, 40, 90),       # across the end
        (1031, 128, 97, 97, 1000),  # awkward sizes, across the end
        (4099, 7, 1, 3, 4098),      # D not a power of two
        (64, 128, 32, 32, 0),       # the whole queue in one call
    ])
    def test_enqueue_tanh_matches_the_reference(self, qdt, M, D, n0, n1, start):
        g = torch.Generator().manual_seed(n0 + 7 * n1)
        in_dt = torch.float64 if qdt == torch.float64 else torch.float32
        x0 = (3 * torch.randn(n0, D, generator=g, dtype=in_dt)).to(DEVICE)
        x1 = (3 * torch.randn(n1, D, generator=g, dtype=in_dt)).to(DEVICE)
        qt, qr = pair(M, D, qdt, start)
        parts = (x0, x1) if n1 else (x0,)
        qt.enqueue_tanh(*parts, backend="triton")
        qr.enqueue_tanh(*parts, backend="reference")
        check_same(qt, qr, in_dt)
        assert int(qt.ptr) == (start + n0 + n1) % M
        # the rows outside the written slots are untouched
        written = {(start + i) % M for i in range(n0 + n1)}
        keep = torch.tensor([i not in written for i in range(M)])
        before = pair(M, D, qdt, start)[0].codes.cpu()
        assert torch.equal(qt.codes.cpu()[keep], before[keep])

    @pytest.mark.parametrize("in_dt", [torch.bfloat16, torch.float16])
    def test_16_bit_pre_activations_take_tanh_in_float32(self, in_dt):
        """AMP: the momentum network's outputs in 16 bits, tanh in float32, the queue in bf16."""
        g = torch.Generator().manual_seed(5)
        x0 = torch.randn(33, 64, generator=g).to(in_dt).to(DEVICE)
        x1 = torch.randn(33, 64, generator=g).to(in_dt).to(DEVICE)
        qt, qr = pair(100, 64, torch.bfloat16, start=80)
        qt.enqueue_tanh(x0, x1, backend="triton")
        qr.enqueue_tanh(x0, x1, backend="reference")
        check_same(qt, qr, torch.float32)

    def test_repeated_calls_and_strided_rows_and_three_parts(self):
        """Consecutive calls advance the pointer on the device; rows with a row stride (a view) and
        more than two parts (folded into two) give the reference's codes."""
        qt, qr = pair(50, 24, torch.float32)
        g = torch.Generator().manual_seed(0)
        for step in range(7):
            big = torch.randn(9, 48, generator=g).to(DEVICE)
            x0 = big[:, :24]                      # row stride 48
            x1 = torch.randn(4, 24, generator=g).to(DEVICE)
            x2 = torch.randn(2, 24, generator=g).to(DEVICE)
            qt.enqueue_tanh(x0, x1, x2, backend="triton")
            qr.enqueue_tanh(x0, x1, x2, backend="reference")
            check_same(qt, qr, torch.float32)
        assert int(qt.ptr) == (7 * 15) % 50

    def test_extreme_values_and_zero_rows(self):
        """tanh saturates to +-1 and keeps zeros and tiny values; an empty part is allowed."""
        x0 = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0, 1e4, -1e4]]).to(DEVICE)
        qt, qr = pair(4, 8, torch.float32, start=3)
        qt.enqueue_tanh(x0, x0[:0], backend="triton")
        qr.enqueue_tanh(x0, x0[:0], backend="reference")
        check_same(qt, qr, torch.float32)
        got = qt.codes.cpu()[3]
        assert got[4] == 1 and got[5] == -1 and got[6] == 1 and got[7] == -1
        assert got[0] == 0 and got[1] == 0  # tanh(-0) may come back +0 (csrc/nac_math.h's formula)
        assert float(got[2]) == float(torch.tensor(1e-30)) and float(got[3]) == -float(got[2])

    def test_bad_input_is_refused_before_the_queue_changes(self):
        q = CodeQueue(8, 4, device=DEVICE)
        x = torch.randn(3, 4).to(DEVICE)
        before = q.codes.clone()
        cases = [
            (lambda: q.enqueue_tanh(backend="triton"), ValueError, "at least one"),
            (lambda: q.enqueue_tanh(x, torch.randn(3, 5).to(DEVICE)), ValueError, r"parts\[1\]"),
            (lambda: q.enqueue_tanh(x, x.double()), TypeError, "one dtype"),
            (lambda: q.enqueue_tanh(torch.ones(3, 4, dtype=torch.int64).to(DEVICE)), TypeError,
             "floating"),
            (lambda: q.enqueue_tanh(x, x, x), ValueError, "9 keys into a queue of size 8"),
            (lambda: q.enqueue_tanh(torch.randn(3, 4, device="meta")), ValueError, "meta"),
            (lambda: q.enqueue_tanh(x, backend="cuda"), ValueError, "backend must be"),
            (lambda: q.enqueue_tanh([x]), TypeError, r"parts\[0\]"),
        ]
        for fn, exc, match in cases:
            with pytest.raises(exc, match=match):
                fn()
        assert torch.equal(q.codes, before) and int(q.ptr) == 0

    def test_triton_refuses_what_it_does_not_handle(self):
        from nac_fast.kernels.nac_triton import MAX_D
        q = CodeQueue(4, MAX_D + 1, device=DEVICE)
        with pytest.raises(ValueError, match=f"D={MAX_D + 1}"):
            q.enqueue_tanh(torch.randn(1, MAX_D + 1).to(DEVICE), backend="triton")
        # auto takes the reference there, with the same result
        q.enqueue_tanh(torch.zeros(1, MAX_D + 1).to(DEVICE))
        assert int(q.ptr) == 1

    def test_auto_picks_triton_on_cuda_only(self, monkeypatch):
        """auto: the fused kernel on CUDA tensors (eager), the reference on CPU tensors even under
        the interpreter (whose kernels are for tests, not speed)."""
        from nac_fast.kernels import queue_triton
        calls = []
        real = queue_triton.enqueue
        monkeypatch.setattr(queue_triton, "enqueue",
                            lambda *a, **k: (calls.append(1), real(*a, **k)))
        q = CodeQueue(8, 4, device=DEVICE)
        q.enqueue_tanh(torch.randn(2, 4).to(DEVICE))
        assert len(calls) == (1 if DEVICE.startswith("cuda") else 0)

    def test_state_dict_leaves_the_counter_out(self):
        q = CodeQueue(8, 4, device=DEVICE)
        assert set(q.state_dict()) == {"codes", "ptr"}
        q2 = CodeQueue(8, 4, device=DEVICE)
        q2.load_state_dict(q.state_dict())

    def test_criterion_runs_the_fused_enqueue_with_the_triton_backend(self, monkeypatch):
        """NACMQLoss(backend="triton") enqueues through the kernel; its loss and queue match the
        reference criterion's (the codes within the tanh formula's ulps)."""
        from nac_fast.kernels import queue_triton
        calls = []
        real = queue_triton.enqueue
        monkeypatch.setattr(queue_triton, "enqueue",
                            lambda *a, **k: (calls.append(1), real(*a, **k)))
        K, D = 6, 16
        g = torch.Generator().manual_seed(1)
        mk = lambda: torch.randn(K, D, generator=g, dtype=torch.float64).to(DEVICE)  # noqa: E731
        a0, r0, a1, r1, am0, rm0, am1, rm1 = (mk() for _ in range(8))
        noise = torch.where(torch.rand(2 * K, D, generator=g) < 0.1, -1.0, 1.0).double().to(DEVICE)
        out = {}
        for backend in ("triton", "reference"):
            q = CodeQueue(5 * K, D, device=DEVICE, dtype=torch.float64)
            crit = nac_fast.NACMQLoss(0.1, backend=backend)
            loss = crit((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), q, noise=noise)
            out[backend] = (float(loss), q.codes.cpu(), int(q.ptr))
        assert calls == [1]
        assert out["triton"][2] == out["reference"][2] == 2 * K
        torch.testing.assert_close(out["triton"][1], out["reference"][1], rtol=1e-14, atol=1e-15)
        assert (abs(out["triton"][0] - out["reference"][0])
                <= 1e-12 * max(1.0, abs(out["reference"][0])))

    @pytest.mark.parametrize("qdt,kdt", [
        (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16), (torch.float64, torch.float32),
        (torch.float32, torch.float64), (torch.bfloat16, torch.float64)])
    def test_enqueue_of_codes_matches_the_reference_bit_for_bit(self, qdt, kdt):
        """enqueue(keys) (no tanh): the codes are the keys converted to the queue's dtype, the same
        bits on both paths, across the ring's end and over several calls."""
        qt, qr = pair(37, 9, qdt, start=30)
        g = torch.Generator().manual_seed(3)
        for n in (1, 11, 37, 5):
            keys = torch.tanh(torch.randn(n, 9, generator=g, dtype=torch.float64)).to(kdt).to(
                DEVICE)
            qt.enqueue(keys, backend="triton")
            qr.enqueue(keys, backend="reference")
            assert int(qt.ptr) == int(qr.ptr) and int(qt._arrived) == 0
            assert torch.equal(qt.codes.cpu(), qr.codes.cpu()), (n, qdt, kdt)

    def test_enqueue_refuses_bad_keys_and_takes_integers_by_the_reference(self):
        q = CodeQueue(8, 4, device=DEVICE)
        with pytest.raises(ValueError, match=r"keys must have shape \(n, 4\)"):
            q.enqueue(torch.zeros(2, 3).to(DEVICE))
        with pytest.raises(ValueError, match="9 keys into a queue of size 8"):
            q.enqueue(torch.zeros(9, 4).to(DEVICE))
        with pytest.raises(ValueError, match="floating"):
            q.enqueue(torch.ones(2, 4, dtype=torch.int64).to(DEVICE), backend="triton")
        q.enqueue(torch.ones(2, 4, dtype=torch.int64).to(DEVICE))  # auto: the reference converts
        assert int(q.ptr) == 2 and bool((q.codes.cpu()[:2] == 1).all())


# ==== checkpoints and the enqueue's bits ==========================================================

def _holder(size=6, dim=3):
    """A queue inside a larger module, as in NACMQ or a user's training module."""
    m = nn.Module()
    m.queue = CodeQueue(size, dim)
    m.queue.enqueue(torch.full((2, dim), 0.5))
    return m


def _unchanged(m):
    assert int(m.queue.ptr) == 2
    assert bool((m.queue.codes[:2] == 0.5).all()) and not m.queue.codes[2:].any()


class TestQueueState:
    """The momentum queue as a library user meets it (nac_fast/ops/queue.py CodeQueue):
    a checkpoint's bad queue entries are named errors that name the state dict's key, before the
    queue changes; the Triton enqueue of codes gives the reference's bits in every dtype pairing.

    The Triton test runs the kernel under TRITON_INTERPRET=1 on CPU tensors (or on
    NAC_FAST_TEST_DEVICE=cuda), and is skipped where Triton does not run."""

    def test_a_checkpoint_whose_codes_are_no_tensor_is_a_named_type_error(self):
        m = _holder()
        with pytest.raises(TypeError,
                           match=r"queue codes in the checkpoint must be a torch\.Tensor, "
                                 r"got list \(key 'queue\.codes'\)"):
            m.load_state_dict({"queue.codes": [[0.0] * 3] * 6, "queue.ptr": torch.tensor(1)})
        _unchanged(m)

    @pytest.mark.parametrize("sd,exc,msg", [
        ({"queue.codes": torch.zeros(5, 3), "queue.ptr": torch.tensor(0)}, ValueError,
         r"has shape \(5, 3\), this run expects \(6, 3\) \(key 'queue\.codes'"),
        ({"queue.codes": torch.zeros(6, 4), "queue.ptr": torch.tensor(0)}, ValueError,
         r"has shape \(6, 4\).*\(key 'queue\.codes'"),
        ({"queue.codes": torch.zeros(6, 3, dtype=torch.int64), "queue.ptr": torch.tensor(0)},
         TypeError, r"must be floating, got torch\.int64 \(key 'queue\.codes'\)"),
        ({"queue.codes": torch.zeros(6, 3), "queue.ptr": torch.tensor(6)}, ValueError,
         r"queue pointer \(ptr\) in the checkpoint is 6.*\(key 'queue\.ptr'\)"),
        ({"queue.codes": torch.zeros(6, 3), "queue.ptr": torch.tensor(1.0)}, TypeError,
         r"queue pointer \(ptr\).*one-element integer tensor.*\(key 'queue\.ptr'\)"),
    ])
    def test_checkpoint_errors_name_the_key_and_leave_the_queue(self, sd, exc, msg):
        m = _holder()
        with pytest.raises(exc, match=msg):
            m.load_state_dict(sd)
        _unchanged(m)

    def test_a_good_checkpoint_of_another_dtype_still_loads_converted(self):
        m = _holder()
        m.load_state_dict({"queue.codes": torch.full((6, 3), 0.25, dtype=torch.float64),
                           "queue.ptr": torch.tensor(5, dtype=torch.int32)})
        assert m.queue.codes.dtype == torch.float32 and bool((m.queue.codes == 0.25).all())
        assert m.queue.ptr.dtype == torch.int64 and int(m.queue.ptr) == 5

    @pytest.mark.skipif("triton" not in nac_fast.available_backends(DEVICE),
                        reason=f"the Triton kernels on {DEVICE} tensors (CPU: needs triton and "
                               "TRITON_INTERPRET=1)")
    @pytest.mark.parametrize("kdt", [torch.float64, torch.float32])
    def test_triton_enqueue_into_a_float16_queue_gives_the_reference_bits(self, kdt):
        """enqueue(keys, backend="triton") promises the reference's codes bit for bit.  torch
        converts float64 to float16 through float32 (two roundings); a key just above a float16 tie
        (0.5 (1 + 2^-11 + 2^-40)) then lands on the even neighbour 0.5, where one rounding gives the
        odd one above it."""
        g = torch.Generator().manual_seed(5)
        keys = torch.tanh(torch.randn(29, 5, generator=g, dtype=torch.float64))
        keys[:3] = 0.5 * (1 + 2 ** -11 + 2 ** -40)
        keys[3:6] = -0.25 * (1 + 2 ** -11 + 2 ** -40)
        keys = keys.to(kdt).to(DEVICE)
        qs = []
        for backend in ("triton", "reference"):
            q = CodeQueue(31, 5, device=DEVICE, dtype=torch.float16)
            q.ptr.fill_(20)
            q.enqueue(keys, backend=backend)
            q.enqueue(keys[:7], backend=backend)
            qs.append(q)
        assert int(qs[0].ptr) == int(qs[1].ptr) == (20 + 29 + 7) % 31
        assert torch.equal(qs[0].codes.cpu(), qs[1].codes.cpu())
