"""bench/check_predictions.py: the predictions of bench/gpu_notes.md checked against a GPU run's
results files, as the suite writes them (the real field lists of host_overhead, bench_loss and
bench_hamming)."""
from __future__ import annotations

import csv
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_hamming  # noqa: E402
import bench_loss  # noqa: E402
import check_predictions as CP  # noqa: E402
import host_overhead  # noqa: E402


def _write(path, fields, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields})


def _run(tmp_path):
    """Two folders as the two device calls leave them: host and loss rows in the first, the
    Hamming rows in the second; one failed row and one superseded row among them."""
    a, b = tmp_path / "run4", tmp_path / "run4t"
    a.mkdir(), b.mkdir()
    host = dict(mode="gpu", D=128, dtype="bfloat16", status="ok")
    _write(a / "host_gpu.csv", host_overhead.FIELDS, [
        # in-batch 512: unfolded - folded = 40 us (HELD); queue 256: 5 us (MISSED)
        dict(host, kind="inbatch", n=512, N=512, backend="triton", host_s=2e-4, graph_s=4e-5),
        dict(host, kind="inbatch", n=512, N=512, backend="triton-unfolded", host_s=2.4e-4),
        dict(host, kind="mq", n=256, N=65536, backend="triton", host_s=1e-4),
        dict(host, kind="mq", n=256, N=65536, backend="triton-unfolded", host_s=1.05e-4),
        # in-batch 8192 graph: +10% (MISSED); the queue's unfolded row failed: not measured
        dict(host, kind="inbatch", n=8192, N=8192, backend="triton", graph_s=1.1e-4),
        dict(host, kind="inbatch", n=8192, N=8192, backend="triton-unfolded", graph_s=1.0e-4),
        dict(host, kind="mq", n=8192, N=65536, backend="triton", graph_s=5e-4),
        dict(host, kind="mq", n=8192, N=65536, backend="triton-unfolded", graph_s=5e-4,
             status="failed: RuntimeError"),
    ])
    loss = dict(D=128, dtype="float32", status="ok")
    _write(a / "loss_gpu.csv", bench_loss.FIELDS, [
        # bf16x6 in-batch: an eager-path row and the graph row (the graph row counts): 1.2 ms
        dict(loss, kind="inbatch", n=8192, N=8192, backend="triton", fp32_dot="bf16x6",
             median_s=2.0e-3),
        dict(loss, kind="inbatch", n=8192, N=8192, backend="triton+graph", fp32_dot="bf16x6",
             median_s=1.2e-3),
        # fp16x3: 0.30 ms, faster than predicted: MISSED
        dict(loss, kind="inbatch", n=8192, N=8192, backend="triton+graph", fp32_dot="fp16x3",
             median_s=0.3e-3),
        # the queue's bf16x6 only in tf32x3: not measured
        dict(loss, kind="mq", n=8192, N=65536, backend="triton+graph", fp32_dot="tf32x3",
             median_s=9e-3),
    ])
    ham = dict(engine="cuda", device="cuda:0", bits=128, check="ok (equal to the C++ engine)")
    _write(b / "hamming_gpu.csv", bench_hamming.GPU_FIELDS, [
        dict(ham, method="map_all", queries=10000, gallery=1_000_000, median_s=0.09),
        dict(ham, method="map_all", queries=10000, gallery=1_000_000, median_s=0.05),  # later
        dict(ham, method="topk", queries=1000, gallery=1_000_000, median_s=0.002),
        dict(ham, method="topk", queries=1000, gallery=100_000_000, median_s=0.15,
             check="FAIL: 3 queries differ"),
        dict(ham, engine="triton", method="topk", queries=1000, gallery=100_000_000,
             median_s=0.3),
    ])
    return a, b


def test_verdicts_from_the_two_calls_folders(tmp_path, capsys):
    a, b = _run(tmp_path)
    md = tmp_path / "out.md"
    assert CP.main([str(a), str(b), "--markdown", str(md)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(CP.PREDICTIONS)
    got = [ln.split("  ")[0].strip() for ln in lines]
    assert got == ["HELD", "MISSED", "MISSED", "not measured",       # fold
                   "HELD", "not measured", "MISSED",                 # bf16x6 x2, fp16x3
                   "HELD", "HELD", "not measured"], lines            # CUDA Hamming engine
    assert "measured 40 us, predicted 20 .. 60 us" in lines[0]
    assert "measured 10 %" in lines[2]
    assert "measured 1.2 ms" in lines[4]
    assert "measured 0.05 s" in lines[7]   # the later of two rows
    assert "measured 2 ms" in lines[8]
    table = md.read_text().splitlines()
    assert table[0] == "| what | case | predicted | measured | outcome |"
    assert len(table) == 2 + len(CP.PREDICTIONS)
    assert table[2].endswith("| 40 us | HELD |") and table[-1].endswith("| - | not measured |")


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
    a, b = _run(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in ([str(tmp_path / "missing")], [str(empty)],
                 [str(a), "--markdown", str(a / "host_gpu.csv")]):
        with pytest.raises(SystemExit) as e:
            CP.main(argv)
        assert e.value.code == 2, argv
    err = capsys.readouterr().err
    assert "not a folder" in err and "none of host_gpu.csv" in err and "--overwrite" in err
    (a / "loss_gpu.csv").write_bytes(b"kind,n\n\xff\xfe,1\n")
    with pytest.raises(SystemExit) as e:
        CP.main([str(a)])
    assert e.value.code == 2
