"""scripts/: the tools that are not benchmarks.  nac_loss_floor.py's figures are the ones
docs/math.md [M:z0] and [M:floor] (and the README) quote; plot_train_log.py draws what
docs/training.md says to judge a run by."""
import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import nac_loss_floor  # noqa: E402


@pytest.mark.parametrize("images,D,p", [(4, 16, 0.1), (256, 128, 0.1), (3, 7, 0.4)])
def test_loss_at_zero_is_d_ln_2(images, D, p):
    """[M:z0]: at z = 0 every logit is 0, so lse - log n = 0, and r = 0 makes -bern = D ln 2."""
    c, b, total = nac_loss_floor.loss_at(0.0, images, D, p, torch.Generator().manual_seed(0))
    assert c == pytest.approx(0.0, abs=1e-12)
    assert b == pytest.approx(D * math.log(2), rel=1e-12)
    assert total == pytest.approx(D * math.log(2), rel=1e-12)


def test_floor_figures_quoted_in_the_docs(capsys):
    """[M:floor] for batch 256, D = 128, p = 0.1: the minimum is ~87.5 near t = 0.2, about 1.2
    below D ln 2 = 88.72, and saturated codes (t = 1) score ~149."""
    g = torch.Generator().manual_seed(0)
    at = {t: nac_loss_floor.loss_at(t, 256, 128, 0.1, g)[2] for t in (0.15, 0.2, 0.25, 1.0)}
    assert at[0.2] == pytest.approx(87.5, abs=0.1)
    assert at[0.2] < min(at[0.15], at[0.25])
    assert 128 * math.log(2) - at[0.2] == pytest.approx(1.2, abs=0.1)
    assert at[1.0] == pytest.approx(149, abs=1.0)
    nac_loss_floor.main(["--images", "8", "--dim", "16", "--magnitudes", "0,0.5"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f"D ln 2 = {16 * math.log(2):.3f}")
    assert out[-1].startswith("lowest: ") and len(out) == 5


@pytest.mark.parametrize("argv", [["--p", "0.5"], ["--images", "0"], ["--magnitudes", "0,2"],
                                  ["--magnitudes", "a"]])
def test_bad_flags(argv):
    with pytest.raises(SystemExit) as e:
        nac_loss_floor.main(argv)
    assert e.value.code == 2


def test_code_shape_statistics_on_known_distributions():
    """scripts/code_shape.py (docs/results.md's longer run): skewness, kurtosis and sign balance
    per bit, checked on distributions whose values are known."""
    import code_shape
    g = torch.Generator().manual_seed(0)
    n = 200_000
    gauss = code_shape.shape_stats(torch.randn(n, 4, generator=g, dtype=torch.float64))
    assert gauss["skewness"] == pytest.approx(0.0, abs=0.03)
    assert gauss["kurtosis"] == pytest.approx(3.0, abs=0.05)
    assert gauss["balance_dev"] == pytest.approx(0.0, abs=0.005) and gauss["skewed_bits"] == 0.0
    # centred exponential: skewness 2, kurtosis 9, P(a >= 0) = exp(-1) = 0.368
    e = -torch.log(torch.rand(n, 4, generator=g, dtype=torch.float64)) - 1.0
    ex = code_shape.shape_stats(e)
    assert ex["skewness"] == pytest.approx(2.0, abs=0.1)
    assert ex["kurtosis"] == pytest.approx(9.0, abs=0.8)
    assert ex["balance_dev"] == pytest.approx(0.5 - math.exp(-1), abs=0.005)
    assert ex["skewed_bits"] == 0.0  # 0.368 lies inside [0.3, 0.7]
    # a one-sided bit: 90% of the images negative
    b = torch.where(torch.rand(n, 1, generator=g) < 0.9, -1.0, 9.0).double()
    assert code_shape.shape_stats(b)["skewed_bits"] == 1.0
    assert code_shape.shape_stats(torch.zeros(3, 2))["code_mag"] == 0.0
    with pytest.raises(ValueError, match="a must be"):
        code_shape.shape_stats(torch.zeros(1, 4))
    with pytest.raises(SystemExit):
        code_shape.main(["/nonexistent/last.pt"])


def test_code_shape_correlation_and_effective_rank():
    """Independent bits: |corr| ~ 0 and effective rank ~ D; copies of one bit: |corr| = 1 and
    rank 1; two groups of copies: rank 2."""
    import code_shape
    g = torch.Generator().manual_seed(0)
    ind = code_shape.shape_stats(torch.randn(100_000, 8, generator=g, dtype=torch.float64))
    assert ind["mean_abs_corr"] < 0.01 and ind["eff_rank"] == pytest.approx(8.0, rel=0.01)
    one = torch.randn(1000, 1, generator=g, dtype=torch.float64)
    same = code_shape.shape_stats(one * torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=torch.float64))
    assert same["mean_abs_corr"] == pytest.approx(1.0) and same["eff_rank"] == pytest.approx(1.0)
    two = torch.randn(100_000, 2, generator=g, dtype=torch.float64).repeat_interleave(3, dim=1)
    assert code_shape.shape_stats(two)["eff_rank"] == pytest.approx(2.0, rel=0.01)


