"""The bench scripts: one smoke test per script kept (tiny sizes, nothing timed for real), and
the shared helper module's own correctness (bench/common.py: the CSV appender refuses a damaged
CSV and leaves it as it was, rows under another header stay aligned, quantiles of few samples).
The host path of the fused loss that bench/host_overhead.py measures is tested in
tests/test_loss_host.py."""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

import nac_fast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_loss  # noqa: E402
import common  # noqa: E402
import gpu_summary  # noqa: E402

LOSS = ["--device", "cpu", "--inbatch", "8", "--queue", "", "--D", "8", "--min-time", "0",
        "--dtypes", "float32", "--backends", "reference", "--no-memory", "--reps", "1"]


def _loss_csv(path, rows):
    common.append_rows(str(path), [dict(dict.fromkeys(bench_loss.FIELDS, ""), **r)
                                   for r in rows], bench_loss.FIELDS)
    return str(path)


def _row(device="cpu A", backend="reference", N=8, D=8, med="0.001", **kw):
    return dict(dict(device=device, backend=backend, kind="inbatch", dtype="float32", n=N, N=N,
                     D=D, median_s=med, p20_s=med, p80_s=med, peak_extra_mib="1.0",
                     torch="2", status="ok"), **kw)


# ---- bench/common.py: the shared appender, all or nothing, never glued onto a cut line ----------

def test_append_after_an_unterminated_last_line_starts_a_new_line(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("a,b,c\n1,2,3\n4,5")  # the last line was cut (or saved without a newline)
    common.append_rows(str(path), [{"a": 7, "b": 8, "c": 9}], ["a", "b", "c"])
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["a", "b", "c"], ["1", "2", "3"], ["4", "5"], ["7", "8", "9"]]


@pytest.mark.parametrize("text", [b"a,b\n1,2,3\n", b"\xff\xfe\x00a,b\n1,2\n", b"\n1,2\n"],
                         ids=["wide-row", "not-utf8", "no-header"])
def test_a_damaged_csv_is_refused_and_left_as_it_was(tmp_path, text):
    path = tmp_path / "c.csv"
    path.write_bytes(text)
    with pytest.raises(ValueError) as e:
        common.append_rows(str(path), [{"a": 7, "b": 8, "c": 9}], ["a", "b", "c"])
    assert str(path) in str(e.value)
    assert path.read_bytes() == text
    assert os.listdir(tmp_path) == ["c.csv"]  # no temporary file left


def test_a_row_with_an_unknown_column_writes_nothing(tmp_path):
    path = tmp_path / "c.csv"
    with pytest.raises(ValueError):
        common.append_rows(str(path), [{"a": 1}, {"zz": 2}], ["a", "b"])
    assert not path.exists()
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError):
        common.append_rows(str(path), [{"a": 3}, {"zz": 2}], ["a", "b"])
    assert path.read_text() == "a,b\n1,2\n"


def test_one_appender_for_every_bench_script(tmp_path):
    """Rows appended under another (older) header: the file is rewritten with the new fields
    plus its own extra columns, every line as wide as the header, the old row's values kept
    (common.append_rows with bench_loss's FIELDS, as bench_loss.py calls it)."""
    path = tmp_path / "o.csv"
    path.write_text("a,b,c\n1,2,3\n")
    common.append_rows(str(path), [{"kind": "mq"}], bench_loss.FIELDS)
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == bench_loss.FIELDS + ["a", "b", "c"]
    assert {len(x) for x in lines} == {len(lines[0])}
    with open(path, newline="") as f:
        old, new = csv.DictReader(f)
    assert (old["a"], old["b"], old["c"]) == ("1", "2", "3") and new["kind"] == "mq"


def test_an_empty_output_path_is_a_usage_error(capsys):
    ap = argparse.ArgumentParser()
    with pytest.raises(SystemExit) as e:
        common.check_output_file(ap, "--csv", "")
    assert e.value.code == 2 and "--csv is empty" in capsys.readouterr().err
    common.check_output_file(ap, "--csv", "x.csv")


