"""bench/train_throughput.py prints one JSON line last; scripts/plot_train_log.py writes a PNG."""
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


@pytest.mark.slow
def test_train_throughput_prints_json_last():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_throughput.py"),
                        "--data", "synthetic:512", "--image-size", "8", "--batch-size", "32",
                        "--method", "nac-mq", "--queue-size", "64", "--steps", "2",
                        "--warmup", "1"], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["method"] == "nac-mq" and res["measured_steps"] == 2
    # img/s and ms/step are one measurement: batch images per step (both rounded to 0.1)
    assert res["img_per_s"] * res["step_ms"] / 1e3 == pytest.approx(32, rel=0.02)
    assert 0 <= res["data_wait"] < 1 and res["world_size"] == 1


@pytest.mark.parametrize("steps,total,windows", [(4, 6, 2), (3, 6, 2)])
def test_train_throughput_aggregates_the_log_exactly(monkeypatch, capsys, steps, total, windows):
    """The figures come from train.py's log: its first record (the warm-up window) is dropped and
    the measured windows are combined as total images / total time (the harmonic mean of the
    windows' rates, not their mean), with the data wait weighted by each window's time.  train.py
    is replaced by a stand-in that writes a known log; --steps is rounded up to whole windows."""
    import types
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import train_throughput as tt
    finally:
        sys.path.pop(0)
    seen = {}
    rates, waits = [100.0, 300.0], [0.1, 0.5]

    def fake_main(argv):
        seen["argv"] = argv
        out = argv[argv.index("--out") + 1]
        recs = [{"step": 2, "img_per_s": 1.0, "data_wait": 0.9}]  # warm-up: must not count
        recs += [{"step": 2 * (i + 2), "img_per_s": v, "data_wait": w}
                 for i, (v, w) in enumerate(zip(rates, waits))]
        with open(os.path.join(out, "log.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"world_size": 1, "image_size": 8, "amp": "off", "channels_last": False,
                       "device": "cpu"}, f)
        return 0

    monkeypatch.setitem(sys.modules, "train", types.SimpleNamespace(main=fake_main))
    monkeypatch.delenv("RANK", raising=False)
    tt.main(["--data", "synthetic:64", "--batch-size", "8", "--warmup", "2",
             "--steps", str(steps)])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    argv = seen["argv"]
    assert argv[argv.index("--max-steps") + 1] == str(total)
    assert argv[argv.index("--log-every") + 1] == "2"
    # two windows of 2 steps x 8 images: 16/100 s + 16/300 s for 32 images
    secs = 16 / 100 + 16 / 300
    assert res["measured_steps"] == 2 * windows == 4
    assert res["img_per_s"] == round(32 / secs, 1) == 150.0
    assert res["data_wait"] == round((0.1 * 16 / 100 + 0.5 * 16 / 300) / secs, 4) == 0.2
    assert res["step_ms"] == round(1000 * secs / 4, 1) == 53.3
    assert (res["world_size"], res["image_size"], res["device"]) == (1, 8, "cpu")


def test_plot_train_log(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "epoch": 0, "loss": 88.7 - 0.01 * s, "lr": 0.1 * s, "img_per_s": 100.0,
             "data_wait": 0.01, "distinct_frac": 1.0, "mean_hamming": 60.0 + s,
             "balance_score": 0.9, "code_sat": 0.05} for s in (1, 2, 3)]
    recs.append(dict(recs[-1], loss=1.0))  # a resumed run repeats step 3: the last one counts
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
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


# the GPU suite's train stage in its CPU mode (bench/gpu_suite.sh stage_train, NAC_FAST_SUITE_CPU=1)
CPU_STAGE = ["--data", "synthetic-device:256", "--arch", "resnet-tiny", "--method", "nac-mq",
             "--batch-size", "32", "--image-size", "16", "--amp", "off", "--queue-size", "128",
             "--warmup", "1", "--steps", "2", "--compile", "--compile-backend", "aot_eager",
             "--anchors", "--budget-s", "150", "--sync-check"]


def _tt():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import train_throughput as tt
    finally:
        sys.path.pop(0)
    return tt


