"""Out-of-bounds reads and writes, and reads of memory nothing wrote, in every Triton kernel the
package launches: the NAC losses (in-batch, given keys, the queue, the criterion's fused inference
term, folded and unfolded tails, every fp32 product mode), the queue's enqueue, the channel noise
and the Hamming engine (distances, top-k, mAP).

Each op runs three times on the same inputs: plain, then under tests/_redzone.py's red zones with
two fills (0x7F and 0xFF bytes around every storage a launch is handed, in the plans' uninitialised
buffers and in the padding columns of the inputs, whose rows are strided).  A kernel that writes
outside its tensors fails on the red zone it changed; one that reads outside them (or reads a
buffer before writing it) and uses what it read gives results that depend on the fill.  So the
three runs must give the same bits.  The interpreter (CI) runs the kernels' own index arithmetic
and masks; on a GPU machine the same tests run the compiled kernels (NAC_FAST_TEST_DEVICE=cuda).
"""
from __future__ import annotations

import os

import pytest
import torch

import nac_fast
from nac_fast.ops.noise import noise_from_seed

from _redzone import Redzones, same_bits

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")
FILLS = (0x7F, 0xFF)

pytestmark = pytest.mark.skipif(
    "triton" not in nac_fast.available_backends(DEVICE),
    reason=f"backend 'triton' does not run on {DEVICE} tensors here")


def _padded(x: torch.Tensor, fill: int, pad: int = 3) -> torch.Tensor:
    """x as a view whose rows are `pad` elements longer than its columns (a strided row
    operand, unit column stride), the padding bytes set to `fill`."""
    rows, cols = x.shape
    base = torch.empty((rows, cols + pad), dtype=x.dtype, device=DEVICE)
    base.view(torch.uint8).fill_(fill)
    view = base[:, :cols]
    view.copy_(x)
    return view


def _three(op, inputs_for):
    """The results of op(*inputs_for(fill)) under red zones of each fill, then plain (padding
    0x00); no red zone written."""
    out = []
    for fill in (*FILLS, None):  # the red zones first: a kernel past its ends fails cleanly there
        # before a plain run could corrupt the heap
        torch.manual_seed(1234)
        args = inputs_for(0 if fill is None else fill)
        if fill is None:
            out.append(op(*args))
            continue
        with Redzones(fill) as rz:
            res = op(*args)
        assert rz.launches > 0, "no Triton launch ran under the red zones"
        assert rz.violations == [], rz.violations
        out.append(res)
    return out


def _check(op, inputs_for):
    a, b, plain = _three(op, inputs_for)
    same_bits(a, b, "fill 0x7F vs fill 0xFF")
    same_bits(plain, a, "plain vs red zones")


def _rand(shape, dtype, scale=1.5, seed=0):
    g = torch.Generator().manual_seed(seed + 7919 * shape[0] + shape[1])
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


def _loss_step(kind, reduction, p=0.1):
    def op(a, r, keys, noise):
        leaves = [t for t in (a, r, keys) if t is not None and t.requires_grad]
        if kind == "mq":
            loss = nac_fast.nac_mq_loss(a, r, keys, p, l2=0.1, noise=noise, reduction=reduction,
                                        backend="triton")
        else:
            loss = nac_fast.nac_loss(a, r, p, keys=keys, noise=noise, reduction=reduction,
                                     backend="triton")
        g = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device)
        grads = torch.autograd.grad((loss * g.view_as(loss)).sum(), leaves)
        return loss.detach(), grads
    return op


def _loss_inputs(n, N, D, dtype, kind, seeded):
    def inputs(fill):
        a = _padded(_rand((n, D), dtype), fill).requires_grad_()
        r = _padded(_rand((n, D), dtype, 2.0, 1), fill).requires_grad_(kind != "mq")
        keys = None
        if kind != "inbatch":
            keys = _padded(torch.tanh(_rand((N, D), torch.float64, 1.5, 2)).to(dtype), fill)
            keys.requires_grad_(kind == "keys")
        noise = None
        if not seeded:
            noise = _padded(nac_fast.draw_noise((n, D), 0.1, dtype=dtype,
                                                generator=torch.Generator().manual_seed(5)), fill)
        return a, r, keys, noise
    return inputs


CASES = [  # kind, n, N, D, dtype, reduction, noise drawn inside (seeded)
    ("inbatch", 1, 1, 1, torch.float32, "mean", False),
    ("inbatch", 3, 3, 7, torch.bfloat16, "none", True),
    ("inbatch", 97, 97, 128, torch.bfloat16, "mean", True),
    ("inbatch", 130, 130, 33, torch.float16, "sum", False),
    ("inbatch", 97, 97, 128, torch.float32, "none", True),
    ("inbatch", 40, 40, 200, torch.float64, "mean", False),
    ("keys", 3, 131, 16, torch.bfloat16, "none", False),
    ("keys", 33, 97, 128, torch.float32, "mean", True),
    ("mq", 1, 1031, 7, torch.bfloat16, "mean", True),
    ("mq", 97, 130, 128, torch.bfloat16, "none", False),
    ("mq", 33, 131, 64, torch.float32, "sum", True),
]


