"""The bench scripts' arguments and CSVs (audit of bench/, bugs 2-8): rows appended to a CSV with
another header stay aligned (one shared appender, bench/bench_csv.py), p20/p80 of few samples lie
around the median, count flags below 1 and bad output paths are usage errors (exit status 2)
before any measurement, roofline's unknown --gpu is a usage error before any table line.
Tiny shapes only."""
import csv
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_csv  # noqa: E402
import bench_hamming  # noqa: E402
import bench_index  # noqa: E402
import bench_loss  # noqa: E402
import host_overhead  # noqa: E402
import plot_bench  # noqa: E402
import precision_table  # noqa: E402
import roofline  # noqa: E402

HAMMING = ["--queries", "5", "--gallery", "200", "--bits", "64", "--repeats", "1",
           "--torch-queries", "0", "--faiss-heap-queries", "0", "--no-faiss", "--chunk", "5"]
INDEX = ["--gallery", "300", "--queries", "5", "--k", "3", "--map-queries", "10", "--bits", "64",
         "--repeats", "1", "--map-repeats", "1", "--no-faiss"]
LOSS = ["--device", "cpu", "--inbatch", "8", "--queue", "", "--D", "8", "--min-time", "0",
        "--dtypes", "float32", "--backends", "reference", "--no-memory"]
PRECISION = ["--n", "8", "--N", "16", "--D", "8", "--dtypes", "float32", "--fp32-modes", "tf32x3"]


def _usage_error(fn, argv, capsys, *words):
    """fn(argv) exits with status 2 and a message naming each of `words`."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
    return err


def _foreign_csv(path):
    path.write_text("a,b,c\n1,2,3\n")
    return str(path)


def _aligned(path, fields):
    """Every line has as many values as the header, which is `fields` plus the old columns, and
    the old row keeps its values."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == list(fields) + ["a", "b", "c"]
    assert {len(x) for x in lines} == {len(lines[0])}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert (rows[0]["a"], rows[0]["b"], rows[0]["c"]) == ("1", "2", "3")
    return rows[1:]


@pytest.fixture
def no_timing(monkeypatch):
    """bench_loss's timing raises: a check that passes only when it comes before any timing."""
    def boom(*a, **k):
        raise AssertionError("timed before the arguments were checked")
    monkeypatch.setattr(bench_loss, "time_step", boom)


# ---- bug 2: rows under a foreign or old header --------------------------------------------------

def test_bench_index_appends_under_another_header(tmp_path):
    path = _foreign_csv(tmp_path / "o.csv")
    bench_index.main(INDEX + ["--csv", path])
    rows = _aligned(path, bench_index.CSV_FIELDS)
    assert [r["method"] for r in rows] == ["HashIndex.search", "nac_fast mAP@all"]


def test_bench_hamming_appends_under_another_header(tmp_path):
    path = _foreign_csv(tmp_path / "o.csv")
    bench_hamming.main(HAMMING + ["--csv", path])
    rows = _aligned(path, bench_hamming.CSV_FIELDS)
    assert rows[0]["method"] == "nac_fast cpu mAP@all" and rows[0]["gallery"] == "200"


def test_precision_table_appends_under_another_header(tmp_path):
    path = _foreign_csv(tmp_path / "o.csv")
    precision_table.main(PRECISION + ["--csv", path])
    rows = _aligned(path, ["timestamp", "torch", "kind", "n", "N", "D", "dtype", "method",
                           "loss", "grad_a", "grad_r", "grad_keys"])
    assert {r["kind"] for r in rows} == {"inbatch", "keys"} and rows[0]["dtype"] == "float32"


def test_one_appender_for_every_bench_script(tmp_path):
    """bench_loss.append_rows (imported by host_overhead, split_emulation, tests) is the shared
    one with bench_loss's FIELDS by default."""
    path = _foreign_csv(tmp_path / "o.csv")
    bench_loss.append_rows(path, [{"kind": "mq"}])
    assert _aligned(path, bench_loss.FIELDS)[0]["kind"] == "mq"
    for mod in (bench_hamming, bench_index, precision_table):
        assert mod.append_rows is bench_csv.append_rows


# ---- bug 3: p20/p80 of fewer than 5 samples -----------------------------------------------------

@pytest.mark.parametrize("times", [[3.0], [2.0, 1.0], [1.0, 2.0, 4.0], [4.0, 1.0, 2.0, 8.0]])
def test_quantiles_of_few_samples_lie_around_the_median(times):
    med, p20, p80 = bench_loss._quantiles(times)
    assert min(times) <= p20 <= med <= p80 <= max(times)
    if len(times) > 1:
        assert p20 < med < p80


def test_quantiles_of_five_or_more_samples_are_as_before():
    import statistics
    times = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0]
    q = statistics.quantiles(times, n=5)
    assert bench_loss._quantiles(times) == (statistics.median(times), q[0], q[3])


def test_bench_loss_p80_of_three_reps_is_not_below_the_median(tmp_path):
    path = str(tmp_path / "l.csv")
    assert bench_loss.main(LOSS + ["--reps", "3", "--csv", path]) == 0
    with open(path, newline="") as f:
        (row,) = csv.DictReader(f)
    assert row["reps"] == "3"
    assert float(row["p20_s"]) <= float(row["median_s"]) <= float(row["p80_s"])


# ---- bug 4: --reps 0 and like count flags -------------------------------------------------------

