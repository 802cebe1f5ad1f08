"""Audit: the Triton loss, noise and queue kernels' integer widths at the largest inputs their
launchers accept (kernels/nac_triton.py, nac_noise_triton.py, queue_triton.py).

Offsets in memory are int64 throughout (rows64 * stride, rows64 * D, sp64 * n, the noise's
element index).  What stays int32 is the row and key indices (program ids, tl.arange, the tile
loops) and two per-tile offsets; nothing bounded them.  Found:

- rows / keys near 2^31: a forward split's end ``min(sp T B + T B, N)`` (and the keys' backward's
  over n), the tile loop's j0 + B and the folded finish's ``min(row0 + BLOCK_M, n)`` run up to
  (64 + 1) blocks past the last row, and wrapped in int32 for N within that of 2^31 - 1 (the last
  split's keys skipped, or read at negative rows): keys of 16 bf16 codes at N = 2^31 - 1 are
  64 GiB, within a 141 GB GPU.  The plans now refuse n, N > MAX_ROWS = 2^31 - 2^16 (ValueError
  naming a or keys), the enqueue likewise for its keys (the queue's "auto" falls back to the
  reference there).
- row strides: the 16-bit forward's key tile (_fwd_tile) steps with 32-bit ``arange(B) * stride``
  offsets and ``B * stride`` pointer steps, the keys' backward its g the same way (_bwd_tile):
  given keys (a column slice of a wide tensor) or a g whose rows are 2^24 or more elements apart
  wrapped (at 128-row tiles; 2^25 at 64).  The ops copy such operands (rows more than
  MAX_ROW_STRIDE = 2^20 elements apart) and the plans refuse them.

Nothing here allocates more than a few KB: plans on meta tensors, the kernels' own statements in
probes under the interpreter."""
from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from nac_fast.ops import dispatch
from _probes import bounds_probe

pytestmark = pytest.mark.skipif(dispatch.triton_import_error() is not None,
                                reason="the Triton kernels do not import")

META = dict(device="meta")
INT32_MAX = (1 << 31) - 1


def _nt():
    from nac_fast.kernels import nac_triton
    return nac_triton


def _args(L):
    """A launch's runtime arguments by parameter name."""
    names = [n for n in L.kernel.arg_names if n not in L.constexprs]
    return dict(zip(names, L.args))


def _fwd_launch(n, N, D=16, dtype=torch.bfloat16):
    from nac_fast.kernels.launch import SM90
    nt = _nt()
    a = torch.empty((n, D), dtype=dtype, **META)
    keys = None if N is None else torch.empty((N, D), dtype=dtype, **META)
    launches, _ = nt.fwd_plan(a, a, a, keys, 1.1, 0.1, True, SM90)
    return next(L for L in launches if L.tag == "fwd")


def _bwd_keys_launch(n, N, D=16, dtype=torch.bfloat16):
    from nac_fast.kernels.launch import SM90
    nt = _nt()
    a = torch.empty((n, D), dtype=dtype, **META)
    keys = torch.empty((N, D), dtype=dtype, **META)
    lse, g = torch.empty(n, **META), torch.empty(n, **META)
    ga = torch.empty((n, D), **META)
    launches, _ = nt.bwd_plan(a, a, a, keys, lse, ga, g, a, keys[:0], 1.1, False, False, True,
                              SM90)
    return next(L for L in launches if L.tag.startswith("bwd_keys"))


# ------------------------------------------------------------------------------------------
# Rows and keys near 2^31
# ------------------------------------------------------------------------------------------

def _bounds_probe(kernel, tmp_path, rows_name, per_split, block):
    """A Triton function running `kernel`'s own ``start = ...`` / ``end = ...`` statements for
    split sp = program_id(0), with the rows (N or n) and the tiles per split as the kernel types
    them (int32 below 2^31, do_not_specialize), and the value its tile loop reaches past its last
    tile, start + ceil((end - start) / B) B, in the same int32 arithmetic."""
    after = f"start + (tl.maximum(end - start, 0) + {block} - 1) // {block} * {block}"
    return bounds_probe(kernel, tmp_path, pid="sp", ints=(rows_name, per_split),
                        constexprs=(block,), stores=("start", "end", after))


def _run_bounds(probe, split, rows, per_split, block):
    out = torch.zeros(3 * split, dtype=torch.int64)
    probe[(split,)](out, rows, per_split, block)
    return out.view(split, 3).tolist()


def _assert_covers(bounds, rows):
    """The splits' [start, end) tile [0, rows) in order, and no int32 value wrapped."""
    pos = 0
    for start, end, after in bounds:
        assert start >= 0 and after >= 0 and after >= end, (start, end, after)
        if start < rows:
            assert start == pos and end > start, (start, end, pos)
            pos = end
    assert pos == rows, (pos, rows)


