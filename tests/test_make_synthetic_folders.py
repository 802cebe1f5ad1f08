"""scripts/make_synthetic_folders.py: image folders split by source (issue 58), small and fast."""
import json
import os
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_synthetic_folders as msf  # noqa: E402

SMALL = ["--size", "8", "--train-per-class", "6", "--val-per-class", "3", "--no-progress"]


def _make(out, kind="textures", seed=0, extra=()):
    assert msf.main(["--out", str(out), "--kind", kind, "--seed", str(seed)] + SMALL
                    + list(extra)) == 0


def _files(root):
    """{relative path: bytes} of every file under root."""
    got = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                got[os.path.relpath(p, root)] = f.read()
    return got


def _usage_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        msf.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("kind", ["textures", "shapes", "glyphs"])
def test_split_by_source_and_class_counts(tmp_path, kind):
    if kind == "glyphs" and len(msf.usable_fonts(msf.find_fonts())) < 2:
        pytest.skip("this machine has fewer than 2 fonts that draw the glyph classes")
    out = tmp_path / kind
    _make(out, kind)
    meta = json.loads((out / "sources.json").read_text())
    train, val = set(meta["sources"]["train"]), set(meta["sources"]["val"])
    assert train and val and not train & val
    classes = meta["classes"]
    assert len(classes) == 10 and len(set(classes)) == 10
    for split, n, own in (("train", 6, train), ("val", 3, val)):
        assert sorted(os.listdir(out / split)) == sorted(classes)
        for c in classes:
            names = os.listdir(out / split / c)
            assert len(names) == n and meta["counts"][split][c] == n
            # every image's source (the file name's prefix) is one of its split's sources
            assert {name.split("-")[0] for name in names} <= own
        with Image.open(out / split / classes[0] / sorted(os.listdir(out / split / classes[0]))[0]) as im:
            assert im.size == (8, 8) and im.mode == "RGB"
    # no temporary folder left beside it
    assert sorted(os.listdir(tmp_path)) == [kind]


def test_split_sources_disjoint_and_complete():
    for n, frac in ((2, 0.5), (22, 0.25), (40, 0.25), (5, 0.01), (5, 0.99)):
        tr, va = msf.split_sources(n, frac, seed=3)
        assert not set(tr) & set(va) and sorted(tr + va) == list(range(n))
        assert tr and va
    assert msf.split_sources(40, 0.25, 1) != msf.split_sources(40, 0.25, 2)
    with pytest.raises(ValueError, match="at least 2 sources"):
        msf.split_sources(1, 0.5, 0)


def test_same_seed_same_pixels_other_seed_other(tmp_path):
    _make(tmp_path / "a", "shapes", seed=5)
    _make(tmp_path / "b", "shapes", seed=5)
    _make(tmp_path / "c", "shapes", seed=6)
    a, b, c = (_files(tmp_path / x) for x in "abc")
    pa, pc = ({k: v for k, v in f.items() if k.endswith(".png")} for f in (a, c))
    ja, jb = (json.loads(f["sources.json"]) for f in (a, b))
    assert ja["command"] != jb["command"]  # the --out differs; all else is the same
    ja.pop("command"), jb.pop("command")
    assert ja == jb
    assert {k: v for k, v in a.items() if k != "sources.json"} == \
        {k: v for k, v in b.items() if k != "sources.json"}
    assert pa.keys() != pc.keys() or any(pa[k] != pc[k] for k in pa)


def test_refuses_to_overwrite_unless_asked(tmp_path, capsys):
    out = tmp_path / "f"
    _make(out, seed=0)
    before = _files(out)
    err = _usage_error(capsys, ["--out", str(out), "--kind", "textures", "--seed", "1"] + SMALL)
    assert "--out" in err and "--overwrite" in err
    assert _files(out) == before
    _make(out, seed=1, extra=["--overwrite"])
    after = _files(out)
    assert after != before and json.loads(after["sources.json"])["seed"] == 1
    assert sorted(os.listdir(tmp_path)) == ["f"]
    (tmp_path / "afile").write_text("x")
    err = _usage_error(capsys, ["--out", str(tmp_path / "afile"), "--kind", "textures",
                                "--overwrite"] + SMALL)
    assert "afile" in err and (tmp_path / "afile").read_text() == "x"
    # an empty folder is taken without --overwrite
    (tmp_path / "empty").mkdir()
    _make(tmp_path / "empty")


