"""Audit of the bench scripts run as a demanding user would (bench/): damaged and older CSVs
appended to all or nothing, cpu_memory.py's rows under an older header, plot_bench.py on mixed
devices, D values, NaN timings and missing columns, gpu_summary.py on NaN timings, a bad
train.json and bad output paths, bench_loss.py's ratios and argument checks, GPU-only options of
host_overhead.py without --gpu, argument and output checks of split_emulation.py,
launch_traffic.py and fp16_keys_grad.py.  Tiny shapes only, nothing timed for real."""
import csv
import importlib.util
import json
import os
import sys

import pytest

import nac_fast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_csv  # noqa: E402
import bench_loss  # noqa: E402
import gpu_summary  # noqa: E402
import host_overhead  # noqa: E402
import launch_traffic  # noqa: E402
import split_emulation  # noqa: E402

LOSS = ["--device", "cpu", "--inbatch", "8", "--queue", "", "--D", "8", "--min-time", "0",
        "--dtypes", "float32", "--backends", "reference", "--no-memory", "--reps", "1"]
HAS_CPU = "cpu" in nac_fast.available_backends("cpu")


def _usage_error(fn, argv, capsys, *words):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
    return err


def _boom(*a, **k):
    raise AssertionError("measured before the arguments were checked")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the shared appender: all or nothing, never glued onto a cut line ---------------------------

def test_append_after_an_unterminated_last_line_starts_a_new_line(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("a,b,c\n1,2,3\n4,5")  # the last line was cut (or saved without a newline)
    bench_csv.append_rows(str(path), [{"a": 7, "b": 8, "c": 9}], ["a", "b", "c"])
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["a", "b", "c"], ["1", "2", "3"], ["4", "5"], ["7", "8", "9"]]


@pytest.mark.parametrize("text", [b"a,b\n1,2,3\n", b"\xff\xfe\x00a,b\n1,2\n", b"\n1,2\n"],
                         ids=["wide-row", "not-utf8", "no-header"])
def test_a_damaged_csv_is_refused_and_left_as_it_was(tmp_path, text):
    path = tmp_path / "c.csv"
    path.write_bytes(text)
    with pytest.raises(ValueError) as e:
        bench_csv.append_rows(str(path), [{"a": 7, "b": 8, "c": 9}], ["a", "b", "c"])
    assert str(path) in str(e.value)
    assert path.read_bytes() == text
    assert os.listdir(tmp_path) == ["c.csv"]  # no temporary file left


def test_a_row_with_an_unknown_column_writes_nothing(tmp_path):
    path = tmp_path / "c.csv"
    with pytest.raises(ValueError):
        bench_csv.append_rows(str(path), [{"a": 1}, {"zz": 2}], ["a", "b"])
    assert not path.exists()
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError):
        bench_csv.append_rows(str(path), [{"a": 3}, {"zz": 2}], ["a", "b"])
    assert path.read_text() == "a,b\n1,2\n"


def test_bench_loss_refuses_a_damaged_csv_before_timing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_loss, "time_step", _boom)
    path = tmp_path / "l.csv"
    path.write_text("a,b\n1,2,3\n")
    _usage_error(bench_loss.main, LOSS + ["--csv", str(path)], capsys, "--csv")
    assert path.read_text() == "a,b\n1,2,3\n"


# ---- cpu_memory.py: the shared appender and an early --csv check --------------------------------

def _fake_measure(backends, n, D, dtype, threads, runs, warmup_n=None):
    return {b: [{"baseline": 100 << 20, "extra": (i + 1) << 20, "input_checks": True}
                for i in range(runs)] for b in backends}


def test_cpu_memory_appends_under_an_older_header(tmp_path, monkeypatch):
    mod = _load("cpu_memory")
    monkeypatch.setattr(mod, "measure", _fake_measure)
    path = tmp_path / "m.csv"
    path.write_text("timestamp,host,backend,extra_rss_mib\n2020,old,cpu,1.0\n")
    mod.main(["--n", "4", "--D", "4", "--runs", "1", "--backends", "reference",
              "--csv", str(path)])
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == mod.FIELDS
    assert {len(x) for x in lines} == {len(mod.FIELDS)}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert (rows[0]["host"], rows[0]["backend"], rows[0]["extra_rss_mib"]) == ("old", "cpu", "1.0")
    assert rows[1]["backend"] == "reference" and rows[1]["n"] == "4"


def test_cpu_memory_bad_csv_is_a_usage_error_before_measuring(tmp_path, capsys, monkeypatch):
    mod = _load("cpu_memory")
    monkeypatch.setattr(mod, "measure", _boom)
    (tmp_path / "afile").write_text("x")
    _usage_error(mod.main, ["--n", "4", "--D", "4", "--runs", "1", "--backends", "reference",
                            "--csv", str(tmp_path / "afile" / "m.csv")], capsys, "--csv")


# ---- plot_bench.py --------------------------------------------------------------------------------

