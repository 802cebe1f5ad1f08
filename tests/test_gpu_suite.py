"""The GPU suite's CPU-checkable parts: roofline numbers, the summary writer and its goal checks,
the JUnit skip detector, gpu_suite.sh's argument handling, and bench_loss.py's per-shape
torch.compile (one compiled graph per case, detected when it is not)."""
import csv
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_loss  # noqa: E402
import gpu_summary  # noqa: E402
import common as roofline  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
EXP_RATE = 16 * 132 * 1.98e9  # MUFU ex2: 16 per clock per SM


def _append(path, rows):
    """Rows appended as bench_loss.py appends them (its FIELDS)."""
    roofline.append_rows(path, rows, bench_loss.FIELDS)


# ---- roofline ---------------------------------------------------------------------------------

def test_roofline_inbatch_8192_bf16_h100_by_hand():
    b = roofline.bound("inbatch", 8192, 8192, 128, "bfloat16", H100)
    # 4 products of 2 n N D: forward scores + P k, backward scores + P^T q
    assert b["products"] == 4
    assert b["matrix_flops"] == 4 * 2 * 8192 * 8192 * 128 == 68_719_476_736
    assert b["matrix_s"] == pytest.approx(68_719_476_736 / 798e12)          # 86.1 us
    assert b["exps"] == 2 * 8192 * 8192
    assert b["exp_s"] == pytest.approx(134_217_728 / EXP_RATE)                # 32.1 us
    # a, r, noise in; grad a, grad r out (bf16), plus the fp32 loss
    assert b["bytes"] == 5 * 8192 * 128 * 2 + 4
    assert b["memory_s"] == pytest.approx((5 * 8192 * 128 * 2 + 4) / 3.0e12)
    assert b["bound_s"] == pytest.approx(86.1e-6, rel=1e-3)
    assert b["limiter"] == "matrix" and b["gpu"] == "H100"


def test_roofline_queue_fp32_modes_and_h200():
    n, N, D = 8192, 65536, 128
    q = roofline.bound("queue", n, N, D, "bfloat16", "NVIDIA H200")
    assert q["products"] == 2 and q["exps"] == n * N          # the queue gets no gradient
    assert q["matrix_s"] == pytest.approx(2 * 2 * n * N * D / 788e12)
    assert q["bytes"] == (3 * n * D + N * D + 2 * n * D) * 2 + 4
    assert q["memory_s"] == pytest.approx(q["bytes"] / 4.3e12)
    assert roofline.bound("mq", n, N, D, "bf16", "H200")["bound_s"] == q["bound_s"]
    fma = 128 * 2 * 132 * 1.98e9
    ieee = roofline.bound("queue", n, N, D, "float32", H100, fp32_mode="ieee")
    assert ieee["matrix_s"] == pytest.approx(2 * 2 * n * N * D / fma)
    assert ieee["bytes"] == (3 * n * D + N * D + 2 * n * D) * 4 + 4
    x3 = roofline.bound("queue", n, N, D, "float32", H100)  # the kernels' default, tf32x3
    assert x3["matrix_s"] == pytest.approx(3 * 2 * 2 * n * N * D / 494.7e12)
    x6 = roofline.bound("queue", n, N, D, "float32", H100, fp32_mode="bf16x6")  # six bf16 products
    bf = roofline.bound("queue", n, N, D, "bfloat16", H100)
    assert x6["matrix_s"] == pytest.approx(6 * bf["matrix_s"])
    assert x6["bytes"] == x3["bytes"] and x6["matrix_unit"] == "bf16x6 tensor cores"
    h3 = roofline.bound("inbatch", n, n, D, "float32", H100, fp32_mode="fp16x3")  # three fp16
    bfi = roofline.bound("inbatch", n, n, D, "bfloat16", H100)
    assert h3["matrix_s"] == pytest.approx(3 * bfi["matrix_s"])
    assert h3["matrix_unit"] == "fp16x3 tensor cores"
    keys = roofline.bound("queue", n, N, D, "bfloat16", H100, keys_grad=True)
    assert keys["products"] == 4 and keys["exps"] == 2 * n * N
    # each rate the measured one where there is one (bf16 798, HBM 3.0), else the datasheet's
    tf32 = roofline.bound("inbatch", 4096, 4096, 128, "float32", H100, fp32_mode="tf32")
    assert (tf32["matrix_rate"], tf32["hbm_rate"], bfi["matrix_rate"]) == (494.7e12, 3.0e12, 798e12)