def test_a_failure_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def boom(kind, src, size, rng):
        calls.append(kind)
        if len(calls) > 5:
            raise RuntimeError("disk full")
        return Image.new("RGB", (size, size))
    monkeypatch.setattr(msf, "draw_texture", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        _make(tmp_path / "f")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag,value", [("--val-sources", "1"), ("--val-sources", "0"),
                                        ("--size", "4"), ("--train-per-class", "0"),
                                        ("--val-per-class", "0"), ("--seed", "-1"),
                                        ("--glyph-version", "4"), ("--glyph-version", "5"),
                                        ("--shape-version", "5")])
def test_bad_flags_name_the_flag(tmp_path, capsys, flag, value):
    err = _usage_error(capsys, ["--out", str(tmp_path / "f"), "--kind", "shapes"] + SMALL
                       + [flag, value])
    assert flag in err
    assert not (tmp_path / "f").exists()


def test_every_class_draws_something(tmp_path):
    """A class whose picture were blank (or the same as another's) would be unlearnable."""
    rng = np.random.default_rng(0)
    src = msf.texture_source(0, 0)
    for fam in msf.TEXTURES:
        x = np.asarray(msf.draw_texture(fam, dict(src, noise=0.0), 32, rng), dtype=np.float32)
        assert x.std() > 10, fam
    style = dict(msf.shape_source(0, 0), noise=0.0, background="flat", mode="fill")
    seen = set()
    for kind in msf.SHAPES:
        pts = msf.shape_points(kind, 32, 32, 20, 0.0)
        seen.add(tuple(np.round(np.asarray(pts), 3).ravel()))
        x = np.asarray(msf.draw_shape(kind, style, 32, np.random.default_rng(1)), dtype=np.float32)
        assert x.reshape(-1, 3).std(0).max() > 10, kind
    assert len(seen) == len(msf.SHAPES)


def _fonts_or_skip():
    fonts = msf.usable_fonts(msf.find_fonts())
    if len(fonts) < 2:
        pytest.skip("this machine has fewer than 2 fonts that draw the glyph classes")
    return fonts


def test_glyphs_v4_splits_by_font_and_v3_by_source():
    """v4: every font's 4 variants are 4 sources, all on the font's side of the split; v3: one
    source a font, split as before (the runs/sf3 folder)."""
    fonts = _fonts_or_skip()
    nv = len(msf.GLYPH_VARIANTS)
    p = msf.plan("glyphs", 0, 6, 3, 0.25, fonts, glyph_version=4)
    assert len(p["sources"]) == nv * len(fonts)
    tr, va = set(p["train_sources"]), set(p["val_sources"])
    assert tr and va and not tr & va and tr | va == set(range(nv * len(fonts)))
    font_of = [src["font"] for _, src in p["sources"]]
    assert not {font_of[k] for k in tr} & {font_of[k] for k in va}
    assert len({font_of[k] for k in va}) == len(va) // nv
    # the v4 split keeps v3's val fonts
    p3 = msf.plan("glyphs", 0, 6, 3, 0.25, fonts, glyph_version=3)
    assert [src["font"] for _, src in p3["sources"]] == fonts
    assert {font_of[k] for k in va} == {fonts[k] for k in p3["val_sources"]}
    with pytest.raises(ValueError, match="glyph_version"):
        msf.plan("glyphs", 0, 6, 3, 0.25, fonts, glyph_version=2)


def _ink_box(x):
    """(share of the frame that is ink, bounding box of the ink) of an RGB image drawn dark on
    light: ink = darker than halfway between the border's grey and the darkest pixel."""
    g = x.mean(2)
    border = np.concatenate([g[0], g[-1], g[:, 0], g[:, -1]]).mean()
    ink = g < (border + g.min()) / 2
    ys, xs = np.nonzero(ink)
    return ink.mean(), (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)


