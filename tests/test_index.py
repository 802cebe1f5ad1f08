"""nac_fast.HashIndex: FAISS IndexBinaryFlat conventions (checked against FAISS itself and a numpy
oracle), ids / paths / labels, k > ntotal, the versioned on-disk format and its errors.

Also, as a user of a FAISS-like binary index uses it: searches against a second, brute-force
oracle (XOR / popcount of np.packbits words, and +-1 dot products) at awkward sizes, and one
regression test per bug an audit fixed (ids out of the int64 range, many small adds with ids /
paths / labels, saving under a file, a header that only looks like version 1)."""
from __future__ import annotations

import json
import os
import time
import zipfile

import numpy as np
import pytest
import torch

import nac_fast
from nac_fast import HashIndex
from nac_fast.index import hash_index as HI
from nac_fast.ops import dispatch
from test_hamming_gpu import TRITON_DEVICE, triton_runs


def rand_codes(seed, n, bits):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n, bits), generator=g).bool()


def np_topk(q, g, k):
    """Nearest first, ties by insertion order, from the definition."""
    d = (q[:, None, :] != g[None, :, :]).sum(-1)
    idx = np.stack([np.lexsort((np.arange(g.shape[0]), row))[:k] for row in d])
    return np.take_along_axis(d, idx, 1), idx


BACKENDS = [b for b in ("cpu", "reference")
            if dispatch.available_backends("cpu", op="hamming", reasons=True)[b] is None]
BACKENDS += ["triton"] if triton_runs() else []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,n,k", [(1, 3, 2), (7, 97, 10), (128, 1031, 10), (65, 4099, 128),
                                      (200, 300, 129), (3, 1031, 5), (128, 5000, 10)])