@pytest.mark.parametrize("flag,val", [("--reps", "0"), ("--reps", "-2"), ("--D", "0"),
                                      ("--mq-n", "0"), ("--inbatch", "0"), ("--min-time", "-1")])
def test_bench_loss_counts_below_one_are_usage_errors(tmp_path, capsys, no_timing, flag, val):
    path = tmp_path / "l.csv"
    _usage_error(bench_loss.main, LOSS + ["--reps", "2", flag, val, "--csv", str(path)], capsys,
                 flag)
    assert not path.exists()


# ---- bugs 5 and 6: output paths checked before any measurement ----------------------------------

def _bad_paths(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir(exist_ok=True)
    return [str(tmp_path / "adir"), str(tmp_path / "afile" / "x.csv"), "/proc/no/such/x.csv"]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["folder", "under-a-file", "unwritable"])
def test_bench_loss_bad_csv_is_a_usage_error_before_timing(tmp_path, capsys, no_timing, which):
    _usage_error(bench_loss.main, LOSS + ["--reps", "2", "--csv", _bad_paths(tmp_path)[which]],
                 capsys, "--csv")


@pytest.mark.parametrize("which", [0, 1, 2], ids=["folder", "under-a-file", "unwritable"])
def test_host_overhead_bad_csv_is_a_usage_error(tmp_path, capsys, which):
    _usage_error(host_overhead.main, ["--calls", "1", "--repeats", "1", "--csv",
                                      _bad_paths(tmp_path)[which]], capsys, "--csv")


@pytest.mark.parametrize("which", [0, 1, 2], ids=["folder", "under-a-file", "unwritable"])
@pytest.mark.parametrize("script", ["hamming", "index", "precision"])
def test_other_bench_scripts_bad_csv_is_a_usage_error(tmp_path, capsys, monkeypatch, script,
                                                       which):
    def boom(*a, **k):
        raise AssertionError("measured before the arguments were checked")
    fn, argv = {"hamming": (bench_hamming.main, HAMMING), "index": (bench_index.main, INDEX),
                "precision": (precision_table.main, PRECISION)}[script]
    monkeypatch.setattr(bench_hamming, "make_data", boom)
    monkeypatch.setattr(bench_index, "make_data", boom)
    monkeypatch.setattr(precision_table, "measure", boom)
    _usage_error(fn, argv + ["--csv", _bad_paths(tmp_path)[which]], capsys, "--csv")


def test_bench_loss_bare_csv_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench_loss.main(LOSS + ["--reps", "1", "--csv", "bare.csv"]) == 0
    assert (tmp_path / "bare.csv").read_text().startswith("timestamp,")


def test_precision_table_bare_csv_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    precision_table.main(PRECISION + ["--csv", "p.csv"])
    with open(tmp_path / "p.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 6


def test_plot_bench_missing_csv_and_bad_out_are_usage_errors(tmp_path, capsys):
    _usage_error(plot_bench.main, [str(tmp_path / "nonexist.csv")], capsys, "nonexist.csv")
    src = tmp_path / "l.csv"
    bench_loss.append_rows(str(src), [dict.fromkeys(bench_loss.FIELDS, "1")])
    (tmp_path / "afile").write_text("x")
    _usage_error(plot_bench.main, [str(src), "--out", str(tmp_path / "afile")], capsys, "--out")
    _usage_error(plot_bench.main, [str(src), "--out", str(tmp_path / "afile" / "sub")], capsys,
                 "--out")
    _usage_error(plot_bench.main, [str(tmp_path), "--out", str(tmp_path)], capsys, "folder")


# ---- bug 7: numeric flags of bench_hamming and bench_index --------------------------------------

@pytest.mark.parametrize("flag,val", [("--chunk", "0"), ("--repeats", "0"), ("--threads", "0"),
                                      ("--classes", "0"), ("--flip", "2"), ("--flip", "-0.1"),
                                      ("--slow-repeats", "0"), ("--queries", "0")])
def test_bench_hamming_flags_are_checked(capsys, flag, val):
    _usage_error(bench_hamming.main, HAMMING + ["--csv", "", flag, val], capsys, flag)


@pytest.mark.parametrize("flag,val", [("--repeats", "0"), ("--threads", "0"), ("--k", "0"),
                                      ("--map-repeats", "0"), ("--flip", "0.7"),
                                      ("--gallery", "0")])
def test_bench_index_flags_are_checked(capsys, flag, val):
    _usage_error(bench_index.main, INDEX + ["--csv", "", flag, val], capsys, flag)


def test_bench_hamming_flip_bounds_are_valid(tmp_path):
    for flip in ("0", "0.5"):
        bench_hamming.main(HAMMING + ["--csv", "", "--flip", flip, "--no-rank"])


# ---- bug 8: roofline's unknown --gpu, --D 0 ------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [(["--gpu", "A100"], "--gpu"), (["--gpu", "H100,"], "--gpu"),
                                       (["--D", "0"], "--D")])
def test_roofline_bad_args_are_usage_errors_before_the_table(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        roofline.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and flag in err and out == ""
    if flag == "--gpu":
        assert "H100" in err and "H200" in err


def test_roofline_known_names_still_work(capsys):
    roofline.main(["--gpu", "NVIDIA H200,H100", "--D", "64"])
    out = capsys.readouterr().out
    assert out.startswith("gpu ") and "H200 SXM 141GB" in out