def test_glyphs_v4_letter_large_centred_dark_on_light():
    """v4's letter: its ink's longer side 0.5 to 0.9 of the frame, its box's centre within 0.15
    of the frame's centre, ink darker than the paper, whatever the font's variant; v3's letters
    were smaller (their ink a smaller share of the frame)."""
    fonts = _fonts_or_skip()
    n = 32
    shares = {3: [], 4: []}
    for k, font in enumerate(fonts[:4]):
        for variant in msf.GLYPH_VARIANTS:
            src = msf.glyph_source_v4(font, variant)
            for ci, c in enumerate(msf.GLYPHS):
                rng = np.random.default_rng([k, ci])
                x = np.asarray(msf.draw_glyph_v4(c, src, n, rng), dtype=np.float32)
                share, (x0, y0, x1, y1) = _ink_box(x)
                assert 0.5 <= max(x1 - x0, y1 - y0) / n <= 0.9, (font, variant, c)
                assert abs((x0 + x1) / 2 - n / 2) <= 0.15 * n, (font, variant, c)
                assert abs((y0 + y1) / 2 - n / 2) <= 0.15 * n, (font, variant, c)
                assert x[0].mean() > x[n // 2 - 4:n // 2 + 4, n // 2 - 4:n // 2 + 4].min() + 60
                shares[4].append(share)
        v3 = msf.glyph_source(0, k, font)
        for ci, c in enumerate(msf.GLYPHS):
            x = np.asarray(msf.draw_glyph(c, v3, n, np.random.default_rng([k, ci])),
                           dtype=np.float32)
            if x[0].mean() < x.mean():  # v3's light-on-dark sources: make the ink dark
                x = 255 - x
            shares[3].append(_ink_box(x)[0])
    assert np.mean(shares[4]) > 1.2 * np.mean(shares[3])


def _corner_palettes(draw, shifts=(0,)) -> set:
    """The GLYPH_PALETTES (their indices) whose paper, or a grey `shifts` levels below it, is
    nearest the top-left corner of draw(rng) over 40 images of seeds 0 .. 39."""
    cands = [(i, np.asarray(pp) - d) for i, (pp, _) in enumerate(msf.GLYPH_PALETTES)
             for d in shifts]
    corners = set()
    for i in range(40):
        x = np.asarray(draw(np.random.default_rng(i)), dtype=np.float32)
        paper = x[:3, :3].reshape(-1, 3).mean(0)
        corners.add(min(cands, key=lambda c: np.abs(paper - c[1]).sum())[0])
    return corners


def test_glyphs_v4_palettes_are_the_sources_common_ones():
    """v4's greys come from GLYPH_PALETTES for every source (they name neither the source nor
    the image): two sources draw from the same greys."""
    fonts = _fonts_or_skip()
    seen = [_corner_palettes(lambda rng, src=msf.glyph_source_v4(font, "plain"):
                             msf.draw_glyph_v4("E", dict(src), 32, rng)) for font in fonts[:2]]
    assert seen[0] == seen[1] == set(range(len(msf.GLYPH_PALETTES)))


def test_shape_version_only_for_shapes(tmp_path, capsys):
    err = _usage_error(capsys, ["--out", str(tmp_path / "f"), "--kind", "textures"] + SMALL
                       + ["--shape-version", "4"])
    assert "--shape-version" in err and not (tmp_path / "f").exists()
    with pytest.raises(ValueError, match="shape_version"):
        msf.plan("shapes", 0, 6, 3, 0.25, shape_version=2)


def test_shapes_v4_large_centred_dark_on_light():
    """v4's shape: its ink's longer side 0.4 to 0.9 of the frame, its box within 0.1 of the
    frame's centre, ink darker than the paper, in every style (mode, stroke, background) and for
    every shape."""
    n = 32
    for k in range(8):
        src = dict(msf.shape_source_v4(0, k), noise=0.0)
        for ci, kind in enumerate(msf.SHAPES):
            x = np.asarray(msf.draw_shape_v4(kind, src, n, np.random.default_rng([k, ci])),
                           dtype=np.float32)
            _, (x0, y0, x1, y1) = _ink_box(x)
            assert 0.4 <= max(x1 - x0, y1 - y0) / n <= 0.9, (k, kind, src)
            gap = max(x0 - n / 2, n / 2 - x1, y0 - n / 2, n / 2 - y1, 0)
            assert gap <= 0.1 * n, (k, kind, src)
            assert x[0].mean() > x.reshape(-1, 3).mean(1).min() + 60, (k, kind, src)


def test_shapes_v4_palettes_are_the_sources_common_ones():
    """v4's greys come from GLYPH_PALETTES for every style (paper, or the background pattern's
    grey SHAPE_BG_SHIFT below it): two styles draw from the same 4 palettes."""
    seen = [_corner_palettes(lambda rng, src=dict(msf.shape_source_v4(0, k), background="flat",
                                                  noise=0.0):
                             msf.draw_shape_v4("disc", src, 32, rng),
                             shifts=(0, msf.SHAPE_BG_SHIFT)) for k in (0, 1)]
    assert seen[0] == seen[1] == set(range(len(msf.GLYPH_PALETTES)))


@pytest.mark.slow
def test_a_kill_leaves_nothing(tmp_path):
    """SIGTERM while writing: the temporary folder goes, OUT is not made."""
    import signal
    import subprocess
    import time
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts",
                                                          "make_synthetic_folders.py"),
                             "--out", str(tmp_path / "f"), "--kind", "textures", "--size", "8",
                             "--train-per-class", "100000", "--no-progress"])
    try:
        deadline = time.time() + 60
        while not any(n.startswith(".tmp-") for n in os.listdir(tmp_path)):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.listdir(tmp_path) == []