@pytest.mark.slow
def test_train_throughput_cpu_stage(tmp_path):
    """The GPU suite's train stage at toy size on the CPU: train.py compiled (aot_eager) with
    its first step's cost apart, the eager baseline, both supervised anchors (subprocesses) and
    the ceiling, the one-step profile (operators on a CPU run), the host-read check of a whole
    compiled step (PASS), the CSV rows and the table before the JSON."""
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
    e, se, sc = res["eager"], res["supervised_eager"], res["supervised_compiled"]
    assert e["compile"] is False and e["measured_steps"] == 2 and "first_step_s" not in e
    assert se["compile"] is False and sc["compile"] is True and sc["compile_backend"] == "aot_eager"
    assert abs(sc["compile_s"] - (sc["first_step_s"] - sc["step_ms"] / 1000)) <= 0.0056
    # the ceiling is the rounded supervised figure / (8/3), rounded to 0.1: half a unit either way
    # (x / (8/3) and x * 3 / 8 can round a .x5 tie differently in binary floating point)
    assert abs(res["ceiling_img_per_s"] - sc["img_per_s"] * 3 / 8) <= 0.05 + 1e-9
    assert res["pct_of_ceiling"] == round(100 * res["img_per_s"] / res["ceiling_img_per_s"], 1)
    assert 0 < res["elapsed_s"] < 400
    text = prof.read_text()
    assert "top operators by self CPU time" in text and "aten::" in text
    assert any(line.startswith("ceiling = supervised compiled / 2.67") for line in lines)
    import csv
    with open(rows) as f:
        got = list(csv.DictReader(f))
    assert [g["config"] for g in got] == ["nac-mq-defaults", "nac-mq-eager", "supervised-eager",
                                          "supervised-compiled"]
    assert all(g["status"] == "ok" and float(g["img_per_s"]) > 0 for g in got)
    assert float(got[0]["pct_of_ceiling"]) == res["pct_of_ceiling"]


@pytest.mark.slow
def test_train_throughput_sync_check_names_a_planted_host_read(monkeypatch, tmp_path, capsys):
    """A real .item() planted in the step (inside LARS) fails the check on the CPU: exit status
    1, the offending op and the planted line named."""
    from nac_fast.train import lars
    real = lars.trust_ratios

    def reads_the_host(params, updates, tc):
        out = real(params, updates, tc)
        if out:
            out[0].item()  # the planted host read
        return out

    monkeypatch.setattr(lars, "trust_ratios", reads_the_host)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "train.json"
    args = [a for a in CPU_STAGE if a != "--anchors"] + ["--no-anchors", "--no-eager-baseline",
                                                          "--json-out", str(out)]
    with pytest.raises(SystemExit) as exc:
        _tt().main(args)
    assert exc.value.code == 1
    res = json.loads(out.read_text())
    assert res["sync_check"] == "FAIL"
    assert res["sync_offender"] == "host sync: aten._local_scalar_dense.default"
    assert any("test_train_bench.py" in f and "out[0].item()" in f
               for f in res["sync_offender_frames"]), res["sync_offender_frames"]
    assert "eager" not in res and "supervised_eager" not in res
    # train.py's own loader is back: the benchmark's device-data stand-in does not leak
    from nac_fast.train import run as run_mod
    assert run_mod.build_loader.__module__ == "nac_fast.train.run"


def test_device_synthetic_loader_is_deterministic_and_resumes():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from train_throughput import DeviceSyntheticPairLoader
    finally:
        sys.path.pop(0)
    import torch
    ld = DeviceSyntheticPairLoader(64, 8, image_size=6, pool=5, channels_last=True)
    assert len(ld) == 8 and ld.num_images == 64 and ld.in_channels == 3
    ld.set_epoch(1)
    full = list(ld)
    assert len(full) == 8
    v1, v2 = full[0]
    assert v1.shape == (8, 3, 6, 6) and v1.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(v1, v2)
    ld.set_epoch(1, start_batch=5)
    resumed = list(ld)
    assert len(resumed) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(resumed, full[5:]))
    ld.set_epoch(2)
    assert not torch.equal(next(iter(ld))[0], full[0][0])
    with pytest.raises(ValueError, match="pool"):
        DeviceSyntheticPairLoader(64, 8, pool=0)


@pytest.mark.parametrize("syncs", [False, True])
def test_cuda_sync_check_verdict_and_offender(monkeypatch, syncs):
    """check_step's CUDA path with torch.cuda's sync-debug switch simulated (no GPU here), as
    torch behaves: setting the mode warns that it "is a prototype feature" (never an offender),
    and in "warn" / "error" mode a synchronising call warns / raises "called a synchronizing
    CUDA operation" from the line that made it.  A step with such a call: FAIL naming that line
    and, from the "error" run, its frames; else PASS with the notice listed as ignored."""
    import warnings
    import torch
    from nac_fast.train import sync_check
    mode = {"m": "default"}

    def set_mode(m):
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                      "detect all synchronizing operations", UserWarning)
        mode.update(m=m)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def synchronising_op():
        if mode["m"] == "warn":
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        elif mode["m"] == "error":
            raise RuntimeError("called a synchronizing CUDA operation")

    def step():
        if syncs:
            synchronising_op()

    res = sync_check.check_step(step, torch.device("cuda"))
    assert mode["m"] == "default"  # switched back
    assert any("prototype feature" in w for w in res["sync_ignored"])
    if syncs:
        assert res["sync_check"] == "FAIL" and res["sync_offender_count"] == 1
        assert "test_train_bench.py" in res["sync_offender"]
        assert res["sync_offender"].endswith("called a synchronizing CUDA operation")
        assert any("in synchronising_op" in f for f in res["sync_offender_frames"])
    else:
        assert res["sync_check"] == "PASS" and res["sync_offender_count"] == 0
        assert res["sync_offenders"] == [] and "sync_offender" not in res
