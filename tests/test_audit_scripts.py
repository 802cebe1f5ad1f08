"""Audit of the scripts and benchmarks run as a demanding user would (scripts/code_shape.py,
probe_rates.py, export_images.py, plot_train_log.py; bench/data_throughput.py,
train_throughput.py): damaged inputs, bad and GPU-only options on
a CPU machine and bad output paths are usage errors (exit status 2, the argument named, no
traceback) before any work; a one-record training log is drawn; outputs are written whole.
Tiny sizes, nothing timed for real (the measurements are replaced where they would run)."""
import csv
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import data_throughput  # noqa: E402
import export_images  # noqa: E402
import probe_rates  # noqa: E402
import train_throughput  # noqa: E402


def _boom(*a, **k):
    raise AssertionError("worked before the arguments were checked")


def _usage_error(capsys, fn, argv, *words):
    """fn(argv) exits with status 2, no traceback, a message naming each of `words`."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    return err


# ---- plot_train_log.py ---------------------------------------------------------------------------

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
    _usage_error(capsys, plot_train_log.main, [str(tmp_path / "bin.jsonl"), "--out",
                                               str(tmp_path / "b.png")], "bin.jsonl")
    assert not (tmp_path / "b.png").exists()


# ---- probe_rates.py ------------------------------------------------------------------------------

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
        _usage_error(capsys, probe_rates.main, [str(good), str(d), "--no-progress"], name)


def test_probe_rates_csv_path_checked_before_the_fits_and_written_whole(tmp_path, capsys,
                                                                         monkeypatch):
    """--csv under a file gave a traceback after every fit; in a missing folder it failed too
    (the folder is made now)."""
    good = _eval_dir(tmp_path / "good")
    (tmp_path / "afile").write_text("x")
    real = probe_rates.train_linear_probe
    monkeypatch.setattr(probe_rates, "train_linear_probe", _boom)
    _usage_error(capsys, probe_rates.main, [str(good), "--no-progress", "--csv",
                                            str(tmp_path / "afile" / "r.csv")], "--csv")
    monkeypatch.setattr(probe_rates, "train_linear_probe", real)
    out = tmp_path / "new" / "sub" / "r.csv"
    assert probe_rates.main([str(good), str(good), "--no-progress", "--csv", str(out)]) == 0
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["eval_dir", "protocol_lr", "protocol_top1", "lr_0.1"]
    assert len(rows) == 2  # a directory named twice is one row
    assert sorted(os.listdir(out.parent)) == ["r.csv"]


# ---- code_shape.py -------------------------------------------------------------------------------

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
    _usage_error(capsys, code_shape.main, [str(ck / "last.pt"), "--data", str(data),
                                           "--retrieval", "11"], "--retrieval", "10 test images")
    assert capsys.readouterr().out == ""


# ---- export_images.py ----------------------------------------------------------------------------

def test_export_images_empty_out_and_a_class_folder_taken_by_a_file(tmp_path, capsys):
    """--out '' wrote the export, then failed renaming it (traceback); --overwrite where a class's
    folder is a file of the user's deleted the old export's files, then failed half-way."""
    _usage_error(capsys, export_images.main, ["--out", "", "--per-class", "1"], "--out")
    out = tmp_path / "ex"
    assert export_images.main(["--out", str(out), "--per-class", "1"]) == 0
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    for p in (out / "trouser").iterdir():
        p.unlink()
    (out / "trouser").rmdir()
    (out / "trouser").write_text("mine")
    _usage_error(capsys, export_images.main, ["--out", str(out), "--per-class", "2",
                                              "--overwrite"], "--out", "trouser")
    after = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert after == [p for p in before if not p.startswith("trouser/")]
    assert (out / "trouser").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex"]  # no temporary folder left


# ---- bench/data_throughput.py --------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--device", "bogus"], "--device"),
    (["--loader", "dali-gpu", "--device", "cpu"], "--loader dali-gpu"),
    (["--workers", "-1"], "--workers"), (["--warmup", "-1"], "--warmup"),
    (["--size", "0"], "--size"), (["--make-jpegs", "-8"], "--make-jpegs")],
    ids=["bad-device", "dali-gpu-on-cpu", "workers", "warmup", "size", "make-jpegs"])
def test_data_throughput_bad_options_are_usage_errors(tmp_path, capsys, monkeypatch, argv, flag):
    monkeypatch.setattr(data_throughput, "build_pretrain_loader", _boom)
    monkeypatch.setattr(data_throughput, "write_jpeg_folder", _boom)
    _usage_error(capsys, data_throughput.main, ["--data", str(tmp_path / "none"), "--batches",
                                                "1"] + argv, flag)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_data_throughput_cuda_without_a_gpu_and_bad_data(tmp_path, capsys, monkeypatch):
    """--device cuda on a CPU machine, a missing --data and --make-jpegs into a file gave
    tracebacks (RuntimeError, FileNotFoundError, NotADirectoryError)."""
    _usage_error(capsys, data_throughput.main, ["--data", str(tmp_path), "--device", "cuda"],
                 "--device", "no CUDA device")
    _usage_error(capsys, data_throughput.main, ["--data", str(tmp_path / "none"), "--device",
                                                "cpu"], "none")
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(data_throughput, "write_jpeg_folder", _boom)
    _usage_error(capsys, data_throughput.main, ["--data", str(tmp_path / "afile"), "--device",
                                                "cpu", "--make-jpegs", "8"], "--make-jpegs")


# ---- bench/train_throughput.py -------------------------------------------------------------------

TT = ["--data", "synthetic:64", "--image-size", "8", "--batch-size", "16", "--steps", "1",
      "--warmup", "1", "--no-anchors", "--no-eager-baseline"]


@pytest.mark.parametrize("which", ["csv-under-file", "csv-damaged", "json-folder",
                                   "profile-under-file", "budget-nan", "amp"])
def test_train_throughput_outputs_and_options_checked_before_the_run(tmp_path, capsys,
                                                                     monkeypatch, which):
    """Bad --csv-out / --json-out / --profile-out paths gave tracebacks after the whole
    measurement, a damaged --csv-out was appended to; --budget-s nan skipped every later part;
    --amp took any word (a KeyError in --supervised)."""
    monkeypatch.setattr(train_throughput, "measure", _boom)
    monkeypatch.setattr(train_throughput, "supervised_measure", _boom)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dmg.csv").write_text("a,b\n1,2,3,4\n")
    argv, flag = {
        "csv-under-file": (["--csv-out", str(tmp_path / "afile" / "t.csv")], "--csv-out"),
        "csv-damaged": (["--csv-out", str(tmp_path / "dmg.csv")], "--csv-out"),
        "json-folder": (["--json-out", str(tmp_path)], "--json-out"),
        "profile-under-file": (["--profile-out", str(tmp_path / "afile" / "p.txt")],
                               "--profile-out"),
        "budget-nan": (["--budget-s", "nan"], "--budget-s"),
        "amp": (["--supervised", "eager", "--amp", "bogus"], "--amp")}[which]
    _usage_error(capsys, train_throughput.main, TT + argv, flag)
    assert (tmp_path / "dmg.csv").read_text() == "a,b\n1,2,3,4\n"


def test_train_throughput_csv_rows_stay_aligned_and_json_lands_in_a_new_folder(
        tmp_path, capsys, monkeypatch):
    """--csv-out was appended with its own writer: rows under another header got misaligned;
    --json-out in a missing folder failed after the measurement."""
    path = tmp_path / "t.csv"
    path.write_text("a,b,c\n1,2,3\n")
    row = {k: None for k in train_throughput.CSV_FIELDS}
    row.update(config="nac-defaults", img_per_s=10.0, status="ok")
    train_throughput.append_csv(str(path), [row])
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == train_throughput.CSV_FIELDS + ["a", "b", "c"]
    assert {len(x) for x in lines} == {len(lines[0])}
    rows = list(csv.DictReader(open(path, newline="")))
    assert (rows[0]["a"], rows[1]["config"], rows[1]["img_per_s"]) == ("1", "nac-defaults", "10.0")
    monkeypatch.setattr(train_throughput, "supervised_measure", lambda args, kind: {"k": kind})
    out = tmp_path / "new" / "t.json"
    train_throughput.main(TT + ["--supervised", "eager", "--json-out", str(out)])
    assert json.loads(out.read_text()) == {"k": "eager"}


def test_data_throughput_appends_a_csv_row_with_its_spread(tmp_path, capsys):
    """The data benchmark printed its JSON line only: no CSV row, no spread.  --csv appends one
    row per run (the JSON's figures, the commit, median / p20 / p80 of the batch times), under
    the same header; a damaged CSV is refused before the data is read."""
    data, path = str(tmp_path / "jpegs"), str(tmp_path / "d" / "data.csv")
    argv = ["--data", data, "--size", "16", "--batch", "4", "--batches", "3", "--workers", "0",
            "--loader", "torchvision", "--csv", path]
    data_throughput.main(argv + ["--make-jpegs", "16"])
    data_throughput.main(argv)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and list(rows[0]) == data_throughput.CSV_FIELDS
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for r in rows:
        p20, med, p80 = (float(r[k]) for k in ("p20_batch_s", "median_batch_s", "p80_batch_s"))
        assert 0 < p20 <= med <= p80
        assert r["num_images"] == "16" and r["view_shape"] == "4x3x16x16" and r["commit"]
    assert float(rows[1]["images_per_s"]) == last["images_per_s"]
    with open(path, "a") as f:
        f.write("1,2,3," * 20 + "\n")   # a row wider than the header
    _usage_error(capsys, data_throughput.main, argv, "--csv")


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
    err = _usage_error(capsys, nac_loss_floor.main, ["--images", "10000"], "--images 10000",
                       "GiB")
    most = int(err.split("at most --images ")[1].split(")")[0])
    assert nac_loss_floor.MATRICES * 8 * (2 * most) ** 2 <= 2**30 < \
        nac_loss_floor.MATRICES * 8 * (2 * (most + 1)) ** 2


def test_make_image_folder_size_has_an_upper_bound(tmp_path, capsys):
    """--size had no upper bound: --size 100000 would draw 30 GB images."""
    import make_image_folder
    _usage_error(capsys, make_image_folder.main, ["shapes", str(tmp_path / "f"), "--size",
                                                  "100000"], "--size", "[8, 4096]")
    assert not (tmp_path / "f").exists()


def test_train_throughput_does_not_replace_its_outputs_without_overwrite(tmp_path, capsys,
                                                                          monkeypatch):
    """--json-out and --profile-out replaced an existing file without being asked."""
    monkeypatch.setattr(train_throughput, "supervised_measure", lambda args, kind: {"k": kind})
    for flag in ("--json-out", "--profile-out"):
        old = tmp_path / f"old{flag}.txt"
        old.write_text("mine")
        _usage_error(capsys, train_throughput.main, TT + ["--supervised", "eager", flag,
                                                         str(old)], flag, "--overwrite")
        assert old.read_text() == "mine"
    out = tmp_path / "old--json-out.txt"
    train_throughput.main(TT + ["--supervised", "eager", "--json-out", str(out), "--overwrite"])
    assert json.loads(out.read_text()) == {"k": "eager"}