@pytest.mark.parametrize("times", [[3.0], [2.0, 1.0], [1.0, 2.0, 4.0], [4.0, 1.0, 2.0, 8.0]])
def test_quantiles_of_few_samples_lie_around_the_median(times):
    med, p20, p80 = common.quantiles(times)
    assert min(times) <= p20 <= med <= p80 <= max(times)
    if len(times) > 1:
        assert p20 < med < p80


def test_quantiles_of_five_or_more_samples_are_as_before():
    times = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0]
    q = statistics.quantiles(times, n=5)
    assert common.quantiles(times) == (statistics.median(times), q[0], q[3])


# ---- bench/bench_loss.py ------------------------------------------------------------------------

def test_bench_loss_smoke(tmp_path, capsys):
    """A CPU run appends one row per (case, backend) under FIELDS with p20 <= median <= p80 and the
    ratios to the reference; a bad flag is a usage error before any timing; the step of each
    kind runs (what bench/test_bench_loss.py, the removed pytest-benchmark suite, timed)."""
    backends = "reference,cpu" if "cpu" in nac_fast.available_backends("cpu") else "reference"
    path = str(tmp_path / "r" / "l.csv")
    argv = LOSS[:-5] + ["--backends", backends, "--no-memory", "--reps", "3", "--csv", path]
    assert bench_loss.main(argv) == 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == bench_loss.FIELDS and len(rows) == len(backends.split(","))
    for row in rows:
        assert row["status"] == "ok" and row["reps"] == "3" and row["timer"] == "perf_counter"
        assert float(row["p20_s"]) <= float(row["median_s"]) <= float(row["p80_s"])
        assert float(row["time_ratio_to_ref"]) > 0 and row["commit"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bench_loss.main(LOSS + ["--reps", "0", "--csv", path])
    assert e.value.code == 2 and "--reps" in capsys.readouterr().err
    for kind, n, N in (("inbatch", 8, 8), ("mq", 4, 16), ("inbatch-self", 8, 8)):
        step = bench_loss.make_step(kind, n, N, 8, torch.float32, "cpu", "reference")
        step()


def test_bench_loss_times_the_own_key_left_out(tmp_path, capsys, monkeypatch):
    """--inbatch-self: rows of kind inbatch-self, whose step is nac_loss with self_key="exclude"
    (docs/math.md [M:self-key]) on the row's backend, its ratios to the reference of the same
    kind; a size below 2 (one key, none left) is a usage error naming the flag."""
    backends = "reference,cpu" if "cpu" in nac_fast.available_backends("cpu") else "reference"
    path = str(tmp_path / "s.csv")
    seen = []
    real = nac_fast.nac_loss
    monkeypatch.setattr(nac_fast, "nac_loss", lambda *a, **k: seen.append(k) or real(*a, **k))
    assert bench_loss.main(["--device", "cpu", "--dtypes", "float32", "--inbatch", "",
                            "--queue", "", "--inbatch-self", "16", "--D", "8", "--backends",
                            backends, "--no-memory", "--reps", "2", "--min-time", "0",
                            "--csv", path]) == 0
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["kind"], r["n"], r["N"], r["backend"]) for r in rows] == [
        ("inbatch-self", "16", "16", b) for b in backends.split(",")]
    assert all(r["status"] == "ok" for r in rows) and rows[0]["time_ratio_to_ref"] == "1.000"
    assert seen and {k["self_key"] for k in seen} == {"exclude"}
    assert {k["backend"] for k in seen} == set(backends.split(","))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bench_loss.main(["--device", "cpu", "--inbatch-self", "1", "--csv", path])
    assert e.value.code == 2 and "--inbatch-self" in capsys.readouterr().err


# ---- bench/host_overhead.py ---------------------------------------------------------------------

@pytest.mark.skipif("triton" not in nac_fast.available_backends("cpu"),
                    reason="the stubbed run needs triton (TRITON_INTERPRET=1)")