def _loss_csv(path, rows):
    bench_loss.append_rows(str(path), [dict(dict.fromkeys(bench_loss.FIELDS, ""), **r)
                                       for r in rows])
    return str(path)


def _row(device="cpu A", backend="reference", N=8, D=8, med="0.001", **kw):
    return dict(dict(device=device, backend=backend, kind="inbatch", dtype="float32", n=N, N=N,
                     D=D, median_s=med, p20_s=med, p80_s=med, peak_extra_mib="1.0",
                     torch="2", status="ok"), **kw)


@pytest.fixture
def plotted(monkeypatch):
    """main()'s lines: [(label, xs)] of every Axes.plot call."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    calls, orig = [], Axes.plot

    def plot(self, xs, ys, *a, **k):
        calls.append((k.get("label"), list(xs)))
        return orig(self, xs, ys, *a, **k)
    monkeypatch.setattr(Axes, "plot", plot)
    return calls


def test_plot_bench_keeps_devices_and_D_apart(tmp_path, plotted):
    import plot_bench
    src = _loss_csv(tmp_path / "l.csv", [
        _row(device="cpu A", N=8), _row(device="cpu A", N=16), _row(device="cpu B", N=8),
        _row(device="cpu B", N=16), _row(device="cpu A", N=8, D=16)])
    assert len(plot_bench.load(src)) == 5  # a D = 16 run does not replace the D = 8 one
    plot_bench.main([src, "--out", str(tmp_path / "png")])
    time_lines = plotted[:len(plotted) // 2]
    assert len(time_lines) == 3
    for label, xs in time_lines:
        assert len(xs) == len(set(xs)), (label, xs)  # one point per size in a line
    labels = {label for label, _ in time_lines}
    assert len(labels) == 3 and any("cpu B" in x for x in labels) and any("16" in x for x in labels)


@pytest.mark.parametrize("bad", ["nan", "inf", "0", "abc"])
def test_plot_bench_skips_rows_without_a_finite_time(tmp_path, bad):
    import plot_bench
    src = _loss_csv(tmp_path / "l.csv", [_row(med="0.002"), _row(med=bad)])
    (row,) = plot_bench.load(src)
    assert row["median_s"] == "0.002"


@pytest.mark.parametrize("col", ["p20_s", "device", "N"])
def test_plot_bench_names_a_missing_column(tmp_path, col):
    import plot_bench
    path = tmp_path / "l.csv"
    fields = [c for c in bench_loss.FIELDS if c != col]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerow(_row())
    with pytest.raises(SystemExit) as e:
        plot_bench.main([str(path), "--out", str(tmp_path / "png")])
    assert col in str(e.value)


# ---- gpu_summary.py -------------------------------------------------------------------------------

def _no_nan(text):
    def refuse(x):
        raise ValueError(f"not JSON: {x}")
    return json.loads(text, parse_constant=refuse)


def test_gpu_summary_leaves_out_a_nan_time(tmp_path):
    res = tmp_path / "res"
    res.mkdir()
    _loss_csv(res / "loss_gpu.csv", [_row(device="GPU X"), _row(device="GPU X", backend="triton",
                                                              med="nan")])
    out = tmp_path / "s.json"
    assert gpu_summary.main([str(res), "--out", str(out)]) == 0
    summary = _no_nan(out.read_text())
    assert summary["loss"] == []


@pytest.mark.parametrize("text", ["", '{"arch": "r", "method": "m", "batch_size": 8, '
                                  '"img_per_s": 1, "data_wait": 0, "world_size": 0}'],
                         ids=["empty", "world-0"])
def test_gpu_summary_bad_train_json_is_an_input_error(tmp_path, capsys, text):
    res = tmp_path / "res"
    res.mkdir()
    (res / "train.json").write_text(text)
    assert gpu_summary.main([str(res), "--out", str(tmp_path / "s.json")]) == 2
    assert "train.json" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_gpu_summary_output_paths(tmp_path, capsys):
    res = tmp_path / "res"
    res.mkdir()
    _loss_csv(res / "loss_gpu.csv", [_row(device="GPU X")])
    (tmp_path / "afile").write_text("x")
    for flag in ("--out", "--markdown", "--status-file"):
        argv = [str(res), "--out", str(tmp_path / "s.json"), flag, str(tmp_path / "afile" / "x")]
        _usage_error(gpu_summary.main, argv, capsys, flag)
    assert not (tmp_path / "s.json").exists()
    out = tmp_path / "new" / "dir" / "s.json"  # a folder still missing is made
    assert gpu_summary.main([str(res), "--out", str(out), "--markdown",
                             str(tmp_path / "new2" / "s.md")]) == 0
    assert _no_nan(out.read_text())["gpu"] == "GPU X"
    assert (tmp_path / "new2" / "s.md").exists()


# ---- bench_loss.py --------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_CPU, reason="needs nac_fast._C")
def test_bench_loss_ratios_when_reference_is_not_listed_first(tmp_path):
    path = str(tmp_path / "l.csv")
    argv = [a if a != "reference" else "cpu,reference" for a in LOSS]
    assert bench_loss.main(argv + ["--csv", path]) == 0
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["backend"] for r in rows] == ["reference", "cpu"]
    assert rows[1]["time_ratio_to_ref"] != ""


@pytest.mark.parametrize("argv,flag", [
    (["--inbatch", "", "--queue", ""], "--inbatch"),
    (["--inbatch", ",", "--queue", ""], "--inbatch"),
    (["--dtypes", "int32"], "--dtypes"),
    (["--dtypes", "bool"], "--dtypes"),
    (["--dtypes", "float32,float32"], "--dtypes"),
    (["--backends", "reference,reference"], "--backends"),
    (["--inbatch", "8,8"], "--inbatch"),
], ids=["no-cases", "only-commas", "int", "bool", "dup-dtype", "dup-backend", "dup-size"])
def test_bench_loss_bad_lists_are_usage_errors(tmp_path, capsys, monkeypatch, argv, flag):
    monkeypatch.setattr(bench_loss, "time_step", _boom)
    path = tmp_path / "l.csv"
    _usage_error(bench_loss.main, LOSS + argv + ["--csv", str(path)], capsys, flag)
    assert not path.exists()


# ---- host_overhead.py: the --gpu options without --gpu --------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--cases", "inbatch:8:8:float32"], "--cases"), (["--backends", "triton"], "--backends"),
    (["--no-graphs"], "--no-graphs"), (["--profile-out", "p.txt"], "--profile-out"),
    (["--compile-backend", "aot_eager"], "--compile-backend")])
def test_host_overhead_gpu_options_need_gpu(capsys, monkeypatch, argv, flag):
    monkeypatch.setattr(host_overhead, "stub_rows", _boom)
    _usage_error(host_overhead.main, ["--calls", "1", "--repeats", "1"] + argv, capsys, flag,
                 "--gpu")


# ---- split_emulation.py, launch_traffic.py, fp16_keys_grad.py -----------------------------------

def test_split_emulation_bad_csv_is_a_usage_error_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(split_emulation, "measure", _boom)
    (tmp_path / "afile").write_text("x")
    _usage_error(split_emulation.main, ["--n", "1", "--N", "3", "--D", "8", "--p", "0.1",
                                        "--csv", str(tmp_path / "afile" / "s.csv")], capsys,
                 "--csv")


@pytest.mark.parametrize("argv,flag", [(["--n", "0"], "--n"), (["--queue", "-1"], "--queue"),
                                       (["--D", "0"], "--D"), (["--dtype", "int32"], "--dtype")])
def test_launch_traffic_bad_args_are_usage_errors(capsys, monkeypatch, argv, flag):
    monkeypatch.setattr(launch_traffic, "measure", _boom)
    _usage_error(launch_traffic.main, argv, capsys, flag)


@pytest.mark.parametrize("argv,flag", [(["--n", ""], "--n"), (["--n", "4,x"], "--n"),
                                       (["--n", "0"], "--n"), (["--D", "0"], "--D"),
                                       (["--reductions", "none"], "--reductions"),
                                       (["--interp-blocks", "128"], "--interp-blocks")])
def test_fp16_keys_grad_bad_args_are_usage_errors(capsys, argv, flag):
    mod = _load("fp16_keys_grad")
    _usage_error(mod.main, ["--no-triton", "--no-emulation"] + argv, capsys, flag)


# ---- bench_hamming: the --gpu run's options without --gpu ----------------------------------------

@pytest.mark.parametrize("extra", [["--tiny"], ["--k", "5"], ["--device", "cpu"],
                                   ["--only", "map"], ["--map-sizes", "100"]])
def test_bench_hamming_gpu_options_need_gpu(capsys, monkeypatch, extra):
    """Bug: --tiny, --k, --device, ... belong to the --gpu run; without --gpu they were silently
    ignored and the CPU table was measured at its own sizes."""
    import bench_hamming
    monkeypatch.setattr(bench_hamming, "make_data", _boom)
    _usage_error(bench_hamming.main, ["--queries", "5", "--gallery", "200", "--bits", "64",
                                      "--csv", ""] + extra, capsys, extra[0], "--gpu")


def test_cpu_memory_refuses_a_backend_named_twice(capsys, monkeypatch):
    """Bug: --backends cpu,cpu measured cpu twice (twice the minutes) and wrote its rows twice."""
    mod = _load("cpu_memory")
    monkeypatch.setattr(mod, "measure", _boom)
    _usage_error(mod.main, ["--n", "4", "--D", "4", "--runs", "1", "--backends", "cpu,cpu",
                            "--csv", ""], capsys, "--backends", "twice")


def test_an_empty_output_path_is_a_problem():
    """output_file_problem('') passed ('' is no folder, and check_writable took it as the
    current folder's), so a script that checked it crashed after its measurement."""
    assert "--csv is empty" in bench_csv.output_file_problem("--csv", "")
    assert bench_csv.output_file_problem("--csv", "x.csv") is None