def test_search_matches_oracle_in_several_adds(backend, bits, n, k):
    """Awkward sizes, few bits (heavy ties), k on both sides of the C++ small-k path (128) and
    of the GPU engine's outright path (4096 codes); backend "triton" on its device: a GPU index
    (device="cuda") on a GPU machine, CPU codes under the interpreter."""
    g, q = rand_codes(bits + n, n, bits), rand_codes(7, 17, bits)
    index = HashIndex(bits, backend=backend, device=TRITON_DEVICE if backend == "triton" else "cpu")
    for s in range(0, n, max(1, n // 3)):  # appends in order
        index.add(g[s:s + max(1, n // 3)])
    assert index.ntotal == n and len(index) == n
    D, I = index.search(q, k)  # CPU queries: results on the CPU, whatever the index's device
    wd, wi = np_topk(q.numpy(), g.numpy(), min(k, n))
    assert D.dtype == torch.int32 and I.dtype == torch.int64 and D.shape == (17, min(k, n))
    np.testing.assert_array_equal(D.numpy(), wd)
    np.testing.assert_array_equal(I.numpy(), wi)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ engine is not built")
@pytest.mark.parametrize("bits,n,k", [(64, 1031, 10), (128, 4099, 129), (193, 97, 97)])
def test_search_same_at_every_forced_isa_level(monkeypatch, bits, n, k):
    """HashIndex's CPU search gives the oracle's answer at every instruction-set level this CPU
    runs, forced with NAC_FAST_HAMMING_ISA (the AVX2 and AVX-512BW nibble paths on an AVX-512
    machine): the auto choice of level changes the speed, never the result."""
    from nac_fast.ops.search import HAMMING_ISA_ENV, cpu_isa_levels
    g, q = rand_codes(bits, n, bits), rand_codes(3, 9, bits)
    g[n // 2:n // 2 + 5] = g[0]  # ties at scattered indices
    index = HashIndex(bits)
    index.add(g)
    wd, wi = np_topk(q.numpy(), g.numpy(), k)
    for level in cpu_isa_levels():
        monkeypatch.setenv(HAMMING_ISA_ENV, level)
        D, I = index.search(q, k)
        np.testing.assert_array_equal(D.numpy(), wd, err_msg=level)
        np.testing.assert_array_equal(I.numpy(), wi, err_msg=level)


def test_same_distances_as_faiss_index_binary_flat():
    faiss = pytest.importorskip("faiss")
    g, q = rand_codes(1, 5000, 128), rand_codes(2, 50, 128)
    index = HashIndex(128)
    index.add(g)
    D, I = index.search(q, 20)
    fx = faiss.IndexBinaryFlat(128)
    fx.add(nac_fast.pack_codes(g).words.numpy().view(np.uint8))
    fD, fI = fx.search(nac_fast.pack_codes(q).words.numpy().view(np.uint8), 20)
    np.testing.assert_array_equal(D.numpy(), fD)  # same distances, nearest first
    # same neighbours up to the order of equal distances (FAISS's heap leaves it open)
    for i in range(50):
        for d in np.unique(fD[i][fD[i] < fD[i].max()]):
            assert set(I[i][D[i] == d].tolist()) == set(fI[i][fD[i] == d].tolist())


def _popcount_topk(g: np.ndarray, q: np.ndarray, k: int):
    """Oracle 1: the packed words (independent packing: np.packbits), XOR, popcount; nearest
    first, equal distances in insertion order (a stable sort)."""
    gw, qw = np.packbits(g, axis=1), np.packbits(q, axis=1)
    d = np.unpackbits(qw[:, None, :] ^ gw[None, :, :], axis=-1).sum(-1).astype(np.int64)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, order, 1), order


def _dot_distances(g: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Oracle 2: d = (nbits - <q, g>) / 2 for +-1 codes."""
    gp, qp = np.where(g, 1, -1).astype(np.int64), np.where(q, 1, -1).astype(np.int64)
    return (g.shape[1] - qp @ gp.T) // 2


@pytest.mark.parametrize("nbits", [1, 7, 64, 65, 130])
@pytest.mark.parametrize("n", [1, 3, 97, 1031])
def test_search_matches_a_popcount_oracle_at_awkward_sizes(nbits, n):
    """Codes added in three batches as 0/1 numpy (zero_one), +-1 torch and bool numpy; queries
    as +-1 numpy: distances and positions equal the oracle's for k = 1, 7, n and n + 5 (all of
    the index), ties (plenty at 1 and 7 bits) in insertion order."""
    rng = np.random.default_rng(nbits * 10_000 + n)
    g = rng.random((n, nbits)) < 0.5
    q = rng.random((4, nbits)) < 0.5
    q[0] = g[n // 2]  # an exact match
    index = HashIndex(nbits)
    a, b = n // 3, 2 * n // 3
    index.add(g[:a].astype(np.uint8), zero_one=True)
    index.add(torch.from_numpy(np.where(g[a:b], 1, -1)).float())
    index.add(g[b:])
    assert len(index) == index.ntotal == n
    for k in (1, 7, n, n + 5):
        D, I = index.search(np.where(q, 1, -1).astype(np.int8), k)
        Do, Io = _popcount_topk(g, q, min(k, n))
        assert isinstance(D, np.ndarray) and D.dtype == np.int32 and I.dtype == np.int64
        np.testing.assert_array_equal(D, Do)
        np.testing.assert_array_equal(I, Io)
        np.testing.assert_array_equal(D, np.take_along_axis(_dot_distances(g, q), I, 1))
    Dt, It = index.search(torch.from_numpy(q.astype(np.uint8)), 3, zero_one=True)
    assert isinstance(Dt, torch.Tensor)
    np.testing.assert_array_equal(It.numpy(), _popcount_topk(g, q, min(3, n))[1])


def test_many_batches_and_a_saved_copy_search_alike(tmp_path):
    """50 adds of 1031 codes (so the storage grows many times) with ids: the same answers as
    the oracle, and as the index saved and loaded again."""
    rng = np.random.default_rng(5)
    g = rng.random((50 * 1031, 65)) < 0.5
    g[::7] = g[3]  # many exact duplicates: long runs of ties
    index = HashIndex(65)
    for s in range(0, len(g), 1031):
        index.add(g[s:s + 1031], ids=np.arange(s, s + 1031) * 10)
    q = np.concatenate([g[3:4], rng.random((3, 65)) < 0.5])
    D, I = index.search(q, 300)
    Do, Io = _popcount_topk(g, q, 300)
    np.testing.assert_array_equal(D, Do)
    np.testing.assert_array_equal(I, Io)
    assert index.ids[torch.from_numpy(I)].tolist() == (Io * 10).tolist()
    index.save(tmp_path / "x.nacidx")
    back = HashIndex.load(tmp_path / "x.nacidx")
    D2, I2 = back.search(q, 300)
    np.testing.assert_array_equal(D2, D)
    np.testing.assert_array_equal(I2, I)
    assert torch.equal(back.ids, index.ids)


def test_k_larger_than_ntotal_returns_ntotal_and_bad_k():
    index = HashIndex(16)
    index.add(rand_codes(0, 5, 16))
    D, I = index.search(rand_codes(1, 2, 16), 100)
    assert D.shape == I.shape == (2, 5) and sorted(I[0].tolist()) == [0, 1, 2, 3, 4]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="k must be >= 1"):
            index.search(rand_codes(1, 2, 16), bad)
    with pytest.raises(TypeError, match="k must be an int"):
        index.search(rand_codes(1, 2, 16), 2.0)
    with pytest.raises(ValueError, match="index is empty"):
        HashIndex(16).search(rand_codes(1, 2, 16), 1)


def test_code_length_and_input_forms():
    index = HashIndex(64)
    c = rand_codes(3, 10, 64)
    index.add(c)                                     # bool
    index.add(c.float() * 2 - 1)                     # +-1
    index.add(c.int(), zero_one=True)                # 0/1
    index.add(nac_fast.pack_codes(c))                # packed
    assert torch.equal(index.codes.words[:10], index.codes.words[30:])
    with pytest.raises(ValueError, match="codes have 32 bits but the index holds 64-bit codes"):
        index.add(rand_codes(0, 2, 32))
    with pytest.raises(ValueError, match="query codes have 32 bits"):
        index.search(rand_codes(0, 2, 32), 1)
    with pytest.raises(ValueError, match="only -1 and \\+1"):
        index.add(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="nbits must be in"):
        HashIndex(0)
    with pytest.raises(TypeError, match="nbits must be an int"):
        HashIndex(12.0)


def test_search_input_errors_name_their_argument():
    index = HashIndex(65)
    with pytest.raises(ValueError, match="empty"):
        index.search(np.ones((1, 65)), 1)
    index.add(np.ones((3, 65)))
    with pytest.raises(ValueError, match="64 bits but the index holds 65-bit"):
        index.search(np.ones((1, 64)), 1)
    with pytest.raises(ValueError, match="codes have 66 bits"):
        index.add(np.ones((1, 66)))
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.search(np.ones((1, 65)), 0)
    with pytest.raises(TypeError, match="k must be an int"):
        index.search(np.ones((1, 65)), 2.0)
    with pytest.raises(ValueError, match="zero_one=True"):
        index.search(np.ones((1, 65), np.int64) * 0, 1)
    with pytest.raises(TypeError, match="zero_one=True"):
        index.add(np.zeros((1, 65), np.uint8))
    D, I = index.search(np.ones((0, 65)), 10)
    assert D.shape == I.shape == (0, 3)


def test_numpy_codes_in_numpy_results_out():
    """FAISS's convention: numpy codes (int8 +-1, bool, 0/1) are added as the same values, and a
    numpy query gets numpy (distances int32, positions int64) equal to the tensor query's."""
    c = rand_codes(4, 37, 70)
    pm1 = (c.numpy().astype(np.int8) * 2 - 1)
    index = HashIndex(70)
    index.add(pm1)
    index.add(c.numpy())                             # bool
    index.add(c.numpy().astype(np.uint8), zero_one=True)
    index.add(np.asfortranarray(pm1))                # not C-contiguous: the same values
    assert all(torch.equal(index.codes.words[:37], index.codes.words[37 * i:37 * (i + 1)])
               for i in range(1, 4))
    D, I = index.search(pm1[:5], 6)
    assert isinstance(D, np.ndarray) and isinstance(I, np.ndarray)
    assert (D.dtype, I.dtype, D.shape) == (np.int32, np.int64, (5, 6))
    Dt, It = index.search(c[:5], 6)
    assert np.array_equal(D, Dt.numpy()) and np.array_equal(I, It.numpy())
    D, I = index.search(np.asfortranarray(pm1[:5]), 6)
    assert np.array_equal(D, Dt.numpy()) and np.array_equal(I, It.numpy())
    with pytest.raises(TypeError, match="dtype object"):
        index.add(np.array([["x"] * 70], dtype=object))
    with pytest.raises(ValueError, match="only -1 and \\+1"):
        index.add(np.zeros((2, 70)))


def test_ids_paths_labels_stay_aligned_and_are_all_or_nothing():
    index = HashIndex(8)
    index.add(rand_codes(0, 3, 8), ids=[10, 11, 12], paths=["a", "b", "c"], labels=["x", None, "y"])
    with pytest.raises(ValueError, match="paths: the index holds paths"):
        index.add(rand_codes(1, 2, 8), ids=[13, 14], labels=["x", "x"])
    with pytest.raises(ValueError, match="ids must have shape \\(2,\\)"):
        index.add(rand_codes(1, 2, 8), ids=[13], paths=["d", "e"], labels=["x", "x"])
    with pytest.raises(TypeError, match="paths entries must be str"):
        index.add(rand_codes(1, 2, 8), ids=[13, 14], paths=["d", 5], labels=["x", "x"])
    assert index.ntotal == 3  # nothing of the failed adds went in
    index.add(rand_codes(1, 2, 8), ids=[13, 14], paths=["d", "e"], labels=["x", "x"])
    assert index.ids.tolist() == [10, 11, 12, 13, 14] and index.paths == list("abcde")
    assert index.labels == ["x", None, "y", "x", "x"]
    plain = HashIndex(8)
    plain.add(rand_codes(0, 3, 8))
    with pytest.raises(ValueError, match="ids: the index has no ids"):
        plain.add(rand_codes(0, 1, 8), ids=[1])
    assert plain.ids.tolist() == [0, 1, 2] and plain.paths is None


def test_ids_at_maps_search_positions_on_their_device():
    """ids_at(I): the ids of search()'s positions, I's shape, dtype int64, on I's device (ids[I]
    is refused for CUDA indices: the ids live on the CPU); numpy in, numpy out; positions outside
    the index and non-integer positions named."""
    index = HashIndex(16)
    g = rand_codes(3, 40, 16)
    index.add(g[:25], ids=torch.arange(25) * 7 + 100)
    index.add(g[25:], ids=np.arange(25, 40) * 7 + 100)
    D, I = index.search(g[:5], 4)
    got = index.ids_at(I)
    assert got.dtype == torch.int64 and got.shape == I.shape
    assert torch.equal(got, I * 7 + 100)
    Dn, In = index.search(g[:5].numpy(), 4)
    gotn = index.ids_at(In)
    assert isinstance(gotn, np.ndarray) and gotn.dtype == np.int64
    np.testing.assert_array_equal(gotn, In * 7 + 100)
    assert torch.equal(index.ids_at(torch.tensor([39, 0], dtype=torch.int32)),
                       torch.tensor([373, 100]))
    assert index.ids_at(torch.zeros((3, 0), dtype=torch.int64)).shape == (3, 0)
    with pytest.raises(ValueError, match=r"positions holds 40, outside 0\.\.39"):
        index.ids_at(torch.tensor([1, 40]))
    with pytest.raises(ValueError, match=r"positions holds -1, outside"):
        index.ids_at(np.array([-1, 2]))
    with pytest.raises(TypeError, match="positions must hold integers"):
        index.ids_at(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="positions must hold integers"):
        index.ids_at(np.array([1.0]))
    with pytest.raises(TypeError, match="positions must be a torch.Tensor or numpy array"):
        index.ids_at([1, 2])
    plain = HashIndex(16)  # no ids given: an id is its position
    plain.add(g)
    pos = torch.tensor([[3, 1]])
    out = plain.ids_at(pos)
    assert torch.equal(out, pos) and out.data_ptr() != pos.data_ptr()


def test_uint64_ids_above_int64_are_refused_not_wrapped():
    """Bug: ids given as numpy uint64 >= 2**63 were cast to int64 and wrapped to negative ids
    (another item's id, silently); a Python int past int64 was a ValueError that did not name
    ids.  Now both are a ValueError naming ids, and nothing is added."""
    index = HashIndex(8)
    index.add(np.ones((2, 8)), ids=np.array([1, 2], np.uint64))      # in range: fine
    with pytest.raises(ValueError, match="ids must be in the int64 range"):
        index.add(np.ones((1, 8)), ids=np.array([2 ** 63 + 5], np.uint64))
    with pytest.raises(ValueError, match="ids must be in the int64 range"):
        index.add(np.ones((1, 8)), ids=[2 ** 64])
    assert index.ntotal == 2 and index.ids.tolist() == [1, 2]
    index.add(np.ones((1, 8)), ids=np.array([2 ** 63 - 1], np.uint64))
    assert index.ids.tolist() == [1, 2, 2 ** 63 - 1]


@pytest.mark.parametrize("bad", [["a"], [None], [object()]])
def test_ids_that_are_not_integers_are_a_type_error_naming_ids(bad):
    """Bug: ["a"] was a ValueError ("too many dimensions 'str'"), [None] a RuntimeError (no
    ValueError / TypeError at all), neither naming ids."""
    index = HashIndex(8)
    with pytest.raises(TypeError, match="ids must be"):
        index.add(np.ones((1, 8)), ids=bad)
    assert index.ntotal == 0


def test_many_small_adds_with_ids_paths_labels_do_not_copy_the_index():
    """Bug: every add copied all the ids, paths and labels held (torch.cat, list + list), so an
    add of one code to an index of 500,000 took ~12 ms against ~0.08 ms to an empty one (adding
    codes one by one was quadratic).  Now an add costs the same at any size (measured: ~1.2x;
    the bound below leaves room for a loaded machine)."""
    def per_add(n0, reps=200):
        index = HashIndex(16)
        n0 = max(n0, 1)
        index.add(torch.ones((n0, 16)), ids=np.arange(n0), paths=["p"] * n0, labels=["l"] * n0)
        c = torch.ones((1, 16))
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for i in range(reps):
                index.add(c, ids=[i], paths=["p"], labels=[None])
            best = min(best, (time.perf_counter() - t) / reps)
        assert index.ntotal == n0 + 3 * reps and len(index.paths) == len(index.labels) == index.ntotal
        assert index.ids[-1].item() == reps - 1 and index.labels[-1] is None
        return best
    small, large = per_add(0), per_add(500_000)
    assert large < 10 * small, f"{large * 1e6:.0f} us an add at 500k codes vs {small * 1e6:.0f} us"


def test_ids_paths_labels_stay_right_across_growth_and_reset(tmp_path):
    """The in-place growth of ids / paths / labels (the fix above) keeps every code's own, over
    several capacity doublings, after reset, and through save / load."""
    index = HashIndex(9)
    rng = np.random.default_rng(0)
    total = 0
    for n in (1, 0, 1023, 1, 2500, 7):
        index.add(rng.random((n, 9)) < .5, ids=np.arange(total, total + n) * 3,
                  paths=[f"p{i}" for i in range(total, total + n)],
                  labels=[str(i % 5) for i in range(total, total + n)])
        total += n
    assert index.ids.tolist() == [3 * i for i in range(total)]
    assert index.paths == [f"p{i}" for i in range(total)]
    before = index.ids
    index.add(rng.random((1, 9)) < .5, ids=[-1], paths=["z"], labels=[None])
    assert before.shape == (total,)  # a view taken before is not changed by a later add
    index.save(tmp_path / "a.nacidx")
    back = HashIndex.load(tmp_path / "a.nacidx")
    assert back.ids.tolist() == index.ids.tolist() and back.labels == index.labels
    index.reset()
    assert index.ntotal == 0 and index.paths is None and index.ids.tolist() == []
    index.add(np.ones((2, 9)))
    assert index.ids.tolist() == [0, 1] and index.paths is None


def test_save_load_round_trip_and_format(tmp_path):
    index = HashIndex(65, meta={"checkpoint": "x.pt", "checkpoint_sha256": "ab" * 32})
    index.add(rand_codes(0, 50, 65), paths=[f"p{i}" for i in range(50)],
              labels=[str(i % 3) for i in range(50)])
    path = tmp_path / "a.nacidx"
    index.save(path)
    back = HashIndex.load(path)
    assert (back.nbits, back.ntotal, back.paths, back.labels, back.meta) == \
        (65, 50, index.paths, index.labels, index.meta)
    assert torch.equal(back.codes.words, index.codes.words)
    q = rand_codes(9, 4, 65)
    assert all(torch.equal(a, b) for a, b in zip(back.search(q, 7), index.search(q, 7)))
    # the format as documented: a zip numpy and json read without nac_fast
    with zipfile.ZipFile(path) as z:
        head = json.loads(z.read("meta.json"))
        assert head["format"] == "nac_fast.HashIndex" and head["version"] == 1
        import io
        words = np.load(io.BytesIO(z.read("codes.npy")))
    assert words.dtype == np.dtype("<u8") and words.shape == (50, 2)
    assert np.array_equal(words.view(np.int64), index.codes.words.numpy())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        index.save(path)
    index.save(path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["a.nacidx"]  # no temporary file left


def _rewrite(src, dst, edit):
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for name in z.namelist():
            data = z.read(name)
            if name == "meta.json":
                head = json.loads(data)
                edit(head)
                data = json.dumps(head).encode()
            out.writestr(name, data)


def test_load_errors(tmp_path):
    index = HashIndex(16)
    index.add(rand_codes(0, 300, 16), ids=list(range(300)))
    good = tmp_path / "good.nacidx"
    index.save(good)
    blob = good.read_bytes()
    cases = {
        "truncated.nacidx": blob[:len(blob) // 2],
        "empty.nacidx": b"",
        "text.nacidx": b"hello",
        "flipped.nacidx": blob[:200] + bytes([blob[200] ^ 0xFF]) + blob[201:],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match="not a complete nac_fast HashIndex file"):
            HashIndex.load(tmp_path / name)
    _rewrite(good, tmp_path / "v2.nacidx", lambda h: h.update(version=2))
    with pytest.raises(ValueError, match="format version 2; this nac_fast reads version 1"):
        HashIndex.load(tmp_path / "v2.nacidx")
    _rewrite(good, tmp_path / "n.nacidx", lambda h: h.update(ntotal=299))
    with pytest.raises(ValueError, match="inconsistent"):
        HashIndex.load(tmp_path / "n.nacidx")
    _rewrite(good, tmp_path / "f.nacidx", lambda h: h.update(format="something"))
    with pytest.raises(ValueError, match="not a complete nac_fast HashIndex"):
        HashIndex.load(tmp_path / "f.nacidx")
    with pytest.raises(FileNotFoundError):
        HashIndex.load(tmp_path / "missing.nacidx")


def test_failed_save_leaves_the_old_file(tmp_path, monkeypatch):
    index = HashIndex(8)
    index.add(rand_codes(0, 4, 8))
    path = tmp_path / "x.nacidx"
    index.save(path)
    before = path.read_bytes()
    index.add(rand_codes(1, 4, 8))
    import nac_fast.index.hash_index as hi
    monkeypatch.setattr(hi, "_npy_bytes", lambda a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        index.save(path, overwrite=True)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["x.nacidx"]
    with pytest.raises(TypeError, match="JSON"):
        HashIndex(8, meta={"x": object()}).save(tmp_path / "y.nacidx")
    assert not (tmp_path / "y.nacidx").exists()


def test_save_under_a_file_names_the_file_not_overwrite(tmp_path):
    """Bug: saving to f/x.nacidx where f is a file raised os.makedirs' FileExistsError ("File
    exists: f"), which reads as "pass overwrite=True" (which cannot help).  Now a
    NotADirectoryError naming the file in the way, and f untouched."""
    (tmp_path / "f").write_text("mine")
    index = HashIndex(8)
    index.add(np.ones((1, 8)))
    for overwrite in (False, True):
        with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
            index.save(tmp_path / "f" / "deeper" / "x.nacidx", overwrite=overwrite)
    assert (tmp_path / "f").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["f"]
    index.save(tmp_path / "new" / "deeper" / "x.nacidx")  # missing folders are still created
    assert HashIndex.load(tmp_path / "new" / "deeper" / "x.nacidx").ntotal == 1


def test_save_never_replaces_a_file_unasked_and_a_failed_save_leaves_nothing(tmp_path,
                                                                            monkeypatch):
    """An existing file (or a link) is a FileExistsError; an interrupt midway through the zip
    leaves the old file byte for byte and no temporary file."""
    index = HashIndex(8)
    index.add(np.ones((3, 8)))
    path = tmp_path / "mine.nacidx"
    path.write_bytes(b"the user's file")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        index.save(path)
    os.symlink(tmp_path / "nowhere", tmp_path / "link.nacidx")
    with pytest.raises(FileExistsError):
        index.save(tmp_path / "link.nacidx")
    import nac_fast.index.hash_index as hi
    real = hi._npy_bytes
    monkeypatch.setattr(hi, "_npy_bytes", lambda a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        index.save(path, overwrite=True)
    assert path.read_bytes() == b"the user's file"
    assert sorted(os.listdir(tmp_path)) == ["link.nacidx", "mine.nacidx"]
    monkeypatch.setattr(hi, "_npy_bytes", real)
    index.save(path, overwrite=True)
    assert HashIndex.load(path).ntotal == 3


@pytest.mark.parametrize("field,value,match", [
    ("version", True, "format version True"),
    ("version", 1.0, "format version 1.0"),
    ("has_ids", "no", "has_ids must be true or false"),
    ("has_paths", 1, "has_paths must be true or false"),
    ("ntotal", "97", "ntotal must be an int"),
    ("ntotal", 97.9, "ntotal must be an int"),
    ("words_per_code", 5, "words_per_code is 5"),
    ("byte_order", "big", "byte_order is 'big'"),
])
def test_a_header_that_only_looks_like_version_1_is_refused(tmp_path, field, value, match):
    """Bug: the header was read loosely: version true or 1.0 passed as 1, has_ids "no" read as
    true, ntotal "97" or 97.9 as 97, words_per_code and byte_order were not looked at.  A file
    from another writer or version that says so is now a ValueError naming the file."""
    index = HashIndex(130)
    index.add(np.random.default_rng(0).random((97, 130)) < .5, ids=np.arange(97),
              paths=[str(i) for i in range(97)])
    index.save(tmp_path / "good.nacidx")
    _rewrite(tmp_path / "good.nacidx", tmp_path / "bad.nacidx", lambda h: h.update({field: value}))
    with pytest.raises(ValueError, match=match) as e:
        HashIndex.load(tmp_path / "bad.nacidx")
    assert "bad.nacidx" in str(e.value)
    assert HashIndex.load(tmp_path / "good.nacidx").ntotal == 97


def test_load_refuses_truncated_damaged_and_foreign_files(tmp_path):
    """Every truncation point of a small index, a flipped byte in codes.npy, a zip of other
    things, an .npz and a torch file: a ValueError naming the file, never a shorter index."""
    index = HashIndex(65)
    index.add(np.random.default_rng(1).random((31, 65)) < .5, labels=["a"] * 31)
    good = tmp_path / "good.nacidx"
    index.save(good)
    blob = good.read_bytes()
    bad = tmp_path / "bad.nacidx"
    for cut in range(0, len(blob), 37):
        bad.write_bytes(blob[:cut])
        with pytest.raises(ValueError, match="bad.nacidx"):
            HashIndex.load(bad)
    pos = blob.find(b"\x93NUMPY") + 200
    bad.write_bytes(blob[:pos] + bytes([blob[pos] ^ 1]) + blob[pos + 1:])
    with pytest.raises(ValueError, match="CRC"):
        HashIndex.load(bad)
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("hello.txt", "hi")
    np.savez(tmp_path / "codes.npz", codes=np.zeros((2, 2), np.uint64))
    torch.save({"model": {}}, tmp_path / "last.pt")
    for name in ("other.zip", "codes.npz", "last.pt"):
        with pytest.raises(ValueError, match="not a complete nac_fast HashIndex file"):
            HashIndex.load(tmp_path / name)


def test_an_empty_add_with_paths_or_ids_does_not_commit_the_index(tmp_path):
    """An add of 0 codes to an empty index records no ids / paths / labels (its first codes
    decide), so the index stays consistent and what it saves loads back; once it holds codes, an
    empty add follows the all-or-nothing rule of every add."""
    c = rand_codes(0, 5, 9)
    i = HashIndex(9)
    i.add(c[:0], paths=[])
    i.add(c)                                          # no paths: the index has none
    assert i.ntotal == 5 and i.paths is None
    i.save(tmp_path / "a.nacidx")
    assert HashIndex.load(tmp_path / "a.nacidx").ntotal == 5
    j = HashIndex(9)
    j.add(c[:0], ids=torch.zeros(0, dtype=torch.int64), labels=[])
    j.add(c)
    assert j.ids.tolist() == [0, 1, 2, 3, 4] and j.labels is None
    assert j.ids[j.search(c, 2)[1]].shape == (5, 2)
    k = HashIndex(9)
    k.add(c[:0])
    k.add(c[:2], ids=[7, 8], paths=["a", "b"])       # the first codes bring ids and paths
    k.add(c[:0], ids=[], paths=[])                     # (an empty list of ids is int64 here)
    assert k.ids.tolist() == [7, 8] and k.paths == ["a", "b"]
    with pytest.raises(ValueError, match="ids: the index holds ids for its 2 codes"):
        k.add(c[:0])
    # an index file of 0 codes with (empty) paths: the loaded index takes its first codes' choice
    HashIndex(9).save(tmp_path / "e0.nacidx")
    _rewrite(tmp_path / "e0.nacidx", tmp_path / "e.nacidx", lambda h: h.update(has_paths=True))
    with zipfile.ZipFile(tmp_path / "e.nacidx", "a") as z:
        z.writestr("paths.json", "[]")
    back = HashIndex.load(tmp_path / "e.nacidx")
    assert back.paths == []
    back.add(c)
    assert back.paths is None and back.ntotal == 5
    back.save(tmp_path / "e2.nacidx")
    assert HashIndex.load(tmp_path / "e2.nacidx").ntotal == 5


def test_an_empty_ids_list_matches_an_empty_batch():
    index = HashIndex(9)
    index.add(rand_codes(0, 0, 9), ids=[])
    index.add(rand_codes(0, 2, 9), ids=[3, 4])
    index.add(rand_codes(0, 0, 9), ids=())
    assert index.ids.tolist() == [3, 4]
    with pytest.raises(TypeError, match="ids must be integers, got torch.float32"):
        index.add(rand_codes(0, 1, 9), ids=[1.5])


@pytest.mark.parametrize("text", ["[]", "null", "1", '"x"', "true"])
def test_a_meta_json_that_is_not_an_object_is_a_value_error(tmp_path, text):
    import io
    path = tmp_path / "odd.nacidx"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("meta.json", text)
        b = io.BytesIO()
        np.save(b, np.zeros((1, 1), "<u8"))
        z.writestr("codes.npy", b.getvalue())
    with pytest.raises(ValueError, match="not a complete nac_fast HashIndex file.*meta.json "
                       "holds .*, not the JSON object"):
        HashIndex.load(path)


def test_backend_argument_is_checked_before_the_file_is_read(tmp_path):
    index = HashIndex(8)
    index.add(rand_codes(0, 3, 8))
    index.save(tmp_path / "a.nacidx")
    with pytest.raises(TypeError, match="^backend must be a str, got int$"):
        HashIndex.load(tmp_path / "a.nacidx", backend=1)
    with pytest.raises(TypeError, match="^backend must be a str, got int$"):
        HashIndex.load(tmp_path / "never-read.nacidx", backend=1)   # before the file
    for make in (lambda: HashIndex(8, backend="bogus"),
                 lambda: HashIndex.load(tmp_path / "a.nacidx", backend="bogus")):
        with pytest.raises(ValueError, match="^backend must be one of .*got 'bogus'"):
            make()
    assert HashIndex.load(tmp_path / "a.nacidx", backend="reference").backend == "reference"


def test_flags_must_be_bools(tmp_path):
    """overwrite= guards the user's file: "no" is not a yes.  zero_one= likewise."""
    index = HashIndex(8)
    index.add(rand_codes(0, 3, 8))
    path = tmp_path / "a.nacidx"
    index.save(path)
    before = path.read_bytes()
    index.add(rand_codes(1, 3, 8))
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="^overwrite must be a bool, got"):
            index.save(path, overwrite=bad)
    assert path.read_bytes() == before
    with pytest.raises(TypeError, match="^overwrite must be a bool"):
        index.save(tmp_path / "new.nacidx", overwrite="no")
    assert sorted(os.listdir(tmp_path)) == ["a.nacidx"]
    c = rand_codes(2, 2, 8).int()
    for call in (lambda: index.add(c, zero_one=1), lambda: index.search(c, 1, zero_one="yes"),
                 lambda: index.search(c.numpy(), 1, zero_one=1)):
        with pytest.raises(TypeError, match="^zero_one must be a bool"):
            call()
    assert index.ntotal == 6


# ------------------------------------------------------------------------------------------
# A GPU index (device="cuda", .to()): FAISS's GpuIndexBinaryFlat in spirit
# ------------------------------------------------------------------------------------------

def test_device_argument_is_checked():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        HashIndex(16, device="meta")
    with pytest.raises(TypeError, match="device must be a str or torch.device"):
        HashIndex(16, device=0.5)
    with pytest.raises(ValueError, match="is not a device"):
        HashIndex(16, device="gpu")
    index = HashIndex(16)
    assert index.device == torch.device("cpu") and index.to("cpu") is index
    if not torch.cuda.is_available():
        for make in (lambda: HashIndex(16, device="cuda"), lambda: index.to("cuda:0"),
                     lambda: HashIndex.load("never-read.nacidx", device="cuda")):
            with pytest.raises(ValueError, match="no CUDA device is available"):
                make()
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            HashIndex(16, device=f"cuda:{torch.cuda.device_count()}")


def test_a_gpu_without_room_is_refused_before_anything_moves(monkeypatch):
    """.to(GPU) checks the GPU's free memory before copying: here a GPU is pretended (no copy is
    ever reached) with 1 MiB free for 4 MiB of codes."""
    index = HashIndex(128)
    index.add(rand_codes(0, 1 << 18, 128))  # 4 MiB of codes
    monkeypatch.setattr(HI, "_check_device", lambda name, d: torch.device("cuda", 0))
    monkeypatch.setattr(HI, "gpu_free_bytes", lambda device: 1 << 20)
    with pytest.raises(ValueError, match=r"262,144 codes of 128 bits needs 4 MiB on cuda:0, "
                                         r"which has 1 MiB free"):
        index.to("cuda")
    assert index.device == torch.device("cpu") and index.ntotal == 1 << 18


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="a GPU index: needs a GPU")
def test_gpu_index_search_add_save_and_move(tmp_path):
    g, q = rand_codes(1, 9000, 128), rand_codes(2, 33, 128)
    cpu = HashIndex(128)
    cpu.add(g[:5000], ids=torch.arange(5000) * 3)
    gpu = HashIndex(128, device="cuda")
    gpu.add(g[:5000].cuda(), ids=torch.arange(5000) * 3)  # codes from either device
    assert gpu.codes.words.device.type == "cuda" and "device='cuda:0'" in repr(gpu)
    for index in (cpu, gpu):
        index.add(g[5000:], ids=torch.arange(5000, 9000) * 3)
    wd, wi = np_topk(q.numpy(), g.numpy(), 10)
    for queries in (q, q.cuda(), q.numpy()):
        D, I = gpu.search(queries, 10)
        if isinstance(queries, torch.Tensor):
            assert D.device == queries.device
        np.testing.assert_array_equal(np.asarray(D if isinstance(D, np.ndarray) else D.cpu()), wd)
        np.testing.assert_array_equal(np.asarray(I if isinstance(I, np.ndarray) else I.cpu()), wi)
    assert torch.equal(gpu.ids, cpu.ids)
    I = gpu.search(q.cuda(), 10)[1]  # CUDA positions: their ids on the GPU too
    ids = gpu.ids_at(I)
    assert ids.device == I.device and torch.equal(ids.cpu(), torch.from_numpy(wi) * 3)
    gpu.save(tmp_path / "g.nacidx")
    back = HashIndex.load(tmp_path / "g.nacidx", device="cuda")
    assert back.device.type == "cuda"
    assert torch.equal(back.codes.words.cpu(), cpu.codes.words)
    assert back.to("cpu") is back and back.codes.words.device.type == "cpu"
    assert torch.equal(back.search(q, 10)[1], torch.from_numpy(wi))
    # a CPU index searched with CUDA queries: its codes copied to that GPU once
    D, I = cpu.search(q.cuda(), 10)
    assert I.device.type == "cuda" and torch.equal(I.cpu(), torch.from_numpy(wi))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="query codes are on cuda:1 but the index is on"):
            gpu.search(q.to("cuda:1"), 10)


# ---------------------------------------------------------------------------------------------
# A GPU index's workspace check, tested on the CPU
# ---------------------------------------------------------------------------------------------
from nac_fast.ops import search as S  # noqa: E402


def _words(seed, n, W):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 62, 2 ** 62, (n, W), generator=g, dtype=torch.int64)


def test_gpu_index_reference_search_checks_its_workspace(monkeypatch):
    """A GPU index searched by the reference engine: its chunks' temporaries count in the free
    memory check (a ValueError before any copy), as the Triton and CUDA engines' workspace does;
    before, only the queries and results were counted and the search ran into a CUDA OOM.  The GPU
    is pretended: the check raises before anything touches it."""
    index = HashIndex(128, backend="reference")
    index.add(_words(3, 1 << 16, 2).ne(0).repeat_interleave(64, 1)[:, :128])
    index._device = torch.device("cuda", 0)   # a GPU index (its codes are never read here)
    monkeypatch.setattr(HI, "resolve_backend", lambda backend, words, nbits=None: "reference")
    monkeypatch.setattr(HI, "gpu_free_bytes", lambda device: 1 << 20)
    empty = torch.empty

    def meta_empty(*a, device=None, **kw):  # the engine's probe tensor, on no real GPU
        cuda = device is not None and torch.device(device).type == "cuda"
        return empty(*a, device="meta" if cuda else device, **kw)

    monkeypatch.setattr(torch, "empty", meta_empty)
    q = torch.ones(4, 128, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"searching 4 queries \(top 10\) in 65,536 codes needs "
                                         r"\d+ MiB on cuda:0, which has 1 MiB free"):
        index.search(q, 10)
    assert S.ref_topk_workspace_bytes(4, 1 << 16, 10, 2) > 1 << 25