def test_probe_runs_and_reports_no_rebuild():
    """bench/host_overhead.py's stub mode (no GPU): every row, the launches and ATen ops of the
    cached plans, no plan rebuilt by a second call."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_overhead.py"),
                          "--calls", "3", "--repeats", "1"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    tri = [r for r in rows if r["backend"] == "triton"]
    assert len(tri) == 2
    # the GPU suite's host stage detail: the fused rows' host time range
    lo, hi = (round(f(r["host_s"] for r in tri) * 1e6) for f in (min, max))
    assert f"fused host: triton host {lo}-{hi} us per fwd+bwd" in res.stdout.splitlines()
    # Triton launches a fwd+bwd: prologue, forward (the finish folded in), keys' backward (the
    # rows' folded in) in-batch; forward and rows' backward with the queue (NAC_FAST_FOLD=0:
    # the finish and, in-batch, the rows' backward are launches of their own)
    fold = os.environ.get("NAC_FAST_FOLD", "1") == "1"
    want = {"inbatch": 3, "mq": 2} if fold else {"inbatch": 5, "mq": 3}
    for r in tri:
        assert r["plans_recorded"] == 0 and r["launches"] == want[r["kind"]] and r["host_s"] > 0
        # backward()'s own ones_like alone: no noise kernel, no MeanBackward division
        # (nac.py _FusedNAC), no seed drawn on the device (noise.host_seed, as on a GPU), no
        # mean (the finish reduces)
        assert r["aten_ops"] == "ones_like", r
    assert {r["backend"] for r in rows} == {"triton", "triton-criterion", "cpu", "reference"}
    # NACMQLoss: the inference term runs inside the fused loss (none of its ATen ops is left)
    # and the momentum keys go into the queue in one launch (kernels/queue_triton.py): the
    # views' concatenations and backward()'s ones_like are all that launch ATen kernels
    (crit,) = [r for r in rows if r["backend"] == "triton-criterion" and r["kind"] == "mq"]
    # (Triton: the enqueue, the forward with its finish, the rows' backward)
    assert crit["aten_ops"] == "cat cat cat ones_like" and crit["launches"] == 1 + want["mq"], crit


@pytest.mark.skipif("cpu" not in nac_fast.available_backends("cpu"), reason="needs nac_fast._C")
def test_the_gpu_rows_code_runs(monkeypatch):
    """bench/host_overhead.py --gpu's measurement loop, run on CPU tensors with the CUDA calls
    stood in (the GPU run is one shot: a slip in this code would lose it), and its goal lines."""
    import host_overhead as H
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    monkeypatch.setattr(H, "_graph_time", lambda step: (step(), 1e-4)[1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(H, "_bound", lambda *a: 5e-5)
    monkeypatch.setattr(H, "HOST_CALLS", 2)
    monkeypatch.setattr(H, "CALLS", 3)
    monkeypatch.setattr(H, "REPEATS", 1)
    backends = ["reference", "compiled-reference", "cpu", "auto"]  # no triton needed
    rows = H.gpu_rows([("inbatch", 8, 8, "float32"), ("mq", 4, 16, "float32")], backends,
                      compile_backend="aot_eager", device="cpu")
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        assert r["host_s"] > 0 and r["back_to_back_s"] > 0 and r["graph_s"] == 1e-4
        assert r["pct_of_bound"] == pytest.approx(50.0)
        assert r["x_eager"] > 0 and r["x_compile"] > 0
    lines = H.goals([dict(r, mode="gpu", dtype="bfloat16", n=8192, N=8192,
                          backend="cuda" if r["backend"] == "cpu" else r["backend"])
                     for r in rows[:4]])
    assert any("host time" in x for x in lines) and any("x eager" in x for x in lines)


# ---- bench/plot_bench.py ------------------------------------------------------------------------

def test_plot_bench_smoke(tmp_path, capsys):
    """The time and memory PNGs of a bench_loss CSV; devices and D values kept apart (a D = 16
    run does not replace the D = 8 one), a row without a finite time left out, a missing column
    named."""
    pytest.importorskip("matplotlib")
    import plot_bench
    src = _loss_csv(tmp_path / "l.csv", [
        _row(device="cpu A", N=8), _row(device="cpu A", N=16), _row(device="cpu B", N=8),
        _row(device="cpu A", N=8, D=16), _row(device="cpu A", N=32, med="nan")])
    assert len(plot_bench.load(src)) == 4
    plot_bench.main([src, "--out", str(tmp_path / "png")])
    assert sorted(os.listdir(tmp_path / "png")) == ["l_memory.png", "l_time.png"]
    bad = tmp_path / "bad.csv"
    bad.write_text("device,backend\ncpu,reference\n")
    with pytest.raises(SystemExit) as e:
        plot_bench.main([str(bad), "--out", str(tmp_path / "png")])
    assert "kind" in str(e.value)


# ---- bench/gpu_summary.py -----------------------------------------------------------------------

def test_gpu_summary_smoke(tmp_path, capsys):
    """summary.json (no NaN: a row without a finite time is left out) and the goal lines of a
    results folder; a bad train.json is an input error (exit 2, nothing written); --check-junit's
    verdict."""
    res = tmp_path / "res"
    res.mkdir()
    _loss_csv(res / "loss_gpu.csv", [_row(device="GPU X"), _row(device="GPU X", backend="cpu",
                                                              med="0.0005"),
                                      _row(device="GPU X", backend="triton", med="nan")])
    out = tmp_path / "new" / "s.json"
    assert gpu_summary.main([str(res), "--out", str(out)]) == 0

    def refuse(x):
        raise ValueError(f"not JSON: {x}")
    summary = json.loads(out.read_text(), parse_constant=refuse)
    assert summary["gpu"] == "GPU X" and [e["backend"] for e in summary["loss"]] == ["cpu"]
    assert summary["loss"][0]["eager_ms"] == 1.0
    assert "MISS training throughput: no train.json" in capsys.readouterr().out
    assert summary["goals"][-1] == "MISS training throughput: no train.json"
    (res / "train.json").write_text("")
    assert gpu_summary.main([str(res), "--out", str(tmp_path / "t.json")]) == 2
    assert "train.json" in capsys.readouterr().err and not (tmp_path / "t.json").exists()
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuite><testcase classname="t" name="test_x[triton]"/></testsuite>')
    assert gpu_summary.main(["--check-junit", str(xml), "--require-passed", "triton"]) == 0
    assert gpu_summary.main(["--check-junit", str(xml), "--require-passed", "cuda"]) == 1


# ---- bench/bench_hamming.py, train_throughput.py, data_throughput.py (one smoke test each) --

def _refused(capsys, fn, argv, *words):
    """fn(argv) exits with status 2, no traceback, a message naming each of `words`."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and all(w in err for w in words), err


