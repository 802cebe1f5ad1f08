"""python -m nac_fast.index on a real (tiny) train.py checkpoint: the README's "Use your codes"
commands run as written on image folders this test writes, the codes equal the evaluation
pipeline's, and every bad input is one clear error with nothing written.

Also one regression test per bug an audit of the command line fixed: symlinked class folders,
the search's own --checkpoint, help texts, usage errors, outputs that name an input, a contact
sheet too large to hold; and `search`'s JSON against a popcount oracle (tests/test_index.py)."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import train  # noqa: E402
from export_images import export  # noqa: E402

import nac_fast  # noqa: E402
from nac_fast import HashIndex  # noqa: E402
from nac_fast.index import cli  # noqa: E402
from nac_fast.index.encode import scan_images  # noqa: E402
from test_index import _popcount_topk  # noqa: E402

D = 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    assert train.main(["--max-steps", "2", "--batch-size", "64", "--code-dim", str(D),
                       "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    return str(out / "last.pt")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """photos/ (6 train images per class, one unreadable PNG, one text file), more_photos/ (2 per
    class), queries/ (1 test image per class)."""
    root = tmp_path_factory.mktemp("images")
    export("fashion-mnist", "train", 6, str(root / "photos"))
    export("fashion-mnist", "train", 2, str(root / "more_photos"), offset=6)
    export("fashion-mnist", "test", 1, str(root / "queries"))
    (root / "photos" / "bag" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (root / "photos" / "notes.txt").write_text("not an image")
    return root


def _run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"^## Use your codes\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README has no 'Use your codes' section"
    block = re.search(r"```text\n(.*?)```", m.group(1), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_readme_use_your_codes_runs(ckpt, folders, tmp_path):
    """The four commands, as the README writes them, in a folder holding runs/default/last.pt
    and the image folders they name."""
    cmds = _readme_commands()
    assert len(cmds) == 4 and all(c.startswith("python -m nac_fast.index ") for c in cmds)
    os.makedirs(tmp_path / "runs" / "default")
    shutil.copy(ckpt, tmp_path / "runs" / "default" / "last.pt")
    for name in ("photos", "more_photos", "queries"):
        shutil.copytree(folders / name, tmp_path / name)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outs = []
    for c in cmds:
        r = subprocess.run([sys.executable] + c.split()[1:], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{c}\n{r.stdout}\n{r.stderr}"
        outs.append(r)
    assert "skipped 1 unreadable image(s)" in outs[0].stderr and "broken.png" in outs[0].stderr
    assert "ignored 1 file(s)" in outs[0].stderr
    index = nac_fast.HashIndex.load(tmp_path / "photos.nacidx")
    assert index.ntotal == 80 and index.nbits == D
    assert set(index.labels) == {"t-shirt", "trouser", "pullover", "dress", "coat", "sandal",
                                 "shirt", "sneaker", "bag", "ankle-boot"}
    assert index.meta["checkpoint_sha256"] and index.meta["normalization"]["mean"] == [0.286]
    hits = json.loads((tmp_path / "hits.json").read_text())
    assert hits["k"] == 8 and len(hits["queries"]) == 10
    q0 = hits["queries"][0]
    assert q0["query"].endswith(".png") and len(q0["results"]) == 8
    assert set(q0["results"][0]) >= {"path", "distance", "label"}
    d = [r["distance"] for r in q0["results"]]
    assert d == sorted(d) and all(0 <= x <= D for x in d)
    from PIL import Image
    with Image.open(tmp_path / "hits.png") as im:
        assert im.height > 10 * 96 and im.width > 9 * 96  # 10 rows, query + 8 neighbours
    npz = np.load(tmp_path / "codes.npz")
    pm1 = np.load(tmp_path / "codes.npy")
    assert npz["codes"].dtype == np.uint64 and int(npz["nbits"]) == D and len(npz["paths"]) == 60
    assert pm1.shape == (60, D) and set(np.unique(pm1)) <= {-1, 1}
    assert np.array_equal(npz["codes"].view(np.int64), index.codes.words[:60].numpy())
    assert np.array_equal(nac_fast.pack_codes(torch.from_numpy(pm1)).words.numpy(),
                          npz["codes"].view(np.int64))


def test_codes_are_the_evaluation_pipelines(ckpt, folders, tmp_path, capsys):
    """A PNG of a Fashion-MNIST test image gets exactly the code the evaluation computes from the
    data set (same normalisation, size and model mode)."""
    from nac_fast.data import build_eval_loader
    from nac_fast.train.checkpoint import load_model
    out = tmp_path / "q.nacidx"
    code, _, err = _run(["build", "--checkpoint", ckpt, "--images", str(folders / "queries"),
                         "--out", str(out), "--no-progress"], capsys)
    assert code == 0, err
    index = nac_fast.HashIndex.load(out)
    model = load_model(ckpt)
    x, _ = next(iter(build_eval_loader("fashion-mnist", split="test", batch_size=256)))
    with torch.no_grad():
        a = model.encode(x)[1]
    want = {}
    for p in index.paths:
        i = int(os.path.basename(p).split("_")[1].split(".")[0])
        assert i < 256  # the first image of each class lies in the first batch
        want[p] = a[i] >= 0
    got = nac_fast.unpack_codes(index.codes, dtype=torch.bool)
    for row, p in zip(got, index.paths):
        assert torch.equal(row, want[p]), p


@pytest.fixture
def built(ckpt, folders, tmp_path, capsys):
    out = tmp_path / "photos.nacidx"
    code, _, err = _run(["build", "--checkpoint", ckpt, "--images", str(folders / "photos"),
                         "--out", str(out), "--no-progress", "--bits", "16"], capsys)
    assert code == 0, err
    return out


def _unchanged(path):
    return path.read_bytes() if path.exists() else None


def test_build_errors_write_nothing(ckpt, folders, built, tmp_path, capsys):
    before = built.read_bytes()
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("x")
    bad_imgs = tmp_path / "bad"
    (bad_imgs / "c").mkdir(parents=True)
    (bad_imgs / "c" / "x.jpg").write_bytes(b"\xff\xd8\xff garbage")
    ck = torch.load(ckpt, weights_only=False)
    nohead = dict(ck, model={k: v for k, v in ck["model"].items() if not k.startswith("head.")})
    torch.save(nohead, tmp_path / "nohead.pt")
    other = dict(ck, step=ck["step"] + 1)  # same weights, another file: another checkpoint
    torch.save(other, tmp_path / "other.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    new = str(tmp_path / "new.nacidx")
    cases = [
        (["--images", str(empty), "--out", new], "holds no image files"),
        (["--images", str(tmp_path / "texts"), "--out", new], "holds no image files"),
        (["--images", str(tmp_path / "nope"), "--out", new], "no such folder"),
        (["--images", str(bad_imgs), "--out", new], "none of the 1 image files could be read"),
        (["--images", str(folders / "photos"), "--out", new, "--checkpoint",
          str(tmp_path / "nohead.pt")], "no code head"),
        (["--images", str(folders / "photos"), "--out", new, "--checkpoint",
          str(tmp_path / "junk.pt")], "--checkpoint"),
        (["--images", str(folders / "photos"), "--out", new, "--bits", "33"], "bits must be an int in"),
        (["--images", str(folders / "photos"), "--out", new, "--bits", "0"], "--bits must be >= 1"),
        (["--images", str(folders / "photos"), "--out", str(built)], "exists; pass --overwrite"),
        (["--images", str(folders / "more_photos"), "--out", str(built), "--append",
          "--checkpoint", str(tmp_path / "other.pt")], "codes of two models cannot share"),
        (["--images", str(folders / "more_photos"), "--out", str(built), "--append",
          "--bits", "32"], "holds 16-bit codes"),
        (["--images", str(folders / "more_photos"), "--out", new, "--append"], "does not exist"),
    ]
    for extra, match in cases:
        argv = ["build", "--checkpoint", ckpt, "--no-progress"] + extra
        if "--checkpoint" in extra:
            argv = ["build", "--no-progress"] + extra
        code, out, err = _run(argv, capsys)
        assert code == 2 and match in err, (extra, err)
        assert err.count("\n") <= 3, err  # a short message, no traceback
    assert built.read_bytes() == before
    assert not os.path.exists(new)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["bad", "empty", "texts", "nohead.pt", "other.pt", "junk.pt", "photos.nacidx"])
    # appending from the same checkpoint works and keeps the old codes first
    code, out, err = _run(["build", "--checkpoint", ckpt, "--images", str(folders / "more_photos"),
                           "--out", str(built), "--append", "--no-progress"], capsys)
    assert code == 0, err
    index = nac_fast.HashIndex.load(built)
    assert index.ntotal == 80 and index.nbits == 16 and len(index.meta["sources"]) == 2


def test_search_errors_write_nothing(ckpt, folders, built, tmp_path, capsys):
    js, png = tmp_path / "h.json", tmp_path / "h.png"
    broken_q = tmp_path / "broken.png"
    broken_q.write_bytes(b"\x89PNG\r\n\x1a\n")
    q = str(folders / "queries" / "bag")
    base = ["search", "--index", str(built), "--json", str(js), "--png", str(png), "--no-progress"]
    trunc = tmp_path / "trunc.nacidx"
    trunc.write_bytes(built.read_bytes()[:100])
    cases = [
        (["--k", "0", q], "--k must be >= 1"),
        (["--k", "-3", q], "--k must be >= 1"),
        ([str(broken_q)], "1 query image(s) cannot be read"),
        ([str(tmp_path / "missing.png")], "no such file or folder"),
        (["--checkpoint", __file__, q], "is not the one"),
        (["--device", "gpu", q], "--device 'gpu' is not a device (cpu, cuda, cuda:1, ...)"),
        (["--device", "mps", q], "--device must be 'cpu' or 'cuda'"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda", q], "--device 'cuda': no CUDA device is available"))
    for extra, match in cases:
        code, _, err = _run(base + extra, capsys)
        assert code == 2 and match in err, (extra, err)
        assert not js.exists() and not png.exists()
    code, _, err = _run(["search", "--index", str(trunc), q], capsys)
    assert code == 2 and "not a complete nac_fast HashIndex file" in err
    # k > ntotal: all of it, said so
    code, out, err = _run(["search", "--index", str(built), "--k", "1000", "--no-progress", q],
                          capsys)
    assert code == 0 and "returning all 60" in err
    res = json.loads(out)
    assert res["k"] == 60 and len(res["queries"][0]["results"]) == 60


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--device cuda: needs a GPU")
def test_search_on_the_gpu_gives_the_cpus_answer(ckpt, folders, built, capsys):
    """--device cuda: the queries encoded and the index searched on the GPU (Triton's top-k),
    the same neighbours, distances and tie order as on the CPU."""
    q = str(folders / "queries")
    runs = {}
    for dev in ("cpu", "cuda"):
        code, out, err = _run(["search", "--index", str(built), "--k", "7", "--no-progress",
                               "--device", dev, q], capsys)
        assert code == 0, err
        runs[dev] = json.loads(out)["queries"]
    assert [[r["id"] for r in x["results"]] for x in runs["cuda"]] == \
        [[r["id"] for r in x["results"]] for x in runs["cpu"]]
    assert [[r["distance"] for r in x["results"]] for x in runs["cuda"]] == \
        [[r["distance"] for r in x["results"]] for x in runs["cpu"]]


def test_search_refuses_to_overwrite(ckpt, folders, built, tmp_path, capsys):
    """--json / --png files already there are refused before the queries are encoded, each by
    its flag, and left as they were; --overwrite replaces them."""
    js, png = tmp_path / "h.json", tmp_path / "h.png"
    q = str(folders / "queries" / "bag")
    base = ["search", "--index", str(built), "--json", str(js), "--png", str(png), "--no-progress",
            "--k", "3", q]
    for mine, other in ((js, png), (png, js)):
        mine.write_bytes(b"mine")
        code, _, err = _run(base, capsys)
        assert code == 2 and f"--{mine.suffix[1:]} {str(mine)!r} exists; pass --overwrite" in err
        assert mine.read_bytes() == b"mine" and not other.exists()
        mine.unlink()
    code, _, err = _run(base[:5] + ["--png", str(js)] + base[7:], capsys)
    assert code == 2 and "--json and --png name the same file" in err and not js.exists()
    js.write_bytes(b"mine")
    png.write_bytes(b"mine")
    code, _, err = _run(base + ["--overwrite"], capsys)
    assert code == 0, err
    assert json.loads(js.read_text())["k"] == 3 and png.read_bytes()[:4] == b"\x89PNG"


def test_a_root_of_splits_gets_a_note_on_its_labels(ckpt, folders, tmp_path, capsys):
    """An ImageFolder root (train/<class>/, val/<class>/) labels its images "train" / "val":
    said on stderr, naming the folder to index for class labels; a folder of classes (or a
    class called "train" holding its images directly) gets no note."""
    root = tmp_path / "root"
    shutil.copytree(folders / "queries", root / "train")
    shutil.copytree(folders / "queries", root / "val")
    code, _, err = _run(["encode", "--checkpoint", ckpt, "--images", str(root), "--out",
                         str(tmp_path / "a.npz"), "--no-progress"], capsys)
    assert code == 0 and "the labels are its first-level folders (train, val)" in err, err
    assert repr(os.path.join(str(root), "train")) in err
    code, _, err = _run(["encode", "--checkpoint", ckpt, "--images", str(root / "train"), "--out",
                         str(tmp_path / "b.npz"), "--no-progress"], capsys)
    assert code == 0 and "note:" not in err, err
    flat = tmp_path / "flat"
    shutil.copytree(folders / "queries" / "bag", flat / "train")
    code, _, err = _run(["encode", "--checkpoint", ckpt, "--images", str(flat), "--out",
                         str(tmp_path / "c.npz"), "--no-progress"], capsys)
    assert code == 0 and "note:" not in err, err


def test_encode_refuses_to_overwrite(ckpt, folders, tmp_path, capsys):
    out = tmp_path / "c.npz"
    out.write_bytes(b"mine")
    code, _, err = _run(["encode", "--checkpoint", ckpt, "--images", str(folders / "queries"),
                         "--out", str(out), "--no-progress"], capsys)
    assert code == 2 and "exists; pass --overwrite" in err and out.read_bytes() == b"mine"


@pytest.mark.slow
def test_help_runs():
    r = subprocess.run([sys.executable, "-m", "nac_fast.index", "build", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and "--append" in r.stdout


def test_the_contact_sheet_heading_fits_a_short_row(folders, tmp_path):
    """With one neighbour a row is two thumbnails wide, narrower than the heading: the sheet
    widens so the title and the legend are not cut at its right edge."""
    from PIL import Image
    from nac_fast.index.sheet import PAD, draw_contact_sheet
    q = sorted(str(p) for p in (folders / "queries").rglob("*.png"))[:2]
    rows = [{"query": q[0], "label": "a", "results": [{"path": q[1], "distance": 3,
                                                       "label": "b"}]}]
    out = tmp_path / "s.png"
    draw_contact_sheet(rows, str(out), title="photos.nacidx: 60 codes of 32 bits, top 1")
    with Image.open(out) as im:
        rgb = np.asarray(im.convert("RGB"))
    assert rgb.shape[1] > 2 * (96 + 2 * PAD) + 2 * PAD            # wider than the row
    heading = rgb[:44]
    assert (heading[:, -PAD:] == 255).all()                      # nothing runs off the edge
    assert (heading[:, PAD:-PAD] < 255).any(axis=(0, 2)).nonzero()[0].max() > 2 * (96 + 2 * PAD)


def test_a_query_file_takes_its_folders_label_when_the_index_has_it(folders, built, tmp_path,
                                                                    capsys):
    """queries/bag/x.png searched on its own is labelled "bag" (a label of the index), so its
    neighbours of other labels are marked; a file in a folder the index has no label for has
    none."""
    import shutil
    bag = next((folders / "queries" / "bag").iterdir())
    other = tmp_path / "holiday" / "x.png"
    other.parent.mkdir()
    shutil.copy(bag, other)
    code, out, err = _run(["search", "--index", str(built), "--k", "3", "--no-progress",
                           str(bag), str(other), str(folders / "queries")], capsys)
    assert code == 0, err
    q = json.loads(out)["queries"]
    assert [x["label"] for x in q[:2]] == ["bag", None]
    assert sorted(x["label"] for x in q[2:]) == sorted(os.listdir(folders / "queries"))


def test_unwritable_outputs_are_refused_before_any_encoding(ckpt, folders, built, tmp_path,
                                                            capsys, monkeypatch):
    """An output under a file, or in a folder nothing can be created in, is a one-line error
    naming its flag, found before an image is encoded; nothing is written."""
    from nac_fast.index.encode import CodeEncoder
    afile = tmp_path / "afile"
    afile.write_text("mine")
    under = afile / "sub"
    q = str(folders / "queries" / "bag")
    enc = ["encode", "--checkpoint", ckpt, "--images", str(folders / "queries"), "--no-progress"]
    cases = [
        (enc + ["--npy", str(tmp_path / "n.npy"), "--out", str(under / "x.npz")], "--out", under),
        (enc + ["--npy", str(under / "n.npy"), "--out", str(tmp_path / "x.npz")], "--npy", under),
        (["build", "--checkpoint", ckpt, "--images", str(folders / "queries"), "--out",
          str(under / "x.nacidx"), "--no-progress"], "--out", under),
        (["search", "--index", str(built), "--png", str(tmp_path / "s.png"), "--json",
          str(under / "s.json"), "--no-progress", q], "--json", under),
        (["search", "--index", str(built), "--png", str(under / "s.png"), "--no-progress", q],
         "--png", under),
    ]
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(CodeEncoder, "encode_files",
                        lambda *a, **k: pytest.fail("images encoded before the refusal"))
    for argv, flag, bad in cases:
        code, _, err = _run(argv, capsys)
        path = [a for a in argv if a.startswith(str(bad))][0]
        assert code == 2 and f"{flag} {path!r}: {str(afile)!r} is not a folder" in err, (argv, err)
        assert err.count("\n") == 1, err
        assert sorted(os.listdir(tmp_path)) == before and afile.read_text() == "mine"
    if os.path.isdir("/proc"):  # a folder no file can be created in, whoever runs the test
        code, _, err = _run(enc + ["--out", "/proc/nac_fast_test.npz"], capsys)
        assert code == 2 and "--out '/proc/nac_fast_test.npz': cannot write in '/proc'" in err


def test_a_failed_write_leaves_neither_output(ckpt, folders, built, tmp_path, capsys,
                                             monkeypatch):
    """encode's --out and --npy, search's --json and --png: written together or not at all (a
    disk that fills while the second is written leaves no first one), one line, exit status 2."""
    import nac_fast._files as files
    real = os.fsync
    calls = []

    def fsync(fd):  # the second file's write fails
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(fd)
    q = str(folders / "queries" / "bag")
    runs = [(["encode", "--checkpoint", ckpt, "--images", str(folders / "queries"), "--out",
              str(tmp_path / "x.npz"), "--npy", str(tmp_path / "x.npy"), "--no-progress"]),
            (["search", "--index", str(built), "--json", str(tmp_path / "s.json"), "--png",
              str(tmp_path / "s.png"), "--no-progress", q])]
    first = sorted(os.listdir(tmp_path))
    for argv in runs:
        before = sorted(os.listdir(tmp_path))
        calls.clear()
        monkeypatch.setattr(files.os, "fsync", fsync)
        code, _, err = _run(argv, capsys)
        monkeypatch.setattr(files.os, "fsync", real)
        assert code == 2 and "cannot write" in err and "No space left" in err, err
        assert len(calls) == 2 and sorted(os.listdir(tmp_path)) == before  # no temporary file
        code, _, err = _run(argv, capsys)                          # the disk has room again
        assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted(first + ["x.npz", "x.npy", "s.json", "s.png"])


def test_device_and_code_length_errors_name_their_flag(ckpt, folders, tmp_path, capsys):
    """build / encode check --device first (before the folder scan), as search does; an index of
    longer codes than its checkpoint makes is the --index's fault (search has no --bits)."""
    from nac_fast.index.encode import CodeEncoder, file_sha256
    bad = [("bogus", "--device 'bogus' is not a device (cpu, cuda, cuda:1, ...)")]
    if not torch.cuda.is_available():
        bad.append(("cuda", "--device 'cuda': no CUDA device is available"))
    for sub in ("build", "encode"):
        for device, match in bad:
            code, _, err = _run([sub, "--checkpoint", ckpt, "--images", str(tmp_path / "nope"),
                                 "--out", str(tmp_path / "x.out"), "--device", device,
                                 "--no-progress"], capsys)
            assert code == 2 and match in err and "--checkpoint" not in err, (sub, err)
    with pytest.raises(ValueError, match="^device 'bogus' is not a device"):
        CodeEncoder(ckpt, device="bogus")
    wide = nac_fast.HashIndex(D + 32, meta={"checkpoint": ckpt,
                                            "checkpoint_sha256": file_sha256(ckpt)})
    wide.add(torch.ones(3, D + 32))
    wide.save(tmp_path / "wide.nacidx")
    code, _, err = _run(["search", "--index", str(tmp_path / "wide.nacidx"), "--no-progress",
                         str(folders / "queries" / "bag")], capsys)
    assert code == 2 and f"--index {str(tmp_path / 'wide.nacidx')!r} holds {D + 32}-bit codes" \
        in err and "--bits" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["wide.nacidx"]


# ------------------------------------------------------------------------------------------
# Regression tests of an audit of the command line as a FAISS user would use it: symlinked
# class folders, the search's own --checkpoint, help texts, usage errors, outputs that name
# an input, contact sheets too large to hold
# ------------------------------------------------------------------------------------------

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


# the bugs below need a real checkpoint: the inputs are lost only when the run gets to its end

SMALL_D = 16


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-step train.py checkpoint, a folder of 2 images per class and an index of it."""
    root = tmp_path_factory.mktemp("small_index")
    assert train.main(["--max-steps", "2", "--batch-size", "32", "--code-dim", str(SMALL_D),
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