@pytest.mark.parametrize("q,gal,d", [(1, 3, 4), (3, 97, 16), (97, 1031, 32)])
def test_code_shape_hamming_ranking_is_the_evaluation_map(q, gal, d):
    """ranking_map over sgn(q) . sgn(g) is the evaluation's Hamming mAP (ties by gallery index
    included: few bits make many ties); a score that sorts every relevant item first gives 1."""
    import code_shape
    from nac_fast import mean_average_precision
    g = torch.Generator().manual_seed(q)
    aq, ag = torch.randn(q, d, generator=g), torch.randn(gal, d, generator=g)
    yq, yg = torch.randint(0, 3, (q,), generator=g), torch.randint(0, 3, (gal,), generator=g)
    yq[0] = yg[0]  # at least one query with a relevant item
    m = code_shape.retrieval_maps(aq, yq, ag, yg)
    assert code_shape.retrieval_maps(aq, yq, ag, yg, chunk=7) == pytest.approx(m, abs=1e-12)
    sq, sg = torch.where(aq >= 0, 1, -1).to(torch.int8), torch.where(ag >= 0, 1, -1).to(torch.int8)
    want = float(mean_average_precision(sq, yq, sg, yg, backend="reference"))
    assert m["hamming_map"] == pytest.approx(want, abs=1e-12)
    # ranking_map (the cosine column's ranking) breaks ties by gallery index as the evaluation
    assert code_shape.ranking_map(sq.double() @ sg.double().T, yq, yg) == pytest.approx(
        want, abs=1e-12)
    assert 0.0 < m["cosine_map"] <= 1.0
    med = ag.double().median(0).values  # the gallery's per-bit median: shifting both by it
    m2 = code_shape.retrieval_maps(aq - med, yq, ag - med, yg)  # makes the plain sign the
    assert m2["hamming_map"] == pytest.approx(m["median_map"], abs=1e-12)  # median-centred one
    oracle = (yq[:, None] == yg[None, :]).double()
    assert code_shape.ranking_map(oracle, yq, yg) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="score must be"):
        code_shape.ranking_map(oracle[:, :-1], yq, yg)


