"""Audit of nac_fast.HashIndex and python -m nac_fast.index as a user of a FAISS-like binary
index uses them: searches against a brute-force numpy oracle (XOR / popcount of the packed words,
and +-1 dot products) at awkward sizes, and one regression test per bug the audit fixed (ids out
of the int64 range, many small adds with ids / paths / labels, saving under a file, a header
that only looks like version 1, symlinked class folders, the search's own --checkpoint, help
texts, outputs that name an input)."""
from __future__ import annotations

import io
import json
import os
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

import nac_fast
from nac_fast import HashIndex
from nac_fast.index import cli
from nac_fast.index.encode import scan_images

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------
# search against a numpy oracle
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# HashIndex bugs
# --------------------------------------------------------------------------------------------

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


def _rewrite(src, dst, mutate_head):
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    head = json.loads(members["meta.json"])
    mutate_head(head)
    members["meta.json"] = json.dumps(head).encode()
    with zipfile.ZipFile(dst, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


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


# --------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------

def _run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_scan_follows_a_symlinked_class_folder(tmp_path):
    """Bug: scan_images walked without following links, so a class folder that is a symlink
    (photos/bag -> /data/bag) was silently left out of the index (training's ImageFolder reads
    it).  Now its images are indexed with its label; a link back to an ancestor is not looped."""
    data = tmp_path / "data" / "bag"
    data.mkdir(parents=True)
    for i in range(3):
        (data / f"{i}.png").write_bytes(b"x")
    root = tmp_path / "photos"
    (root / "coat").mkdir(parents=True)
    (root / "coat" / "c.png").write_bytes(b"x")
    os.symlink(data, root / "bag")
    os.symlink(root, root / "coat" / "loop")     # a loop: not followed
    os.symlink(data, root / "coat" / "again")    # a second link to a folder read: not again
    files, labels, ignored = scan_images(str(root))
    assert [os.path.relpath(f, root) for f in files] == [
        "bag/0.png", "bag/1.png", "bag/2.png", "coat/c.png"]
    assert labels == ["bag", "bag", "bag", "coat"] and ignored == []


def test_search_names_a_missing_checkpoint_of_its_own(tmp_path, capsys):
    """Bug: `search --checkpoint nope.pt` said "the checkpoint 'nope.pt' the index was built
    with is not there; pass --checkpoint with a copy of it", though the user had passed it.  Now
    the error names --checkpoint (a missing file, a folder)."""
    index = HashIndex(8, meta={"checkpoint": str(tmp_path / "recorded.pt")})
    index.add(np.ones((2, 8)))
    index.save(tmp_path / "i.nacidx")
    (tmp_path / "q.png").write_bytes(b"x")
    code, out, err = _run(["search", "--index", str(tmp_path / "i.nacidx"), "--checkpoint",
                           str(tmp_path / "nope.pt"), "--no-progress", str(tmp_path / "q.png")],
                          capsys)
    assert code == 2 and "error: --checkpoint" in err and "no such file" in err, err
    assert "the index was built with" not in err
    code, out, err = _run(["search", "--index", str(tmp_path / "i.nacidx"), "--checkpoint",
                           str(tmp_path), "--no-progress", str(tmp_path / "q.png")], capsys)
    assert code == 2 and "error: --checkpoint" in err and "folder" in err, err
    # without --checkpoint: the recorded one is blamed, as before
    code, out, err = _run(["search", "--index", str(tmp_path / "i.nacidx"), "--no-progress",
                           str(tmp_path / "q.png")], capsys)
    assert code == 2 and "the index was built with is not there" in err, err


def test_every_option_has_a_help_text():
    """Bug: `search --help` showed --batch-size and --no-progress without a word."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    text = sub.choices["search"].format_help()
    assert "query images per forward pass" in text and "no tqdm bar" in text


def test_usage_errors_exit_2_naming_the_argument(tmp_path, capsys):
    (tmp_path / "f.pt").write_bytes(b"x")
    cases = [
        (["build", "--checkpoint", "f.pt", "--images", "x", "--out", "o", "--bits", "abc"],
         "--bits"),
        (["search", "--index", "i", "--k", "x", "q"], "--k"),
        (["encode", "--checkpoint", "c", "--images", "x"], "--out"),
        (["search", "--k", "3", "q"], "--index"),
    ]
    for argv, flag in cases:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and flag in err, (argv, err)
    code, out, err = _run(["build", "--checkpoint", str(tmp_path / "f.pt"), "--images",
                           str(tmp_path / "nowhere"), "--out", str(tmp_path / "o.nacidx")],
                          capsys)
    assert code == 2 and "--images" in err and "no such folder" in err
    code, out, err = _run(["search", "--index", str(tmp_path / "none.nacidx"), "--k", "0",
                           str(tmp_path)], capsys)
    assert code == 2 and "--k must be >= 1" in err
    code, out, err = _run(["search", "--index", str(tmp_path / "f.pt"), str(tmp_path)], capsys)
    assert code == 2 and "--index" in err and "not a complete nac_fast HashIndex" in err


# the bug below needs a real checkpoint: the inputs are lost only when the run gets to its end

D = 16


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-step train.py checkpoint, a folder of 2 images per class and an index of it."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import train
    from export_images import export
    root = tmp_path_factory.mktemp("audit_index")
    assert train.main(["--max-steps", "2", "--batch-size", "32", "--code-dim", str(D),
                       "--out", str(root / "run"), "--no-progress", "--device", "cpu"]) == 0
    export("fashion-mnist", "train", 2, str(root / "photos"))
    assert cli.main(["build", "--checkpoint", str(root / "run" / "last.pt"), "--images",
                     str(root / "photos"), "--out", str(root / "photos.nacidx"),
                     "--no-progress"]) == 0
    return root


def test_overwrite_never_replaces_an_input(small, tmp_path, capsys):
    """Bug: --overwrite let an output name an input, and the run replaced it after reading it:
    `encode --out last.pt --overwrite` turned the trained checkpoint into an .npz, `search
    --json photos.nacidx --overwrite` the index into JSON, `--png q.png` the query image.  Now
    each is refused (exit 2, the flag named) with every input intact."""
    import shutil
    ck = tmp_path / "last.pt"
    shutil.copy(small / "run" / "last.pt", ck)
    idx = tmp_path / "photos.nacidx"
    shutil.copy(small / "photos.nacidx", idx)
    bag = small / "photos" / "bag"
    q = tmp_path / "q.png"
    shutil.copy(bag / sorted(os.listdir(bag))[0], q)
    keep = {p: p.read_bytes() for p in (ck, idx, q)}
    photos = str(small / "photos")
    for argv, flag in [
        (["encode", "--checkpoint", str(ck), "--images", photos, "--out", str(ck)], "--out"),
        (["encode", "--checkpoint", str(ck), "--images", photos, "--out",
          str(tmp_path / "c.npz"), "--npy", str(ck)], "--npy"),
        (["build", "--checkpoint", str(ck), "--images", photos, "--out", str(ck)], "--out"),
        (["search", "--index", str(idx), "--checkpoint", str(ck), "--json", str(idx), str(q)],
         "--json"),
        (["search", "--index", str(idx), "--checkpoint", str(ck), "--png", str(ck), str(q)],
         "--png"),
        (["search", "--index", str(idx), "--checkpoint", str(ck), "--png", str(q), str(q)],
         "--png"),
    ]:
        code, out, err = _run(argv + ["--overwrite", "--no-progress"], capsys)
        assert code == 2 and f"error: {flag}" in err and "name another output file" in err, \
            (argv, err)
        for p, data in keep.items():
            assert p.read_bytes() == data, (argv, p)
    assert not (tmp_path / "c.npz").exists()
    # an ordinary --overwrite of an earlier output still works
    (tmp_path / "hits.json").write_text("old")
    code, out, err = _run(["search", "--index", str(idx), "--checkpoint", str(ck), "--json",
                           str(tmp_path / "hits.json"), "--overwrite", "--no-progress", str(q)],
                          capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "hits.json").read_text())
    assert report["queries"][0]["results"][0]["distance"] == 0


def test_cli_search_equals_the_oracle_on_the_index_codes(small, capsys):
    """The JSON of `search` against the index's own codes searched by the popcount oracle (the
    queries are indexed images, so the first hit is at distance 0 and ties keep index order)."""
    index = HashIndex.load(small / "photos.nacidx")
    queries = index.paths[:3] + index.paths[-2:]
    code, out, err = _run(["search", "--index", str(small / "photos.nacidx"), "--k", "7",
                           "--no-progress"] + queries, capsys)
    assert code == 0, err
    report = json.loads(out)
    g = nac_fast.unpack_codes(index.codes).numpy() > 0
    qi = [index.paths.index(p) for p in queries]
    Do, Io = _popcount_topk(g, g[qi], 7)
    for r, drow, irow in zip(report["queries"], Do, Io):
        assert [x["distance"] for x in r["results"]] == drow.tolist()
        assert [x["path"] for x in r["results"]] == [index.paths[i] for i in irow]
        assert [x["id"] for x in r["results"]] == irow.tolist()


def test_a_contact_sheet_too_large_to_hold_is_refused_before_the_search(small, tmp_path, capsys,
                                                                        monkeypatch):
    """--png draws the whole sheet in memory (1000 queries x top 100: 4.5 GB).  Past
    sheet.MAX_PIXELS it is refused with exit 2 naming --png, before any query is encoded;
    contact_sheet refuses it too; a sheet within the limit is drawn as before."""
    from nac_fast.index import sheet
    w, h = sheet.sheet_size(1000, 100)
    assert w * h * 3 > 4e9
    with pytest.raises(ValueError, match="1000 queries x 100 neighbours"):
        sheet.check_sheet_size(1000, 100)
    sheet.check_sheet_size(100, 10)
    monkeypatch.setattr(sheet, "MAX_PIXELS", sheet.sheet_size(2, 5)[0] * sheet.sheet_size(2, 5)[1])
    index = HashIndex.load(small / "photos.nacidx")
    queries = index.paths[:3]
    real_encoder = cli._encoder

    def no_encoder(*a, **kw):
        raise AssertionError("the queries were encoded before the sheet's size was checked")
    monkeypatch.setattr(cli, "_encoder", no_encoder)
    code, out, err = _run(["search", "--index", str(small / "photos.nacidx"), "--k", "5",
                           "--png", str(tmp_path / "s.png"), "--no-progress"] + queries, capsys)
    assert code == 2 and "error: --png" in err and "3 queries x 5 neighbours" in err, err
    assert not (tmp_path / "s.png").exists()
    monkeypatch.setattr(cli, "_encoder", real_encoder)
    code, out, err = _run(["search", "--index", str(small / "photos.nacidx"), "--k", "5",
                           "--png", str(tmp_path / "s.png"), "--no-progress"] + queries[:2],
                          capsys)
    assert code == 0 and (tmp_path / "s.png").exists(), err
    rows = [{"query": q, "label": None, "results": [{"path": q, "distance": 0}] * 5}
            for q in queries]
    with pytest.raises(ValueError, match="3 queries x 5 neighbours"):
        sheet.contact_sheet(rows)