def test_bench_hamming_smoke(tmp_path, capsys):
    """The CPU protocol and the --index run at toy sizes: one CSV row per method under each
    run's own columns, the C++ engine's mAP equal to the torch reference's, one JSON line last;
    an option of another run is a usage error naming it (bench_index.py is its --index run,
    bench_hamming_tc.py its --gpu run at the hamming-tc stage's sizes; the --gpu rows:
    tests/test_hamming_gpu.py)."""
    import bench_hamming
    cpu, idx = str(tmp_path / "h.csv"), str(tmp_path / "i.csv")
    assert bench_hamming.main(["--queries", "20", "--gallery", "300", "--bits", "64",
                               "--repeats", "1", "--torch-queries", "5", "--no-faiss",
                               "--csv", cpu]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "hamming_cpu" and 0 < last["map"] <= 1
    with open(cpu, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == bench_hamming.CSV_FIELDS
    assert [r["method"] for r in rows] == ["nac_fast cpu mAP@all", "nac_fast cpu full ranking",
                                           "torch reference mAP@all"]
    assert bench_hamming.main(["--index", "--gallery", "400", "--queries", "7", "--k", "5",
                               "--map-queries", "9", "--repeats", "1", "--map-repeats", "1",
                               "--no-faiss", "--csv", idx]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "index_cpu" and last["map_median_s"] > 0
    with open(idx, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == bench_hamming.INDEX_FIELDS
    assert [(r["method"], r["queries"], r["k"]) for r in rows] == [
        ("HashIndex.search", "7", "5"), ("nac_fast mAP@all", "9", "400")]
    _refused(capsys, bench_hamming.main, ["--map-sizes", "100", "--csv", ""], "--map-sizes",
             "--gpu")
    _refused(capsys, bench_hamming.main, ["--index", "--chunk", "3", "--csv", ""], "--chunk")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


CPU_STAGE = ["--data", "synthetic-device:256", "--arch", "resnet-tiny", "--method", "nac-mq",
             "--batch-size", "32", "--image-size", "16", "--amp", "off", "--queue-size", "128",
             "--warmup", "1", "--steps", "2", "--compile", "--compile-backend", "aot_eager",
             "--budget-s", "150", "--sync-check"]


@pytest.mark.slow
def test_train_throughput_cpu_stage(tmp_path):
    """The GPU suite's train stage at toy size on the CPU: train.py compiled (aot_eager) with
    its first step's cost apart, the eager baseline, the one-step profile (operators on a CPU
    run), the host-read check of a whole compiled step (PASS), the CSV rows and the summary line
    before the JSON."""
    prof, out, rows = tmp_path / "kernels.txt", tmp_path / "train.json", tmp_path / "t.csv"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_throughput.py"),
                        *CPU_STAGE, "--profile-out", str(prof), "--json-out", str(out),
                        "--csv-out", str(rows)], env=_env(), capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert res == json.loads(out.read_text())
    assert res["data"] == "synthetic-device:256" and res["measured_steps"] == 2
    assert res["img_per_s"] * res["step_ms"] / 1e3 == pytest.approx(32, rel=0.02)
    assert res["compile"] is True and res["compile_backend"] == "aot_eager"
    assert res["compiled"] == "aot_eager: online encoder fwd+bwd, momentum encoder fwd (no grad)"
    assert res["eager"]["compiled"] is None
    assert res["first_step_s"] > 0
    # compile_s is rounded to 0.01 s from the unrounded times (first_step_s to 1 ms, step_ms to
    # 0.1 ms in the JSON): within half a unit of what the rounded fields give
    assert abs(res["compile_s"] - (res["first_step_s"] - res["step_ms"] / 1000)) <= 0.0056
    assert res["profile"] == "ok"
    assert res["sync_check"] == "PASS" and res["sync_offender_count"] == 0
    assert res["sync_detector"].startswith("NoHostReads") and res["sync_ops_seen"] > 100
    e = res["eager"]
    assert e["compile"] is False and e["measured_steps"] == 2 and "first_step_s" not in e
    assert 0 < res["elapsed_s"] < 400
    text = prof.read_text()
    assert "top operators by self CPU time" in text and "aten::" in text
    assert lines[-2] == res["summary"]
    assert f", eager {e['img_per_s']:.0f}" in res["summary"]
    import csv
    with open(rows) as f:
        got = list(csv.DictReader(f))
    assert [g["config"] for g in got] == ["nac-mq-defaults", "nac-mq-eager"]
    assert all(g["status"] == "ok" and float(g["img_per_s"]) > 0 for g in got)
    assert got[0]["data"] == "synthetic-device:256" and got[0]["loader"] == res["loader"]


def test_data_throughput_appends_a_csv_row_with_its_spread(tmp_path, capsys):
    """The data benchmark printed its JSON line only: no CSV row, no spread.  --csv appends one
    row per run (the JSON's figures, the commit, median / p20 / p80 of the batch times), under
    the same header; a damaged CSV is refused before the data is read."""
    import data_throughput
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
    _refused(capsys, data_throughput.main, argv, "--csv")
