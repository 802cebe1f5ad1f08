"""Audit of the momentum queue as a library user meets it (nac_fast/ops/queue.py CodeQueue):
a checkpoint's bad queue entries are named errors that name the state dict's key, before the
queue changes; the Triton enqueue of codes gives the reference's bits in every dtype pairing.

The Triton test runs the kernel under TRITON_INTERPRET=1 on CPU tensors (or on
NAC_FAST_TEST_DEVICE=cuda), and is skipped where Triton does not run.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import nac_fast
from nac_fast import CodeQueue

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")


def _holder(size=6, dim=3):
    """A queue inside a larger module, as in NACMQ or a user's training module."""
    m = nn.Module()
    m.queue = CodeQueue(size, dim)
    m.queue.enqueue(torch.full((2, dim), 0.5))
    return m


def _unchanged(m):
    assert int(m.queue.ptr) == 2
    assert bool((m.queue.codes[:2] == 0.5).all()) and not m.queue.codes[2:].any()


def test_a_checkpoint_whose_codes_are_no_tensor_is_a_named_type_error():
    m = _holder()
    with pytest.raises(TypeError, match=r"queue codes in the checkpoint must be a torch\.Tensor, "
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
def test_checkpoint_errors_name_the_key_and_leave_the_queue(sd, exc, msg):
    m = _holder()
    with pytest.raises(exc, match=msg):
        m.load_state_dict(sd)
    _unchanged(m)


def test_a_good_checkpoint_of_another_dtype_still_loads_converted():
    m = _holder()
    m.load_state_dict({"queue.codes": torch.full((6, 3), 0.25, dtype=torch.float64),
                       "queue.ptr": torch.tensor(5, dtype=torch.int32)})
    assert m.queue.codes.dtype == torch.float32 and bool((m.queue.codes == 0.25).all())
    assert m.queue.ptr.dtype == torch.int64 and int(m.queue.ptr) == 5


@pytest.mark.skipif("triton" not in nac_fast.available_backends(DEVICE),
                    reason=f"the Triton kernels on {DEVICE} tensors (CPU: needs triton and "
                           "TRITON_INTERPRET=1)")
@pytest.mark.parametrize("kdt", [torch.float64, torch.float32])
def test_triton_enqueue_into_a_float16_queue_gives_the_reference_bits(kdt):
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