def test_roofline_rejects_bad_input():
    with pytest.raises(ValueError, match="gpu_name"):
        roofline.bound("inbatch", 8, 8, 128, "bfloat16", "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="gpu_name"):
        roofline.resolve_gpu("NVIDIA H100 PCIe")
    with pytest.raises(ValueError, match="kind"):
        roofline.bound("keys", 8, 8, 128, "bfloat16", H100)
    with pytest.raises(ValueError, match="N must equal n"):
        roofline.bound("inbatch", 8, 16, 128, "bfloat16", H100)
    with pytest.raises(ValueError, match="dtype"):
        roofline.bound("inbatch", 8, 8, 128, "float16", H100)
    with pytest.raises(ValueError, match="fp32_mode"):
        roofline.bound("inbatch", 8, 8, 128, "float32", H100, fp32_mode="fast")
    assert roofline.known_gpu("NVIDIA H200") and not roofline.known_gpu("cpu")


# ---- summary writer ---------------------------------------------------------------------------

def _row(kind, n, N, dtype, backend, ms, mib, **kw):
    base = {f: "" for f in bench_loss.FIELDS}
    base.update(timestamp="2026-11-23T10:00:00+00:00", host="gpu", device=H100,
                torch="2.11.0+cu130", commit="abc1234", threads=16, kind=kind, n=n, N=N, D=128,
                dtype=dtype, backend=backend, median_s=f"{ms / 1e3:.6f}", p20_s=f"{0.95 * ms / 1e3:.6f}",
                p80_s=f"{1.05 * ms / 1e3:.6f}",
                peak_extra_mib=f"{mib:.2f}", reps=10, triton="3.6.0", status="ok")
    base.update(kw)
    return base


def _write_results(tmp_path):
    res = tmp_path / "NVIDIA-H100-80GB-HBM3_2026-11-23"
    res.mkdir()
    b_in = roofline.bound("inbatch", 8192, 8192, 128, "bfloat16", H100)["bound_s"] * 1e3
    b_q = roofline.bound("queue", 8192, 65536, 128, "bfloat16", H100)["bound_s"] * 1e3
    rows = [
        # in-batch 8192 bf16: triton 0.15 ms (fastest; 5.1x / 2.2x / 57% of bound; memory 1/40)
        _row("inbatch", 8192, 8192, "bfloat16", "reference", 0.77, 800.0),
        _row("inbatch", 8192, 8192, "bfloat16", "compiled-reference", 0.33, 400.0),
        _row("inbatch", 8192, 8192, "bfloat16", "triton", 0.15, 20.0,
             pct_of_bound=f"{100 * b_in / 0.15:.2f}"),
        _row("inbatch", 8192, 8192, "bfloat16", "cuda", 3.0, 20.0),
        # queue 8192 x 65536 bf16: triton 1.0 ms: 4x eager (MISS), compile row failed (MISS),
        # 34% of the bound (MISS)
        _row("mq", 8192, 65536, "bfloat16", "reference", 4.0, 3000.0),
        _row("mq", 8192, 65536, "bfloat16", "compiled-reference", 2.0, 1500.0),
        _row("mq", 8192, 65536, "bfloat16", "triton", 1.0, 100.0,
             pct_of_bound=f"{100 * b_q / 1.0:.2f}"),
        _row("mq", 8192, 65536, "bfloat16", "compiled-reference", 0.0, 0.0, median_s="",
             peak_extra_mib="", status="failed: RuntimeError: not compiled: 0 graphs"),
    ]
    _append(str(res / "loss_gpu.csv"), rows)
    (res / "train.json").write_text(json.dumps({
        "arch": "resnet50", "method": "nac-mq", "batch_size": 256, "world_size": 1,
        "device": H100, "img_per_s": 1234.4, "data_wait": 0.0031, "step_ms": 207.4}) + "\n")
    (res / "versions.json").write_text(json.dumps({
        "gpu": H100, "date": "2026-11-23", "commit": "abc1234", "torch": "2.11.0+cu130",
        "triton": "3.6.0"}))
    return res, b_in


def test_summary_schema_values_and_goal_checks(tmp_path, capsys):
    res, b_in = _write_results(tmp_path)
    out = tmp_path / "summary.json"
    assert gpu_summary.main([str(res), "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert list(s) == ["gpu", "date", "commit", "torch", "triton", "loss", "train", "goals"]
    assert (s["gpu"], s["date"], s["commit"], s["torch"], s["triton"]) == \
        (H100, "2026-11-23", "abc1234", "2.11.0+cu130", "3.6.0")
    keys = ["kind", "n", "N", "D", "dtype", "backend", "fused_ms", "eager_ms", "compile_ms",
            "fused_peak_mb", "eager_peak_mb", "pct_of_bound"]
    assert all(list(e) == keys for e in s["loss"])
    by = {(e["kind"], e["backend"]): e for e in s["loss"]}
    assert set(by) == {("inbatch", "triton"), ("inbatch", "cuda"), ("queue", "triton")}
    t = by[("inbatch", "triton")]
    assert (t["n"], t["N"], t["D"], t["dtype"]) == (8192, 8192, 128, "bfloat16")
    assert (t["fused_ms"], t["eager_ms"], t["compile_ms"]) == (0.15, 0.77, 0.33)
    assert (t["fused_peak_mb"], t["eager_peak_mb"]) == (20.0, 800.0)
    assert t["pct_of_bound"] == pytest.approx(100 * b_in / 0.15, abs=0.01)
    q = by[("queue", "triton")]
    assert q["compile_ms"] is None  # the newest compiled row failed: no stale figure
    b_q = roofline.bound("queue", 8192, 65536, 128, "bfloat16", H100)["bound_s"]
    assert q["pct_of_bound"] == pytest.approx(100 * b_q / 1.0e-3, abs=0.01)
    assert s["train"] == {"arch": "resnet50", "method": "nac-mq", "batch_per_gpu": 256,
                          "img_per_s": 1234.4, "data_wait_frac": 0.0031}

    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln[:5] in ("PASS ", "MISS ")]
    assert len(lines) == 9
    inb = [ln for ln in lines if ln.startswith(("PASS inbatch", "MISS inbatch"))]
    assert len(inb) == 4 and all(ln.startswith("PASS") for ln in inb), inb
    assert "[triton, fastest fused" in inb[0] and "5.13x" in inb[0]
    qs = {ln.split(": ")[0].split("] ")[1]: ln[:4] for ln in lines if "queue" in ln}
    assert qs == {"speed vs eager": "MISS", "speed vs torch.compile": "MISS",
                  "roofline": "MISS", "memory": "PASS"}  # 344.5 us / 1 ms = 34% of bound
    assert lines[-1].startswith("MISS training resnet50 nac-mq batch 256/GPU: 1234 img/s")
    assert s["goals"] == lines  # summary.json keeps the verdicts printed
    # --require-goals turns a MISS into exit status 3
    assert gpu_summary.main([str(res), "--out", str(out), "--require-goals"]) == 3


def test_summary_fp32_modes_are_their_own_rows_and_judged_against_eager(tmp_path, capsys):
    """fp32 Triton rows in bf16x6 (bench_loss.py's fp32_dot column) are their own backend,
    "triton[bf16x6]", beside the default tf32x3's "triton"; where fp32 rows were measured at a goal
    shape, the fastest fused one is judged against eager (>= 2x, issue 38)."""
    res, _ = _write_results(tmp_path)
    rows = [_row("inbatch", 8192, 8192, "float32", "reference", 2.5, 900.0, fp32_dot="tf32x3"),
            _row("inbatch", 8192, 8192, "float32", "triton+graph", 1.95, 40.0, fp32_dot="tf32x3"),
            _row("inbatch", 8192, 8192, "float32", "reference", 2.5, 900.0, fp32_dot="bf16x6"),
            _row("inbatch", 8192, 8192, "float32", "triton+graph", 1.0, 40.0, fp32_dot="bf16x6"),
            _row("mq", 8192, 65536, "float32", "reference", 16.0, 3000.0, fp32_dot="tf32x3"),
            _row("mq", 8192, 65536, "float32", "triton", 10.0, 60.0, fp32_dot="tf32x3")]
    _append(str(res / "loss_gpu.csv"), rows)
    out = tmp_path / "summary.json"
    assert gpu_summary.main([str(res), "--out", str(out)]) == 0
    fp32 = {(e["kind"], e["backend"]): e["fused_ms"]
            for e in json.loads(out.read_text())["loss"] if e["dtype"] == "float32"}
    assert fp32 == {("inbatch", "triton+graph"): 1.95, ("inbatch", "triton[bf16x6]+graph"): 1.0,
                    ("queue", "triton"): 10.0}
    lines = [ln for ln in capsys.readouterr().out.splitlines()
             if "float32" in ln and ln[:5] in ("PASS ", "MISS ")]
    assert lines == [
        "PASS inbatch 8192x8192 D=128 float32 fwd+bwd [triton[bf16x6]+graph, fastest fused, "
        "1.000 ms] speed vs eager: 2.50x (goal >= 2x)",
        "MISS queue 8192x65536 D=128 float32 fwd+bwd [triton, fastest fused, 10.000 ms] speed vs "
        "eager: 1.60x (goal >= 2x)"]


def test_summary_judges_the_larger_shapes_against_the_bound_where_measured(tmp_path, capsys):
    """Issue 38's in-batch 16384 and queue 8192 x 262144 (bf16): the fastest fused row's
    pct_of_bound (bench_loss.py's column) against 50%, graph rows included; a folder without
    them prints no line for them."""
    res, _ = _write_results(tmp_path)
    out = tmp_path / "summary.json"
    assert gpu_summary.main([str(res), "--out", str(out)]) == 0
    assert not [ln for ln in capsys.readouterr().out.splitlines()
                if "16384" in ln or "262144" in ln]
    b16 = roofline.bound("inbatch", 16384, 16384, 128, "bfloat16", H100)["bound_s"] * 1e3
    bq = roofline.bound("queue", 8192, 262144, 128, "bfloat16", H100)["bound_s"] * 1e3
    _append(str(res / "loss_gpu.csv"), [
        _row("inbatch", 16384, 16384, "bfloat16", "reference", 4.0, 3000.0),
        _row("inbatch", 16384, 16384, "bfloat16", "triton", b16 / 0.45, 40.0, pct_of_bound="45"),
        _row("inbatch", 16384, 16384, "bfloat16", "triton+graph", b16 / 0.55, 40.0,
             pct_of_bound="55"),
        _row("mq", 8192, 262144, "bfloat16", "reference", 30.0, 9000.0),
        _row("mq", 8192, 262144, "bfloat16", "triton+graph", bq / 0.40, 60.0,
             pct_of_bound="40")])
    assert gpu_summary.main([str(res), "--out", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines()
             if ("16384" in ln or "262144" in ln) and ln[:5] in ("PASS ", "MISS ")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("PASS inbatch 16384x16384 D=128 bfloat16 fwd+bwd "
                               "[triton+graph, fastest fused") and "55.0% of bound" in lines[0]
    assert lines[1].startswith("MISS queue 8192x262144") and "40.0% of bound" in lines[1]


def test_summary_rejects_mixed_devices_and_empty_input(tmp_path):
    res, _ = _write_results(tmp_path)
    _append(str(res / "loss_gpu.csv"), [_row("inbatch", 1024, 1024, "bfloat16", "triton", 0.05,
                                             1.0, device="NVIDIA H200")])
    assert gpu_summary.main([str(res), "--out", str(tmp_path / "s.json")]) == 2
    assert gpu_summary.main([str(res), "--out", str(tmp_path / "s.json"), "--device", "H100"]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert gpu_summary.main([str(empty), "--out", str(tmp_path / "e.json")]) == 2


def test_append_rows_migrates_an_old_header(tmp_path):
    old = ["timestamp", "host", "device", "torch", "commit", "threads", "kind", "n", "N", "D",
           "dtype", "backend", "median_s", "p20_s", "p80_s", "peak_extra_mib", "gflops",
           "time_ratio_to_ref", "mem_ratio_to_ref", "reps"]
    path = tmp_path / "loss.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old)
        w.writeheader()
        w.writerow({k: "" for k in old} | {"kind": "inbatch", "n": 8, "N": 8, "D": 128,
                                           "backend": "cpu", "median_s": "0.001"})
    _append(str(path), [_row("mq", 8, 16, "float32", "triton", 1.0, 1.0)])
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        rows = list(r)
    assert r.fieldnames == bench_loss.FIELDS
    assert rows[0]["median_s"] == "0.001" and rows[0]["status"] == ""
    assert rows[1]["kind"] == "mq" and rows[1]["status"] == "ok"


def test_plot_bench_reads_new_csv_and_skips_failed_rows(tmp_path):
    pytest.importorskip("matplotlib")
    import plot_bench
    res, _ = _write_results(tmp_path)
    rows = plot_bench.load(str(res / "loss_gpu.csv"))
    assert all(r["status"] == "ok" for r in rows)
    assert not any(r["backend"] == "compiled-reference" and r["kind"] == "mq" and
                   r["median_s"] == "" for r in rows)
    plot_bench.main([str(res / "loss_gpu.csv"), "--out", str(tmp_path / "png")])
    assert (tmp_path / "png" / "loss_gpu_time.png").read_bytes()[:4] == b"\x89PNG"


# ---- JUnit skip detector ----------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="2" tests="6">
<testcase classname="tests.test_loss_backends" name="test_values[triton-inbatch-97-97-128]" time="0.1"/>
<testcase classname="tests.test_loss_backends" name="test_values[cuda-inbatch-97-97-128]" time="0.1"/>
<testcase classname="tests.test_hashing" name="test_distances[triton-64]" time="0.0"/>
<testcase classname="tests.test_hashing" name="test_faiss_agrees" time="0.0">
  <skipped type="pytest.skip" message="could not import 'faiss': No module named 'faiss'">skip</skipped></testcase>
<testcase classname="tests.test_loss_backends" name="test_torch_compile_matches_eager[triton]" time="0.0">
  %s</testcase>
<testcase classname="tests.test_noise" name="test_philox_known_answer" time="0.0"/>
</testsuite></testsuites>
"""


def test_junit_detector_flags_a_skipped_triton_test(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text(JUNIT % '<skipped type="pytest.skip" message="AOTAutograd runs a triton_op ...">s</skipped>')
    res = gpu_summary.check_junit(str(bad), ["triton", "cuda"])
    assert not res["ok"]
    assert res["skipped"] == 2 and res["passed"] == 4
    assert [v for v in res["violations"] if "test_torch_compile_matches_eager[triton]" in v]
    assert len(res["violations"]) == 1  # faiss's skip is not a kernel's
    assert gpu_summary.main(["--check-junit", str(bad), "--require-passed", "triton,cuda",
                             "--status-file", str(tmp_path / "st")]) == 1
    assert (tmp_path / "st").read_text().startswith("0 failed, 4 passed, 2 skipped (1 not allowed)")
    # the Triton Hamming tests run on CUDA tensors now (issue 39): their old skip is a violation
    hashing = tmp_path / "hashing.xml"
    hashing.write_text(JUNIT.replace(
        'name="test_distances[triton-64]" time="0.0"/>',
        'name="test_distances[triton-64]" time="0.0"><skipped type="pytest.skip" message="the '
        'Triton Hamming kernels run on CPU tensors only under TRITON_INTERPRET=1">s</skipped>'
        '</testcase>') % "")
    res = gpu_summary.check_junit(str(hashing), ["triton", "cuda"])
    assert not res["ok"] and [v for v in res["violations"] if "test_distances[triton-64]" in v]

    good = tmp_path / "good.xml"
    good.write_text(JUNIT % "")
    assert gpu_summary.check_junit(str(good), ["triton", "cuda"])["ok"]
    # a backend with no passed test, a failure, an unreadable file: all fail
    assert not gpu_summary.check_junit(str(good), ["cpu"])["ok"]
    failed = tmp_path / "failed.xml"
    failed.write_text(JUNIT % '<failure message="assert 1 == 2">x</failure>')
    r = gpu_summary.check_junit(str(failed))
    assert not r["ok"] and r["failed"] == 1
    empty_param = tmp_path / "empty.xml"
    empty_param.write_text(JUNIT.replace("name=\"test_philox_known_answer\" time=\"0.0\"/>",
                                         "name=\"test_grad[backend0]\"><skipped message=\"got empty "
                                         "parameter set ['backend']\">s</skipped></testcase>") % "")
    assert not gpu_summary.check_junit(str(empty_param))["ok"]
    assert not gpu_summary.check_junit(str(tmp_path / "missing.xml"))["ok"]


# ---- gpu_suite.sh -----------------------------------------------------------------------------

def test_gpu_suite_rejects_unknown_stage_with_usage():
    for argv in (["bogus"], [], ["build", "bogus"]):
        r = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_suite.sh"), *argv],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, argv
        assert "usage: bash bench/gpu_suite.sh STAGE..." in r.stderr
        assert "SUITE" not in r.stdout  # nothing ran


def test_suite_preflight_names_the_device_and_its_versions():
    """tools/suite_preflight.py (the suite's first step): the results folder's name, the versions
    line and versions.json; without a GPU outside CPU mode, exit 1 saying so."""
    import torch
    env = dict(os.environ, NAC_FAST_SUITE_CPU="1", NAC_FAST_COMMIT="abc1234")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "suite_preflight.py")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    name, line, blob = r.stdout.split("\n", 2)
    info = json.loads(blob)
    assert name == "cpu" and line.startswith("versions: gpu none (CPU mode), driver ")
    assert line.endswith(f"python {info['python']}, commit abc1234") and info["commit"] == "abc1234"
    assert {"torch", "triton", "nvcc", "cpus", "date"} <= set(info)
    assert r.stderr.startswith("== versions: date ")
    if not torch.cuda.is_available():
        env["NAC_FAST_SUITE_CPU"] = "0"
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "suite_preflight.py")],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 1 and "no GPU visible to torch" in r.stderr, r.stderr[-3000:]


# ---- bench_loss: torch.compile per shape --------------------------------------------------------

def _bench_argv(csv_path):
    return ["--device", "cpu", "--backends", "reference", "--inbatch", "16,24", "--queue", "40",
            "--mq-n", "8", "--D", "16", "--dtypes", "float32", "--reps", "1", "--min-time", "0",
            "--no-memory", "--compile-reference", "--compile-backend", "aot_eager",
            "--csv", str(csv_path)]


@pytest.mark.slow
def test_bench_loss_compiles_every_shape(tmp_path):
    path = tmp_path / "loss.csv"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_loss.py"),
                        *_bench_argv(path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    comp = [x for x in rows if x["backend"] == "compiled-reference"]
    assert [(x["kind"], x["n"], x["N"]) for x in comp] == \
        [("inbatch", "16", "16"), ("inbatch", "24", "24"), ("mq", "8", "40")]
    assert all(x["compiled_graphs"] == "1" and x["status"] == "ok" and
               x["compile_backend"] == "aot_eager" and float(x["compile_s"]) > 0 for x in comp)
    assert all(x["pct_of_bound"] == "" for x in rows)  # no known GPU on a CPU run
    assert all(x["timer"] == "perf_counter" and float(x["loadavg"]) >= 0 for x in rows)


def test_bench_loss_fails_a_row_that_is_not_compiled(tmp_path, monkeypatch):
    """The old behaviour (one compiled function for every case) is caught: the second case's
    counter sees a second graph, its row is written as failed and the exit status is 1."""
    shared, fresh = {}, bench_loss.compile_reference

    def one_for_all(name):
        if "fn" not in shared:
            shared["fn"] = fresh(name)
        return shared["fn"]

    monkeypatch.setattr(bench_loss, "compile_reference", one_for_all)
    path = tmp_path / "loss.csv"
    argv = _bench_argv(path)
    argv[argv.index("--queue") + 1] = ""
    assert bench_loss.main(argv) == 1
    with open(path, newline="") as f:
        comp = [x for x in csv.DictReader(f) if x["backend"] == "compiled-reference"]
    assert comp[0]["status"] == "ok"
    assert comp[1]["status"].startswith("failed: RuntimeError: not compiled: 2 graphs compiled")


# ---- bench_loss: device timing (issue 23, item 5) -----------------------------------------------

def test_time_step_on_a_gpu_is_do_bench(monkeypatch):
    """On CUDA the step is timed by triton.testing.do_bench (CUDA events, L2 flush, warm-up), not
    by the host clock: its median and p20/p80 are the row's."""
    import torch
    import triton.testing
    calls = []

    def fake_do_bench(fn, **kw):
        calls.append(kw)
        fn()
        return [2.0, 1.5, 3.0]
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    steps = []
    med, p20, p80, reps, first, timer = bench_loss.time_step(lambda: steps.append(1), "cuda", 7,
                                                             0.5)
    assert (med, p20, p80, timer) == (0.002, 0.0015, 0.003, "do_bench")
    assert calls == [dict(warmup=25, rep=500.0, quantiles=[0.5, 0.2, 0.8])]
    assert len(steps) == 2 and reps == 250  # the warm-up call, then do_bench's


def test_time_step_on_the_cpu_is_the_host_clock():
    med, p20, p80, reps, first, timer = bench_loss.time_step(lambda: None, "cpu", 5, 0.0)
    assert timer == "perf_counter" and reps == 5 and p20 <= med <= p80


def test_graph_rows_follow_each_fused_backend():
    assert bench_loss.variants(["reference", "cpu", "triton"], True, True) == [
        "reference", "compiled-reference", "cpu", "cpu+graph", "triton", "triton+graph"]
    assert bench_loss.variants(["reference", "triton"], False, False) == ["reference", "triton"]


def test_graphs_need_a_gpu(capsys):
    with pytest.raises(SystemExit):
        bench_loss.main(["--device", "cpu", "--graphs", "--quick"])
    assert "--graphs needs --device cuda" in capsys.readouterr().err


@pytest.mark.slow
def test_every_test_the_suite_names_exists_and_collects():
    """Each tests/... file and ::test node bench/gpu_suite.sh hands to pytest exists and collects
    (a renamed test would otherwise cost a GPU run's stage: the device is lent for minutes)."""
    import re
    text = open(os.path.join(ROOT, "bench", "gpu_suite.sh")).read()
    named = sorted(set(re.findall(r"tests/[A-Za-z0-9_]+\.py(?:::[A-Za-z0-9_]+)?", text)))
    assert len(named) >= 10, named
    missing = [t for t in named if not os.path.isfile(os.path.join(ROOT, t.split("::")[0]))]
    assert not missing, missing
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *named], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for node in (t for t in named if "::" in t):
        assert node in r.stdout, f"{node} collected no test"


# ---- gpu_suite.sh train-jpeg (issue 54): its plumbing in CPU mode ------------------------------

def _suite(tmp_path, *stages, **env):
    e = dict(os.environ, NAC_FAST_SUITE_CPU="1", PYTHON=sys.executable, OMP_NUM_THREADS="1",
             NAC_FAST_SUITE_RESULTS=str(tmp_path / "res"))
    e.update(env)  # (PYTHON too)
    e.pop("OUT", None)
    return subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_suite.sh"), *stages],
                          capture_output=True, text=True, timeout=600, env=e, cwd=ROOT)


def test_train_jpeg_is_a_stage_and_not_part_of_all():
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_suite.sh"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "train-jpeg" in r.stderr
    text = open(os.path.join(ROOT, "bench", "gpu_suite.sh")).read()
    assert "all) REQ+=(test autotune host train hamming) ;;" in text   # DALI must be carried first


@pytest.mark.slow
def test_train_jpeg_refuses_a_folder_it_did_not_make(tmp_path):
    """NAC_FAST_JPEG_TREE naming a folder of the user's (no make_ilsvrc_tree.json): the stage
    fails naming it and leaves it as it was."""
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    r = _suite(tmp_path, "train-jpeg", NAC_FAST_JPEG_TREE=str(mine))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("SUITE train-jpeg")][-1]
    assert line.startswith("SUITE train-jpeg FAIL") and f"NAC_FAST_JPEG_TREE={mine}" in line, line
    assert "make_ilsvrc_tree.py exit status 2" in line   # make_ilsvrc_tree.py --reuse refused it:
    assert "is not a make_ilsvrc_tree.py tree" in r.stdout   # its error, in the stage's log
    assert os.listdir(mine) == ["keep.txt"]


@pytest.mark.slow
def test_train_jpeg_stage_runs_in_cpu_mode(tmp_path):
    """The whole stage on the CPU (dali-cpu, a tiny tree and model): the tree made, the quirk
    test (tests/test_data_dali.py, JUnit) PASS, train_throughput.py's run of train.py on the tree,
    one train_jpeg.csv row with img/s and data wait, the detail beside the synthetic figure; a
    second run reuses the tree."""
    pytest.importorskip("nvidia.dali")
    tree = tmp_path / "tree"
    env = dict(NAC_FAST_JPEG_TREE=str(tree), NAC_FAST_JPEG_STEPS="4")
    r = _suite(tmp_path, "train-jpeg", **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("SUITE train-jpeg")][-1]
    assert line.startswith("SUITE train-jpeg PASS") and "quirk check PASS" in line, line
    # (4 + 10) x 8 / 4 classes = 28 files a class: one epoch covers the run
    assert " of synthetic 2181; tree 112 files (made in " in line, line
    with open(tmp_path / "res" / "train_jpeg.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1, rows
    row = rows[0]
    assert float(row["img_per_s"]) > 0 and 0 <= float(row["data_wait"]) < 1
    # warm-up 2 (the CPU mode's), then 4 - 2 steps: one timed window of 2
    assert row["windows"] == "1" and row["steps_per_window"] == "2" and row["status"] == "ok"
    assert row["data"] == str(tree) and row["loader"] == "dali-cpu"
    made = json.loads((tmp_path / "res" / "train_jpeg_tree.json").read_text())
    assert made["classes"] == 4 and made["train_per_class"] == 28 and made["size"] == 64
    junit = (tmp_path / "res" / "pytest_train_jpeg.xml").read_text()  # the quirk test, dali-cpu
    assert 'name="test_dali_matches_torchvision_on_every_quirk[dali-cpu]"' in junit
    assert (tmp_path / "res" / ".junit_train_jpeg").read_text().startswith("0 failed, 1 passed")
    r = _suite(tmp_path, "train-jpeg", **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "tree 112 files (reused)" in r.stdout
    with open(tmp_path / "res" / "train_jpeg.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 2


# ---- tools/carry_wheel.sh: DALI's wheels in pieces to the device ------------------------------

CARRY = os.path.join(ROOT, "tools", "carry_wheel.sh")


def _carry(cmd, cwd, **env):
    e = dict(os.environ, PYTHON=sys.executable, **env)
    return subprocess.run(["bash", CARRY, cmd], cwd=str(cwd), capture_output=True, text=True,
                          timeout=120, env=e)


def _tiny_wheel(folder, version="0.0.1"):
    """A real (installable) wheel of nvidia/__init__.py (no extend_path, as some NVIDIA wheels
    ship it) and nvidia/dali/__init__.py with __version__."""
    import zipfile
    name = f"nvidia_dali_test-{version}-py3-none-any.whl"
    info = f"nvidia_dali_test-{version}.dist-info"
    files = {"nvidia/__init__.py": "# license header only\n",
             "nvidia/dali/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: nvidia-dali-test\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(os.path.join(folder, name), "w") as z:
        for k, v in files.items():
            z.writestr(k, v)


def test_carry_wheel_pieces_join_and_a_missing_or_corrupt_piece_is_named(tmp_path):
    here = tmp_path / "here"
    (here / ".dali_carry" / "wheels").mkdir(parents=True)
    rng = __import__("random").Random(0)
    for i, n in enumerate((1_500_000, 1_100_000)):
        (here / ".dali_carry" / "wheels" / f"w{i}-1-py3-none-any.whl").write_bytes(rng.randbytes(n))
    assert _carry("cut", here, NAC_FAST_PIECE_MIB="61").returncode == 2     # > 60 MiB refused
    r = _carry("cut", here, NAC_FAST_PIECE_MIB="1")
    assert r.returncode == 0, r.stderr
    d = here / ".dali_carry"
    pieces = sorted(p.name for p in d.glob("piece.*"))
    assert pieces == ["piece.000", "piece.001", "piece.002"], pieces
    assert all((d / p).stat().st_size <= 2**20 for p in pieces)
    assert b"".join((d / p).read_bytes() for p in pieces) == (d / "bundle.tar").read_bytes()
    assert "ok: 3 pieces" in _carry("check", here).stdout
    # there: one piece per call, into the persistent folder
    dev, store = tmp_path / "device", tmp_path / "pieces"
    env = dict(NAC_FAST_DALI_PIECES=str(store))
    for p in pieces:
        (dev / ".dali_carry").mkdir(parents=True, exist_ok=True)
        for f in (dev / ".dali_carry").iterdir():
            f.unlink()
        for f in ("MANIFEST", p):
            (dev / ".dali_carry" / f).write_bytes((d / f).read_bytes())
        r = _carry("receive", dev, **env)
        assert r.returncode == 0, r.stderr
    assert "3 of 3 now in" in r.stdout
    for f in (dev / ".dali_carry").glob("piece.*"):
        f.unlink()
    assert _carry("check", dev, **env).returncode == 0
    # a corrupt piece, then a missing one: named, exit 1
    good = (store / "piece.001").read_bytes()
    (store / "piece.001").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    r = _carry("check", dev, **env)
    assert r.returncode == 1 and f"corrupt piece {store}/piece.001" in r.stderr, r.stderr
    (store / "piece.001").write_bytes(good)
    (store / "piece.002").unlink()
    r = _carry("check", dev, **env)
    assert r.returncode == 1 and "missing piece piece.002" in r.stderr, r.stderr
    r = _carry("install", dev, **env, NAC_FAST_DALI_SITE=str(tmp_path / "site"))
    assert r.returncode == 1 and "missing piece piece.002" in r.stderr
    assert not (tmp_path / "site").exists()
    # a corrupt piece on its way in is refused before it reaches the store
    (dev / ".dali_carry" / "piece.002").write_bytes(b"x" + (d / "piece.002").read_bytes()[1:])
    r = _carry("receive", dev, **env)
    assert r.returncode == 1 and "corrupt piece" in r.stderr and not (store / "piece.002").exists()


def test_carry_wheel_installs_once_and_keeps_the_nvidia_namespace_open(tmp_path):
    here = tmp_path / "here"
    (here / ".dali_carry" / "wheels").mkdir(parents=True)
    _tiny_wheel(here / ".dali_carry" / "wheels", "0.0.7")
    assert _carry("cut", here, NAC_FAST_PIECE_MIB="1").returncode == 0
    env = dict(NAC_FAST_DALI_PIECES=str(tmp_path / "pieces"), NAC_FAST_DALI_SITE=str(tmp_path / "site"))
    assert _carry("receive", here, **env).returncode == 0
    r = _carry("install", here, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed 1 wheels" in r.stdout and "nvidia.dali 0.0.7" in r.stdout
    assert f"export PYTHONPATH={tmp_path / 'site'}" in r.stdout
    assert "extend_path" in (tmp_path / "site" / "nvidia" / "__init__.py").read_text()
    r = _carry("install", here, **env)
    assert r.returncode == 0 and "already installed" in r.stdout, r.stdout + r.stderr