@pytest.mark.parametrize("fold", ["1", "0"])
@pytest.mark.parametrize("kind,n,N,D,dtype,reduction,seeded", CASES)
def test_loss_kernels_stay_in_bounds(monkeypatch, fold, kind, n, N, D, dtype, reduction, seeded):
    monkeypatch.setenv("NAC_FAST_FOLD", fold)
    _check(_loss_step("mq" if kind == "mq" else "inbatch", reduction),
           _loss_inputs(n, N, D, dtype, kind, seeded))


@pytest.mark.parametrize("mode", ["tf32x3", "bf16x6", "fp16x3"])
@pytest.mark.parametrize("kind,n,N,D", [("inbatch", 97, 97, 128), ("inbatch", 3, 3, 33),
                                        ("keys", 5, 131, 64), ("mq", 33, 130, 128)])
def test_fp32_modes_stay_in_bounds(monkeypatch, mode, kind, n, N, D):
    monkeypatch.setenv("NAC_FAST_FP32_DOT", mode)
    _check(_loss_step("mq" if kind == "mq" else "inbatch", "mean"),
           _loss_inputs(n, N, D, torch.float32, kind, True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,size,D", [(3, 16, 7), (65, 256, 128)])
def test_criterion_with_queue_stays_in_bounds(dtype, n, size, D):
    """NACMQLoss a step: the fused enqueue of both views' keys (wrapping the queue's end on the
    second call) and the loss with its inference term, then the gradients."""
    crit = nac_fast.NACMQLoss(0.1, l2=0.1, backend="triton")

    def op(a0, r0, a1, r1, am0, rm0, am1, rm1):
        queue = nac_fast.CodeQueue(size, D, dtype=dtype, device=DEVICE)
        queue.ptr.fill_(size - n)  # the first enqueue wraps around the end
        losses, grads = [], []
        for _ in range(2):
            loss = crit((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), queue)
            losses.append(loss.detach())
            grads.append(torch.autograd.grad(loss, (a0, r0, a1, r1)))
        return losses, grads, queue.codes.clone(), queue.ptr.clone()

    def inputs(fill):
        online = [_padded(_rand((n, D), dtype, 1.5, i), fill).requires_grad_() for i in range(4)]
        momentum = [_padded(_rand((n, D), dtype, 1.5, 10 + i), fill) for i in range(4)]
        return (*online, *momentum)

    _check(op, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (97, 130)])
def test_noise_kernel_stays_in_bounds(dtype, shape):
    def op(like, seed):
        return noise_from_seed(like, seed, 0.1, backend="triton")

    def inputs(fill):
        like = torch.empty(shape, dtype=dtype, device=DEVICE)
        return like, torch.tensor([123456789], dtype=torch.int64, device=DEVICE)

    _check(op, inputs)


def _codes(rows, bits, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2, (rows, bits), generator=g, dtype=torch.int8) * 2 - 1
    if ties:  # few distinct codes: many equal distances
        x = x[torch.randint(0, min(4, rows), (rows,), generator=g)]
    return nac_fast.pack_codes(x.to(DEVICE))


@pytest.mark.parametrize("Q,G,bits", [(1, 1, 1), (3, 70, 64), (33, 130, 129), (5, 300, 1023)])
def test_hamming_kernels_stay_in_bounds(Q, G, bits):
    labels_q = torch.arange(Q, device=DEVICE) % 3
    labels_g = torch.arange(G, device=DEVICE) % 3

    def op(q, g):
        d = nac_fast.hamming_distance(q, g, backend="triton")
        top = [nac_fast.topk(q, g, k, backend="triton") for k in sorted({1, min(5, G), G})]
        m = nac_fast.retrieval_metrics(q, labels_q, g, labels_g, topk=(1, min(10, G)),
                                       backend="triton")
        return d, top, [torch.as_tensor(m[k]) for k in sorted(m) if isinstance(
            m[k], (float, int, torch.Tensor))]

    def inputs(fill):
        return _codes(Q, bits, 1, ties=True), _codes(G, bits, 2, ties=True)

    _check(op, inputs)


def test_redzones_catch_a_write_past_the_end():
    """The checker itself: a kernel storing one element past its tensor is a violation, and one
    reading past it gives fill-dependent results."""
    import triton
    import triton.language as tl

    from nac_fast.kernels.launch import Launch

    @triton.jit
    def _past_end(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i + 1, mask=i < n, other=0.0)  # y[n - 1] = x[n]: one past the end
        tl.store(y_ptr + i, v, mask=i <= n)  # and y[n] written: one past the end

    from nac_fast.kernels import nac_noise_triton

    def op(x):
        y = torch.zeros(5, dtype=torch.float32, device=DEVICE)
        nac_noise_triton.run([Launch(_past_end, (1,), (x, y, 5), dict(BLOCK=8), 1, 1, "past")])
        return y

    results = []
    for fill in FILLS:
        with Redzones(fill) as rz:
            results.append(op(torch.ones(5, dtype=torch.float32, device=DEVICE)))
        assert len(rz.violations) == 1 and "after" in rz.violations[0], rz.violations
    with pytest.raises(AssertionError, match="differ"):
        same_bits(results[0], results[1])