needs_interpreter = pytest.mark.skipif(
    not dispatch.triton_runs_on("cpu"), reason="the probes run under TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("which", ["fwd", "bwd_keys"])
def test_split_bounds_hold_at_max_rows(tmp_path, which):
    """The plans' largest accepted size: N (forward) or n (keys' backward) = MAX_ROWS against one
    block of the other, so 64 splits (SM90's 132 programs over one block): each split's bounds as
    the kernel computes them stay in int32 and the splits cover every row.  At 2^31 - 1 (accepted
    before) the last split's end wrapped negative: its rows were skipped."""
    nt = _nt()
    if which == "fwd":
        L, rows_name, per_split, block_name = _fwd_launch(64, nt.MAX_ROWS), "N", \
            "tiles_per_split", "BLOCK_N"
    else:
        L, rows_name, per_split, block_name = _bwd_keys_launch(nt.MAX_ROWS, 64), "n", \
            "blocks_per_split", "BLOCK_M"
    args, block, split = _args(L), L.constexprs[block_name], L.grid[1]
    assert split == 64 and args[rows_name] == nt.MAX_ROWS
    probe = _bounds_probe(L.kernel, tmp_path, rows_name, per_split, block_name)
    _assert_covers(_run_bounds(probe, split, nt.MAX_ROWS, args[per_split], block), nt.MAX_ROWS)
    # the plan's largest block: the margin 2^16 = MAX_ROWS' room covers 64 splits + 1 blocks of
    # every configuration a plan may pick (CONFIGS, CANDIDATES, FUSED_CONFIGS, the interpreter's)
    cfgs = [c for v in nt.CONFIGS.values() for c in v]
    cfgs += [c for v in nt.CANDIDATES.values() for c in v]
    cfgs += [c for c in nt.FUSED_CONFIGS.values() if c is not None] + list(nt._INTERP.values())
    widest = max(max(c.BLOCK_M, c.BLOCK_N) for c in cfgs)
    assert 65 * widest <= INT32_MAX - nt.MAX_ROWS
    assert widest * nt.MAX_ROW_STRIDE + nt.MAX_D <= INT32_MAX
    # why the limit: at the old 2^31 - 1 the same statements wrap
    old = INT32_MAX
    per = -(-(-(-old // block)) // split)
    bounds = _run_bounds(probe, split, old, per, block)
    assert bounds[-1][1] < 0 or bounds[-1][2] < 0, bounds[-1]


def test_loss_plans_refuse_rows_past_max_rows():
    """n (a's rows) or N (the keys') past MAX_ROWS: a ValueError naming the operand (the plans
    were built before, their kernels' int32 bounds wrapping)."""
    nt = _nt()
    _fwd_launch(64, nt.MAX_ROWS)  # the limit itself is taken
    with pytest.raises(ValueError, match="keys has 2,147,418,113 rows"):
        _fwd_launch(64, nt.MAX_ROWS + 1)
    with pytest.raises(ValueError, match="keys has 2,147,483,648 rows"):
        _fwd_launch(64, 1 << 31)
    with pytest.raises(ValueError, match="a has 2,147,418,113 rows"):
        _fwd_launch(nt.MAX_ROWS + 1, 64, D=1)
    with pytest.raises(ValueError, match="a has 2,147,418,113 rows"):
        _fwd_launch(nt.MAX_ROWS + 1, None, D=1)  # in-batch
    with pytest.raises(ValueError, match="a has 2,147,418,113 rows"):
        _bwd_keys_launch(nt.MAX_ROWS + 1, 64, D=1)


def test_enqueue_refuses_keys_past_max_rows(monkeypatch):
    """The enqueue's rows (and n0 + n1) are int32: more keys a call than MAX_ROWS is a ValueError
    in the plan, and the queue's backend refuses the Triton kernel there ("auto" then runs the
    reference; the queue itself may be larger: its slots are int64)."""
    from nac_fast.kernels import queue_triton
    from nac_fast.ops import queue as Q
    nt = _nt()
    ptr = torch.empty((), dtype=torch.int64, **META)
    count = torch.empty(1, dtype=torch.int32, **META)
    codes = torch.empty((1 << 32, 2), dtype=torch.bfloat16, **META)
    x = torch.empty((nt.MAX_ROWS, 2), **META)
    queue_triton.enqueue_plan(codes, ptr, count, x, x[:0])  # the limit itself is taken
    with pytest.raises(ValueError, match="at most 2,147,418,112 keys a call, got 2,147,418,113"):
        queue_triton.enqueue_plan(codes, ptr, count, x, x[:1])
    monkeypatch.setattr(Q, "triton_runs_on", lambda device_type: True)
    q = Q.CodeQueue(1 << 32, 2, device="meta")
    assert q._triton_refusal((x,)) == ""
    assert "more than 2,147,418,112 keys" in q._triton_refusal((x, x[:1]))


# ------------------------------------------------------------------------------------------
# Row strides of the operands stepped with 32-bit offsets
# ------------------------------------------------------------------------------------------

FAR = 1 << 26  # elements between rows: 64 of them pass 2^31


@needs_interpreter
def test_the_tile_offsets_are_int32():
    """Why far rows matter: the forward's 16-bit key tile offsets ``arange(B) * stride_k`` (and
    the keys' backward's ``r * stride_g``) are int32 products for a stride below 2^31, and wrap
    at a 64-row tile of rows 2^26 apart (the kernel's own statement, run in a probe)."""
    import triton
    import triton.language as tl
    src = inspect.getsource(_nt()._fwd_kernel.fn)
    line = next(ln.strip() for ln in src.splitlines()
                if ln.strip().startswith("offs = tl.arange(0, BLOCK_N)[:, None] * stride_k"))
    ns = {}
    exec(textwrap.dedent(f"""
        def probe(out_ptr, stride_k, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
            cols = tl.arange(0, BLOCK_D)
            {line}
            tl.store(out_ptr + tl.arange(0, BLOCK_N), tl.min(offs, 1).to(tl.int64))
        """), {"tl": tl}, ns)
    probe = triton.jit(ns["probe"])
    out = torch.zeros(64, dtype=torch.int64)
    probe[(1,)](out, FAR, 64, 16)
    assert out[31] == 31 * FAR and out[32] < 0  # 32 x 2^26 = 2^31 wrapped
    out.zero_()
    probe[(1,)](out, _nt().MAX_ROW_STRIDE, 64, 16)
    assert out.tolist() == [i * _nt().MAX_ROW_STRIDE for i in range(64)]


def test_loss_plans_refuse_far_rows():
    """Given keys or g with rows more than MAX_ROW_STRIDE elements apart: the plans refuse them
    (they were planned with that stride, the tiles' offsets wrapping past 2^31)."""
    from nac_fast.kernels.launch import SM90
    nt = _nt()
    a = torch.empty((128, 128), dtype=torch.bfloat16, **META)
    far = torch.empty_strided((256, 128), (FAR, 1), dtype=torch.bfloat16, **META)
    with pytest.raises(ValueError, match="keys has rows 67,108,864 elements apart"):
        nt.fwd_plan(a, a, a, far, 1.1, 0.1, True, SM90)
    one = torch.empty_strided((1, 128), (FAR, 1), dtype=torch.bfloat16, **META)
    nt.fwd_plan(a, a, a, one, 1.1, 0.1, True, SM90)  # one row: no offset past row 0
    keys = torch.empty((256, 128), dtype=torch.bfloat16, **META)
    g = torch.empty_strided((128,), (FAR,), **META)
    lse, ga = torch.empty(128, **META), torch.empty((128, 128), **META)
    with pytest.raises(ValueError, match="g has rows 67,108,864 elements apart"):
        nt.bwd_plan(a, a, a, keys, lse, ga, g, a, keys[:0], 1.1, False, False, True, SM90)
    g0 = torch.empty(1, **META).expand(128)  # an expanded scalar (stride 0): taken
    nt.bwd_plan(a, a, a, keys, lse, ga, g0, a, keys[:0], 1.1, False, False, True, SM90)


def test_loss_ops_copy_far_rows(monkeypatch):
    """The ops (fwd / bwd) hand the plans such operands as contiguous copies: the launches get a
    small stride (before: the far stride, wrapping in the kernels)."""
    nt = _nt()
    seen = []
    monkeypatch.setattr(nt, "run", lambda launches: seen.extend(launches))
    a = torch.empty((128, 128), dtype=torch.bfloat16, **META)
    far = torch.empty_strided((256, 128), (FAR, 1), dtype=torch.bfloat16, **META)
    nt.fwd(a, a, a, far, 1.1, 0.1, True)
    fwd = next(L for L in seen if L.tag == "fwd")
    assert _args(fwd)["stride_k"] == 128
    seen.clear()
    g = torch.empty_strided((128,), (FAR,), **META)
    lse, ga = torch.empty(128, **META), torch.empty((128, 128), **META)
    nt.bwd(a, a, a, far, lse, ga, g, a, far[:0], 1.1, False, False, True)
    bk = next(L for L in seen if L.tag.startswith("bwd_keys"))
    assert _args(bk)["stride_g"] == 1