def test_make_image_folder_digits_without_scikit_learn_says_so(tmp_path, monkeypatch, capsys):
    import make_image_folder
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn raises ImportError
    with pytest.raises(SystemExit) as e:
        make_image_folder.main(["digits", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "scikit-learn, which is not installed (pip install scikit-learn" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def plot_train_log():
    pytest.importorskip("matplotlib")
    import plot_train_log  # scripts/ is on sys.path (above)
    return plot_train_log


def _log_dir(tmp_path, recs, config):
    """A run folder as train.py writes it: log.jsonl (recs) and config.json (config)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "config.json").write_text(json.dumps(config))
    return run


def test_plot_train_log_draws_the_statistics_and_the_zero_code_line(tmp_path, plot_train_log):
    """The panels docs/training.md says to judge a run by (loss_excess, code_mag, r_mag,
    r_slope) and the zero-code value on the loss panel (here loss - loss_excess = D ln 2 for the
    config.json's method) and the small-code optimum 2(1 - 2p) on the r_slope panel."""
    z = 16 * math.log(2)
    recs = [{"step": s, "loss": z + 1.0 / s, "loss_excess": 1.0 / s, "code_mag": 0.1 * s,
             "r_mag": 0.2, "r_slope": 0.5 * s, "balance_score": 0.9, "lr": 0.1}
            for s in (1, 2, 3)]
    run = _log_dir(tmp_path, recs, {"method": "nac", "flip_prob": 0.1})
    out = tmp_path / "c.png"
    fig = plot_train_log.main([str(run / "log.jsonl"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    for key in ("loss", "loss_excess", "code_mag", "r_mag", "r_slope", "balance_score", "lr"):
        assert key in axes, sorted(axes)
    labels = {ln.get_label(): ln for ln in axes["loss"].get_lines()}
    assert f"D ln 2 = {z:.2f}" in labels, sorted(labels)
    assert list(labels[f"D ln 2 = {z:.2f}"].get_ydata()) == pytest.approx([z, z])
    slope = {ln.get_label(): ln for ln in axes["r_slope"].get_lines()}
    assert list(slope["2(1-2p) = 1.60"].get_ydata()) == pytest.approx([1.6, 1.6])
    assert list(axes["r_slope"].get_lines()[0].get_ydata()) == [0.5, 1.0, 1.5]
    # the picture is not replaced without being asked: a usage error naming --out, file kept
    before = out.read_bytes()
    with pytest.raises(SystemExit) as e:
        plot_train_log.main([str(run / "log.jsonl"), "--out", str(out)])
    assert e.value.code == 2 and out.read_bytes() == before
    plot_train_log.main([str(run / "log.jsonl"), "--out", str(out), "--overwrite"])
    # the default: curves.png beside the first log, refused once it is there
    plot_train_log.main([str(run / "log.jsonl")])
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as e:
        plot_train_log.main([str(run / "log.jsonl")])
    assert e.value.code == 2


def test_plot_train_log_follows_a_p_schedule(tmp_path, plot_train_log):
    """With --flip-prob-final ([M:p-schedule]) the log records each step's p: a flip_prob panel,
    and the r_slope panel's small-code optimum 2(1 - 2p) at each logged step's p."""
    recs = [{"step": s, "loss": 12.0, "loss_excess": 0.9, "r_slope": 0.5, "flip_prob": p}
            for s, p in ((1, 0.25), (2, 0.3), (3, 0.4))]
    run = _log_dir(tmp_path, recs, {"method": "nac", "flip_prob": 0.25, "flip_prob_final": 0.4})
    fig = plot_train_log.main([str(run / "log.jsonl"), "--out", str(tmp_path / "c.png")])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(axes["flip_prob"].get_lines()[0].get_ydata()) == [0.25, 0.3, 0.4]
    slope = {ln.get_label(): ln for ln in axes["r_slope"].get_lines()}
    assert list(slope["2(1-2p) at each step's p"].get_ydata()) == pytest.approx([1.0, 0.8, 0.4])


# ---- regressions of the audit (/tmp/audit_vae/REPORT.md, bugs 10-15) -----------------------

def _usage_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_export_images_overwrite_replaces_the_export(tmp_path, capsys):
    """Bug 10: --overwrite mixed the new export with the old one's files."""
    import export_images
    out = tmp_path / "ex"
    assert export_images.main(["--out", str(out), "--per-class", "2", "--split", "train"]) == 0
    (out / "notes.txt").write_text("mine")
    assert export_images.main(["--out", str(out), "--per-class", "1", "--split", "test",
                               "--overwrite"]) == 0
    pngs = sorted(p.name for p in out.rglob("*.png"))
    assert len(pngs) == 10 and all(n.startswith("test_") for n in pngs), pngs
    assert (out / "notes.txt").read_text() == "mine"  # not a file of the export: kept


def test_export_images_bad_out_and_offset(tmp_path, capsys):
    """Bug 11: --out naming a file gave a traceback; --offset past the data wrote 0 images."""
    import export_images
    (tmp_path / "afile").write_text("")
    for extra in ([], ["--overwrite"]):
        assert "--out" in _usage_error(capsys, export_images.main,
                                       ["--out", str(tmp_path / "afile"), "--per-class", "1"]
                                       + extra)
    assert "--offset" in _usage_error(capsys, export_images.main,
                                      ["--out", str(tmp_path / "o"), "--offset", "100000"])
    assert not (tmp_path / "o").exists()


def test_make_image_folder_refuses_an_empty_side(tmp_path, capsys):
    """Bug 12: --val-frac leaving train/ or val/ empty was reported as a success."""
    import make_image_folder
    for frac in ("0.95", "0.05"):
        msg = _usage_error(capsys, make_image_folder.main,
                           ["shapes", str(tmp_path / f"m{frac}"), "--per-class", "5", "--size",
                            "8", "--val-frac", frac])
        assert "--val-frac" in msg, msg
        assert not (tmp_path / f"m{frac}").exists()
    (tmp_path / "afile").write_text("")
    assert "afile" in _usage_error(capsys, make_image_folder.main,
                                   ["shapes", str(tmp_path / "afile" / "x"), "--per-class", "5",
                                    "--size", "8"])


def test_plot_train_log_bad_logs_and_a_vae_log(tmp_path, capsys, plot_train_log):
    """Bug 13: empty / bad logs gave tracebacks; a VAE log's eval record replaced its last
    training record (so nothing was left to draw)."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 1\n')
    (tmp_path / "none.jsonl").write_text('{"step": 1, "foo": 1}\n')
    for name in ("empty", "bad", "none"):
        _usage_error(capsys, plot_train_log.main, [str(tmp_path / f"{name}.jsonl"), "--out",
                                                   str(tmp_path / f"{name}.png")])
        assert not (tmp_path / f"{name}.png").exists()
    vae = tmp_path / "vae.jsonl"
    vae.write_text('{"step": 4, "epoch": 0, "loss": 500.0, "lr": 0.0005, "img_per_s": 90}\n'
                   '{"step": 4, "eval": {"elbo": -480.0}}\n')
    assert plot_train_log.read_log(str(vae))[-1]["loss"] == 500.0
    assert plot_train_log.main([str(vae), "--out", str(tmp_path / "vae.png")]) is not None
    assert "--out" in _usage_error(capsys, plot_train_log.main,
                                   [str(vae), "--out", "/proc/nac_fast_x/p.png"])


def test_show_augmentations_bad_arguments(tmp_path, capsys):
    """Bug 14: bad --data / --size / --num / --epoch gave tracebacks."""
    import show_augmentations
    out = str(tmp_path / "a.png")
    for argv, flag in ((["--data", str(tmp_path / "none")], "--data"),
                       (["--data", "fashion-mnist", "--size", "0"], "--size"),
                       (["--data", "fashion-mnist", "--epoch", "-1"], "--epoch"),
                       (["--data", "fashion-mnist", "--num", "100000"], "--num")):
        assert flag in _usage_error(capsys, show_augmentations.main, argv + ["--out", out])
    assert not os.path.exists(out)


def test_code_shape_bad_checkpoints_and_data(tmp_path, capsys):
    """Bug 15: a corrupt or VAE checkpoint, or bad --data, gave a traceback after the header."""
    import code_shape
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    vae = tmp_path / "vae.pt"
    torch.save({"model": {}, "config": {"kind": "vae", "image_size": 28}}, vae)
    for argv in ([str(bad)], [str(vae)]):
        _usage_error(capsys, code_shape.main, argv + ["--data", "fashion-mnist"])
    assert capsys.readouterr().out == ""  # no table header before the failure


# ---- scripts/make_ilsvrc_tree.py ------------------------------------------------------------

QUIRKY = "grey=0.1,cmyk=0.1,png=0.1,exif=0.1,truncated=0.1"


def test_make_ilsvrc_tree_shape_labels_and_quirks(tmp_path, capsys):
    """The tree's shape and names, its labels files (LOC_val_solution.csv, LOC_synset_mapping,
    the devkit's ground truth in its synset order), and each quirk present and read as the
    loaders read it: greyscale, CMYK, PNG-named-.JPEG and EXIF-rotated files decode to RGB (the
    EXIF one upright), a truncated one passes the scan and is skipped ("warn") or named
    ("error") by the on_bad_file policy."""
    import csv
    import re
    import warnings
    import make_ilsvrc_tree
    from PIL import Image
    from nac_fast.data import build_eval_loader
    from nac_fast.data.sources import resolve_source
    from nac_fast.data.sources.imagefolder import load_rgb
    out = tmp_path / "tree"
    assert make_ilsvrc_tree.main(["--out", str(out), "--classes", "5", "--train-per-class", "8",
                                  "--val-per-class", "4", "--size", "24", "--seed", "3",
                                  "--quirks", QUIRKY, "--devkit", "--workers", "2"]) == 0
    meta = json.loads((out / "make_ilsvrc_tree.json").read_text())
    wnids = meta["wnids"]
    assert len(wnids) == 5 and all(re.fullmatch(r"n\d{8}", w) for w in wnids)
    assert sorted(os.listdir(out / "train")) == wnids
    for w in wnids:
        names = os.listdir(out / "train" / w)
        assert len(names) == 8 and all(re.fullmatch(w + r"_\d+\.JPEG", n) for n in names)
    val = sorted(os.listdir(out / "val"))
    assert val == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, 21)]
    with open(out / "LOC_val_solution.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["ImageId", "PredictionString"] and len(rows) == 21
    labels = {}
    for image, pred in rows[1:]:
        toks = pred.split()
        assert len(toks) in (5, 10) and set(toks[0::5]) <= set(wnids)
        x0, y0, x1, y1 = map(int, toks[1:5])
        assert 0 <= x0 <= x1 < 24 and 0 <= y0 <= y1 < 24
        labels[image] = toks[0]
    assert sorted(labels.values()) == sorted(wnids * 4)
    syn = (out / "LOC_synset_mapping.txt").read_text().splitlines()
    assert [s.split()[0] for s in syn] == wnids
    dev = out / "ILSVRC2012_devkit_t12" / "data"
    order = [s.split()[0] for s in (dev / "synsets.txt").read_text().splitlines()]
    assert sorted(order) == wnids
    gt = [int(v) for v in (dev / "ILSVRC2012_validation_ground_truth.txt").read_text().split()]
    assert [order[k - 1] for k in gt] == [labels[v[:-5]] for v in val]
    # the quirks: 6 files each (10% of 60, train and val together), each as its name says
    quirks = meta["quirk_files"]
    assert sorted(quirks) == sorted(make_ilsvrc_tree.QUIRKS)
    assert all(len(v) == 6 for v in quirks.values())
    assert len({p for v in quirks.values() for p in v}) == 30
    for p in quirks["grey"]:
        assert Image.open(out / p).mode == "L" and load_rgb(str(out / p)).mode == "RGB"
    for p in quirks["cmyk"]:
        assert Image.open(out / p).mode == "CMYK" and load_rgb(str(out / p)).size == (24, 24)
    for p in quirks["png"]:
        assert p.endswith(".JPEG") and Image.open(out / p).format == "PNG"
        assert load_rgb(str(out / p)).size == (24, 24)
    for p in quirks["exif"]:
        im = Image.open(out / p)
        assert im.getexif()[0x0112] == 6 and im.size == (18, 24)   # stored on its side
        assert load_rgb(str(out / p)).size == (24, 18)              # upright
    for p in quirks["truncated"]:
        raw = (out / p).read_bytes()
        assert raw[:3] == b"\xff\xd8\xff"                          # the scan's magic bytes
        with pytest.raises(OSError):
            load_rgb(str(out / p))
    src = resolve_source(str(out), "train")
    assert len(src.files) == 40 and src.bad_files == []             # every header passes
    trunc = [str(out / p) for p in quirks["truncated"] if p.startswith("val")]
    assert trunc   # (seed 3 puts some in val/)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ld = build_eval_loader(str(out), "val", batch_size=20, image_size=16)
        next(iter(ld))
    assert sorted(ld.skipped_files) == sorted(trunc) and any("skipping" in str(x.message)
                                                              for x in w)
    ld = build_eval_loader(str(out), "val", batch_size=20, image_size=16, on_bad_file="error")
    with pytest.raises(ValueError, match=re.escape(sorted(trunc)[0])):
        next(iter(ld))
    # a non-empty --out is refused unless --overwrite; bad flags are one line, exit 2
    assert "--out" in _usage_error(capsys, make_ilsvrc_tree.main, ["--out", str(out)])
    for bad in (["--quirks", "blur=0.1"], ["--quirks", "grey=2"], ["--quirks", "grey=0.6,png=0.6"],
                ["--size", "4"], ["--classes", "0"]):
        assert bad[0] in _usage_error(capsys, make_ilsvrc_tree.main,
                                      ["--out", str(tmp_path / "b")] + bad)
    assert not (tmp_path / "b").exists()
    assert make_ilsvrc_tree.main(["--out", str(out), "--classes", "2", "--train-per-class", "1",
                                  "--val-per-class", "0", "--overwrite", "--workers", "1"]) == 0
    assert len(os.listdir(out / "train")) == 2 and os.listdir(out / "val") == []
    assert [p.name for p in tmp_path.iterdir()] == ["tree"]           # no temporary left


def test_make_ilsvrc_tree_reuse(tmp_path, capsys):
    """--reuse keeps a tree made with the same arguments (one line says so, nothing rewritten),
    replaces one made with other arguments only with --overwrite, and refuses a folder that is
    not such a tree even with --overwrite (exit 2 naming --out, the folder left as it was)."""
    import make_ilsvrc_tree
    out = tmp_path / "tree"
    same = ["--out", str(out), "--classes", "2", "--train-per-class", "2", "--val-per-class", "1",
            "--quirks", "grey=0.2", "--workers", "1", "--no-progress", "--reuse"]
    assert make_ilsvrc_tree.main(same) == 0
    assert "4 train images in 2 class folders" in capsys.readouterr().out
    (out / "mine.txt").write_text("x")
    assert make_ilsvrc_tree.main(same + ["--overwrite"]) == 0
    assert capsys.readouterr().out == (f"{out}: reused, its make_ilsvrc_tree.json records the "
                                       "same arguments\n")
    other = same + ["--size", "16"]
    assert "--overwrite" in _usage_error(capsys, make_ilsvrc_tree.main, other)
    assert (out / "mine.txt").exists()
    assert make_ilsvrc_tree.main(other + ["--overwrite"]) == 0
    capsys.readouterr()
    assert json.loads((out / "make_ilsvrc_tree.json").read_text())["size"] == 16
    assert not (out / "mine.txt").exists()
    (out / "make_ilsvrc_tree.json").write_text("{")                   # no longer such a tree
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    for folder in (out, mine):
        err = _usage_error(capsys, make_ilsvrc_tree.main,
                           ["--out", str(folder), "--reuse", "--overwrite", "--no-progress"])
        assert "--out" in err and "is not a make_ilsvrc_tree.py tree" in err, err
    assert os.listdir(mine) == ["keep.txt"] and (out / "make_ilsvrc_tree.json").read_text() == "{"


# ---- moved from tests/test_audit_scripts.py, test_train_bench.py, test_data_bench.py (issue 57) ----
# The scripts run as a demanding user would: damaged inputs, bad options and bad output paths
# are usage errors (exit status 2, the argument named, no traceback) before any work.

import csv  # noqa: E402
import subprocess  # noqa: E402

import export_images  # noqa: E402
import probe_rates  # noqa: E402


def _boom(*a, **k):
    raise AssertionError("worked before the arguments were checked")


def _usage_error_naming(capsys, fn, argv, *words):
    """fn(argv) exits with status 2, no traceback, a message naming each of `words`."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    return err


def test_plot_train_log_draws_a_log_of_one_record(tmp_path, capsys):
    """A short train.py run logs one record: each quantity is one point, which a plain line
    does not draw (every panel came out empty).  A log that is not text names the log."""
    pytest.importorskip("matplotlib")
    import plot_train_log
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"step": 2, "loss": 14.1, "loss_excess": 3.0,
                                               "r_slope": 0.3, "flip_prob": 0.25,
                                               "lr": 0.15}) + "\n")
    (run / "config.json").write_text(json.dumps({"method": "nac", "flip_prob": 0.25,
                                                 "flip_prob_final": 0.4}))
    fig = plot_train_log.main([str(run / "log.jsonl"), "--out", str(tmp_path / "c.png")])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    for key in ("loss", "loss_excess", "lr", "r_slope"):
        line = axes[key].get_lines()[0]
        assert list(line.get_ydata()) and line.get_marker() not in (None, "None", "", " "), key
    sched = {ln.get_label(): ln for ln in axes["r_slope"].get_lines()}["2(1-2p) at each step's p"]
    assert sched.get_marker() not in (None, "None", "", " ")
    (tmp_path / "bin.jsonl").write_bytes(b'{"step": 1}\n\x80\x81\xff\n')
    _usage_error_naming(capsys, plot_train_log.main, [str(tmp_path / "bin.jsonl"), "--out",
                                               str(tmp_path / "b.png")], "bin.jsonl")
    assert not (tmp_path / "b.png").exists()


def _eval_dir(path, n=40, d=4):
    """An nac_fast.eval output folder with a linear result and tiny cached features."""
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    for split in ("train", "test"):
        torch.save({"h": torch.randn(n, d, generator=g), "labels": torch.arange(n) % 2},
                   path / f"features_{split}.pt")
    rep = {"seed": 0, "results": {"linear": {"test_top1": 0.5, "best_lr": 0.1, "epochs": 1,
                                             "batch_size": 16, "lrs": [0.1]}}}
    (path / "report.json").write_text(json.dumps(rep))
    return path


def test_probe_rates_damaged_eval_dirs_are_usage_errors_before_any_fit(tmp_path, capsys,
                                                                        monkeypatch):
    """A report.json that is not an object, a linear result without its settings, a damaged or
    foreign feature cache gave tracebacks (AttributeError, KeyError), and a bad directory after
    a good one was found only after the good one's fits."""
    good = _eval_dir(tmp_path / "good")
    bad = {name: _eval_dir(tmp_path / name) for name in ("list", "noepochs", "junk", "foreign")}
    (bad["list"] / "report.json").write_text("[1, 2]")
    rep = json.loads((good / "report.json").read_text())
    del rep["results"]["linear"]["epochs"]
    (bad["noepochs"] / "report.json").write_text(json.dumps(rep))
    (bad["junk"] / "features_train.pt").write_bytes(b"junk")
    torch.save({"x": 1}, bad["foreign"] / "features_test.pt")
    monkeypatch.setattr(probe_rates, "train_linear_probe", _boom)
    for name, d in bad.items():
        _usage_error_naming(capsys, probe_rates.main, [str(good), str(d), "--no-progress"], name)


def test_probe_rates_csv_path_checked_before_the_fits_and_written_whole(tmp_path, capsys,
                                                                         monkeypatch):
    """--csv under a file gave a traceback after every fit; in a missing folder it failed too
    (the folder is made now)."""
    good = _eval_dir(tmp_path / "good")
    (tmp_path / "afile").write_text("x")
    real = probe_rates.train_linear_probe
    monkeypatch.setattr(probe_rates, "train_linear_probe", _boom)
    _usage_error_naming(capsys, probe_rates.main, [str(good), "--no-progress", "--csv",
                                            str(tmp_path / "afile" / "r.csv")], "--csv")
    monkeypatch.setattr(probe_rates, "train_linear_probe", real)
    out = tmp_path / "new" / "sub" / "r.csv"
    assert probe_rates.main([str(good), str(good), "--no-progress", "--csv", str(out)]) == 0
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["eval_dir", "protocol_lr", "protocol_top1", "lr_0.1"]
    assert len(rows) == 2  # a directory named twice is one row
    assert sorted(os.listdir(out.parent)) == ["r.csv"]


def test_code_shape_retrieval_beyond_the_test_split_is_refused(tmp_path, capsys, monkeypatch):
    """--retrieval Q larger than the test split ran fewer queries than the header's "(Q q)"."""
    import code_shape
    import make_image_folder
    import train
    ck = tmp_path / "run"
    assert train.main(["--data", "synthetic:32", "--image-size", "8", "--batch-size", "16",
                       "--code-dim", "8", "--max-steps", "1", "--no-progress", "--out",
                       str(ck)]) == 0
    data = tmp_path / "shapes"
    assert make_image_folder.main(["shapes", str(data), "--per-class", "5", "--size", "8"]) == 0
    capsys.readouterr()
    sizes = code_shape.check_input(str(ck / "last.pt"), str(data), ["test", "train"])
    assert sizes == {"test": 10, "train": 40}
    monkeypatch.setattr(code_shape, "features_of", _boom)
    _usage_error_naming(capsys, code_shape.main, [str(ck / "last.pt"), "--data", str(data),
                                           "--retrieval", "11"], "--retrieval", "10 test images")
    assert capsys.readouterr().out == ""


def test_export_images_empty_out_and_a_class_folder_taken_by_a_file(tmp_path, capsys):
    """--out '' wrote the export, then failed renaming it (traceback); --overwrite where a class's
    folder is a file of the user's deleted the old export's files, then failed half-way."""
    _usage_error_naming(capsys, export_images.main, ["--out", "", "--per-class", "1"], "--out")
    out = tmp_path / "ex"
    assert export_images.main(["--out", str(out), "--per-class", "1"]) == 0
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    for p in (out / "trouser").iterdir():
        p.unlink()
    (out / "trouser").rmdir()
    (out / "trouser").write_text("mine")
    _usage_error_naming(capsys, export_images.main, ["--out", str(out), "--per-class", "2",
                                              "--overwrite"], "--out", "trouser")
    after = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert after == [p for p in before if not p.startswith("trouser/")]
    assert (out / "trouser").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex"]  # no temporary folder left


def test_plot_train_log_tells_runs_apart_and_draws_a_log_once(tmp_path, monkeypatch):
    """Two logs in folders of one name (runs/a/seed0, runs/b/seed0) had the same legend label,
    and a log named twice was drawn twice."""
    import plot_train_log
    assert plot_train_log.run_names(["/r/a/seed0/log.jsonl", "/r/b/seed0/log.jsonl"]) == [
        "a/seed0", "b/seed0"]
    assert plot_train_log.run_names(["/r/a/log.jsonl", "/r/b/log.jsonl"]) == ["a", "b"]
    logs = []
    for parent in ("a", "b"):
        d = tmp_path / parent / "seed0"
        d.mkdir(parents=True)
        (d / "log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n"
                                             for s in (1, 2)))
        logs.append(str(d / "log.jsonl"))
    seen = {}

    class Drawn(Exception):
        pass

    def draw(runs):   # the runs drawn are what matters: stop there
        seen["names"] = [n for n, _, _ in runs]
        raise Drawn

    monkeypatch.setattr(plot_train_log, "draw", draw)
    with pytest.raises(Drawn):
        plot_train_log.main(logs + [logs[0], "--out", str(tmp_path / "c.png")])
    assert seen["names"] == ["a/seed0", "b/seed0"]


def test_nac_loss_floor_refuses_more_images_than_memory_holds(capsys, monkeypatch):
    """--images had no upper bound: the reference's n x n float64 logits (n = 2 x images) of
    --images 100000 ask for ~1 TiB, and the machine ran out of memory instead of an error."""
    import nac_loss_floor
    monkeypatch.setattr(nac_loss_floor, "available_bytes", lambda: 2**30)
    monkeypatch.setattr(nac_loss_floor, "loss_at", _boom)
    err = _usage_error_naming(capsys, nac_loss_floor.main, ["--images", "10000"], "--images 10000",
                       "GiB")
    most = int(err.split("at most --images ")[1].split(")")[0])
    assert nac_loss_floor.MATRICES * 8 * (2 * most) ** 2 <= 2**30 < \
        nac_loss_floor.MATRICES * 8 * (2 * (most + 1)) ** 2


def test_make_image_folder_size_has_an_upper_bound(tmp_path, capsys):
    """--size had no upper bound: --size 100000 would draw 30 GB images."""
    import make_image_folder
    _usage_error_naming(capsys, make_image_folder.main, ["shapes", str(tmp_path / "f"), "--size",
                                                  "100000"], "--size", "[8, 4096]")
    assert not (tmp_path / "f").exists()


def test_plot_train_log(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "epoch": 0, "loss": 88.7 - 0.01 * s, "lr": 0.1 * s, "img_per_s": 100.0,
             "data_wait": 0.01, "distinct_frac": 1.0, "mean_hamming": 60.0 + s,
             "balance_score": 0.9, "code_sat": 0.05} for s in (1, 2, 3)]
    recs.append(dict(recs[-1], loss=1.0))  # a resumed run repeats step 3: the last one counts
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    import plot_train_log  # scripts/ is on sys.path (above)
    assert [r["loss"] for r in plot_train_log.read_log(str(run / "log.jsonl"))][-1] == 1.0
    out = tmp_path / "c.png"
    plot_train_log.main([str(run / "log.jsonl"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="not a JSON line"):
        plot_train_log.read_log(str(run / "bad.jsonl"))


def _run_script(*args):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
@pytest.mark.skipif(__import__("nac_fast.data.sources.fashion_mnist", fromlist=["x"]).find_dir()
                    is None, reason="Fashion-MNIST not installed")
def test_show_augmentations_writes_a_grid(tmp_path):
    from PIL import Image
    png = str(tmp_path / "grid.png")
    out = _run_script("scripts/show_augmentations.py", "--num", "3", "--out", png)
    assert "3 rows" in out
    w, h = Image.open(png).size
    assert (w, h) == (3 * 28 + 4 * 2, 3 * 28 + 4 * 2)      # 3x3 tiles of 28 px, 2 px padding
    # an existing --out is refused (naming the flag) and kept; --overwrite replaces it
    before = open(png, "rb").read()
    r = subprocess.run([sys.executable, "scripts/show_augmentations.py", "--num", "2", "--out",
                        png], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert open(png, "rb").read() == before
    _run_script("scripts/show_augmentations.py", "--num", "2", "--out", png, "--overwrite")
    assert Image.open(png).size == (3 * 28 + 4 * 2, 2 * 28 + 3 * 2)
