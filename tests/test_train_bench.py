"""bench/train_throughput.py prints one JSON line last; bench/plot_train_log.py writes a PNG."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def test_train_throughput_prints_json_last():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_throughput.py"),
                        "--data", "synthetic:512", "--image-size", "8", "--batch-size", "32",
                        "--method", "nac-mq", "--queue-size", "64", "--steps", "2",
                        "--warmup", "1"], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["method"] == "nac-mq" and res["measured_steps"] == 2 and res["img_per_s"] > 0
    assert 0 <= res["data_wait"] < 1 and res["world_size"] == 1


def test_plot_train_log(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "epoch": 0, "loss": 88.7 - 0.01 * s, "lr": 0.1 * s, "img_per_s": 100.0,
             "data_wait": 0.01, "distinct_frac": 1.0, "mean_hamming": 60.0 + s,
             "bit_balance": 0.9, "code_sat": 0.05} for s in (1, 2, 3)]
    recs.append(dict(recs[-1], loss=1.0))  # a resumed run repeats step 3: the last one counts
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import plot_train_log
    finally:
        sys.path.pop(0)
    assert [r["loss"] for r in plot_train_log.read_log(str(run / "log.jsonl"))][-1] == 1.0
    out = tmp_path / "c.png"
    plot_train_log.main([str(run / "log.jsonl"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="not a JSON line"):
        plot_train_log.read_log(str(run / "bad.jsonl"))
