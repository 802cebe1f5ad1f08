"""python -m nac_fast.vae end to end on tiny budgets: the encoder of every train.py checkpoint
kind (nac, nac-mq online and momentum, simclr), report.json's exact fields, the PNGs, exact
resume, the folder policy, and clear errors for bad input.  CPU; the session fixtures train
three 1-step checkpoints (a few seconds each); --init a checkpoint whose encoder holds inf or NaN
is a usage error before anything is written (tests/_eval_run.py's checkpoint, damaged)."""
import json
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint  # noqa: E402
from nac_fast.vae import cli  # noqa: E402
from nac_fast.vae.encoder import load_pretrained_encoder  # noqa: E402

from _eval_run import edited_checkpoint, inf_in_encoder, usage_error  # noqa: E402
from _eval_run import run  # noqa: E402,F401  (the fixture)

TINY = ["--limit-train", "64", "--limit-test", "12", "--batch-size", "16", "--latent-dim", "4",
        "--iwae-k", "6", "--iwae-images", "3", "--iwae-chunk", "3", "--eval-batch-size", "12",
        "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """One tiny train.py checkpoint per method (Fashion-MNIST, resnet-tiny, 1 step)."""
    out = {}
    for method in ("nac", "nac-mq", "simclr"):
        d = tmp_path_factory.mktemp(method)
        assert train.main(["--method", method, "--max-steps", "1", "--batch-size", "32",
                           "--code-dim", "16", "--out", str(d), "--no-progress",
                           "--device", "cpu"]) == 0
        out[method] = str(d / "last.pt")
    return out


def _run(argv):
    return cli.main(argv)


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("method,which", [("nac", "online"), ("nac-mq", "online"),
                                          ("nac-mq", "momentum"), ("simclr", "online")])
def test_encoder_of_every_checkpoint_kind(ckpts, method, which):
    enc, info = load_pretrained_encoder(ckpts[method], which)
    ck = load_checkpoint(ckpts[method])
    state = ck["model" if which == "online" else "momentum_model"]
    assert info["method"] == method and info["which"] == which
    assert (info["arch"], info["in_channels"], info["image_size"]) == ("resnet-tiny", 1, 28)
    for k, v in enc.state_dict().items():
        assert torch.equal(v, state["encoder." + k]), k
    if which == "momentum":  # the EMA model is another set of weights than the online one
        online, _ = load_pretrained_encoder(ckpts[method], "online")
        assert any(not torch.equal(a, b) for a, b in
                   zip(enc.state_dict().values(), online.state_dict().values()))


def test_momentum_of_a_checkpoint_without_one(ckpts):
    for method in ("nac", "simclr"):
        with pytest.raises(ValueError, match="no momentum model"):
            load_pretrained_encoder(ckpts[method], "momentum")


def test_finetune_report_pngs_and_frozen_encoder(ckpts, tmp_path):
    out = tmp_path / "mq_frozen"
    argv = ["--init", ckpts["nac-mq"], "--which", "momentum", "--freeze", "--epochs", "1",
            "--out", str(out)] + TINY
    assert _run(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep) == {"test", "init", "epochs"}
    assert set(rep["test"]) == {"elbo", "iwae", "iwae_k", "kl", "recon"}
    t = rep["test"]
    assert rep["init"] == os.path.abspath(ckpts["nac-mq"]) and rep["epochs"] == 1
    assert isinstance(t["iwae_k"], int) and t["iwae_k"] == 6
    assert t["elbo"] < 0 and t["iwae"] < 0 and t["recon"] < 0 and t["kl"] >= 0
    assert abs(t["elbo"] - (t["recon"] - t["kl"])) < 1e-6 * abs(t["elbo"])
    ev = json.loads((out / "eval.json").read_text())["details"]
    assert ev["iwae_images"] == 3 and ev["test_images"] == 12 and ev["pixels"] == 784
    assert ev["iwae_minus_elbo_subset"] >= 0   # IWAE >= the same samples' ELBO
    # the frozen encoder is the checkpoint's momentum encoder, unchanged, BN statistics included
    enc, _ = load_pretrained_encoder(ckpts["nac-mq"], "momentum")
    vae = load_checkpoint(str(out / "last.pt"), require=cli.STATE_KEYS)["model"]
    for k, v in enc.state_dict().items():
        assert torch.equal(vae["encoder." + k], v), k
    from PIL import Image
    for name in cli.PNGS:
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.mode == "L" and min(im.size) > 28
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert recs[-1]["eval"]["iwae_k"] == 6 and recs[0]["step"] >= 1
    assert all(set(r) >= {"elbo", "kl", "recon", "lr", "img_per_s"} for r in recs[:-1])


def test_finetune_moves_the_pretrained_encoder_at_its_own_lr(ckpts, tmp_path):
    out = tmp_path / "simclr"
    assert _run(["--init", ckpts["simclr"], "--epochs", "1", "--out", str(out)] + TINY) == 0
    ck = load_checkpoint(str(out / "last.pt"), require=cli.STATE_KEYS)
    lrs = {g.get("name"): g["lr"] for g in ck["optimizer"]["param_groups"]}
    assert lrs == {"encoder": 5e-5, "head+decoder": 5e-4}
    enc, _ = load_pretrained_encoder(ckpts["simclr"])
    w = "net.conv1.weight"
    assert not torch.equal(ck["model"]["encoder." + w], enc.state_dict()[w])


def test_exact_resume(tmp_path):
    """4 steps straight == 2 steps, stop, resume for 2: the same weights and the same report."""
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["--init", "random", "--epochs", "1", "--save-every", "100"] + TINY
    assert _run(base + ["--out", str(a)]) == 0
    assert _run(base + ["--out", str(b), "--stop-at-step", "2"]) == 0
    assert not (b / "report.json").exists()
    assert load_checkpoint(str(b / "last.pt"), require=cli.STATE_KEYS)["step"] == 2
    assert _run(base + ["--out", str(b), "--resume"]) == 0
    sa = load_checkpoint(str(a / "last.pt"), require=cli.STATE_KEYS)
    sb = load_checkpoint(str(b / "last.pt"), require=cli.STATE_KEYS)
    assert sa["step"] == sb["step"] == 4
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    ra, rb = ((d / "report.json").read_text() for d in (a, b))
    assert json.loads(ra) == json.loads(rb)


def test_folder_policy(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["--init", "random", "--epochs", "1", "--out", str(out)] + TINY
    assert _run(base + ["--stop-at-step", "1"]) == 0
    assert "unfinished run" in _error(capsys, base)               # needs --resume / --overwrite
    assert _run(base + ["--resume"]) == 0
    report = (out / "report.json").read_text()
    assert "finished run" in _error(capsys, base)                 # never overwritten unasked
    assert (out / "report.json").read_text() == report
    assert _run(base + ["--resume"]) == 0                         # finished: nothing to do
    assert (out / "report.json").read_text() == report
    assert "may be extended, not shortened" not in capsys.readouterr().err
    assert _run(base + ["--overwrite", "--seed", "1"]) == 0       # asked: replaced
    assert (out / "report.json").read_text() != report
    assert "differs from the run's" in _error(capsys, base + ["--resume", "--seed", "2"])


def _fake_checkpoint(path, model_state, **cfg):
    config = {"arch": "resnet-tiny", "in_channels": 1, "image_size": 28, "method": "nac"}
    config.update(cfg)
    torch.save({"model": model_state, "config": config}, path)
    return str(path)


def test_bad_inputs(ckpts, tmp_path, capsys):
    out = str(tmp_path / "x")
    run = ["--epochs", "1", "--out", out] + TINY
    # a checkpoint without an encoder
    head_only = _fake_checkpoint(tmp_path / "head.pt", {"head.0.weight": torch.zeros(2, 2)})
    assert "no encoder weights" in _error(capsys, ["--init", head_only] + run)
    # a file that is not a checkpoint, a missing one, a dict that is not train.py's
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    assert "truncated, corrupt or not a checkpoint" in _error(capsys, ["--init", str(junk)] + run)
    assert "no such file" in _error(capsys, ["--init", str(tmp_path / "none.pt")] + run)
    torch.save({"weights": {}}, tmp_path / "other.pt")
    msg = _error(capsys, ["--init", str(tmp_path / "other.pt")] + run)
    assert "not a train.py checkpoint" in msg
    # encoder weights of another architecture than the config says
    enc, _ = load_pretrained_encoder(ckpts["nac"])
    wrong = _fake_checkpoint(tmp_path / "wrong.pt",
                             {"encoder." + k: v for k, v in enc.state_dict().items()},
                             arch="resnet18-small")
    assert "do not fit a resnet18-small" in _error(capsys, ["--init", wrong] + run)
    # another channel count: RGB data for a grayscale encoder
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    rgb = write_jpeg_folder(str(tmp_path / "rgb"), num_classes=2, per_class=4,
                            size_range=(30, 40))
    assert "3-channel images" in _error(capsys, ["--init", ckpts["nac"], "--data", rgb] + run)
    # another image size: no silent resize
    from nac_fast.train.models import ResNetEncoder
    enc3 = ResNetEncoder("resnet-tiny", 3, 28)
    rgb28 = _fake_checkpoint(tmp_path / "rgb28.pt",
                             {"encoder." + k: v for k, v in enc3.state_dict().items()},
                             in_channels=3)
    msg = _error(capsys, ["--init", rgb28, "--data", rgb] + run)
    # (the folder's natural size: the median short side of its images, 30-40 px)
    assert re.search(r"has 3\d px images", msg) and "--image-size 28" in msg, msg
    msg = _error(capsys, ["--init", ckpts["nac"], "--image-size", "32"] + run)
    assert "trained on 28 px" in msg
    # the momentum model of a method without one, momentum of a random encoder
    assert "no momentum model" in _error(capsys, ["--init", ckpts["simclr"], "--which",
                                                  "momentum"] + run)
    assert "--which momentum needs --init" in _error(capsys, ["--which", "momentum"] + run)
    # a VAE checkpoint is not an encoder checkpoint
    vae_out = tmp_path / "vae"
    assert _run(["--init", "random", "--epochs", "1", "--out", str(vae_out)] + TINY) == 0
    assert "is a VAE checkpoint" in _error(capsys, ["--init", str(vae_out / "last.pt")] + run)
    # --arch against the checkpoint's
    assert "the checkpoint's encoder is a resnet-tiny" in _error(
        capsys, ["--init", ckpts["nac"], "--arch", "resnet18"] + run)
    # numbers
    for flag, v in (("--epochs", "0"), ("--iwae-k", "0"), ("--latent-dim", "0"),
                    ("--lr", "-1"), ("--encoder-lr", "nan"), ("--limit-train", "0")):
        assert flag in _error(capsys, [flag, v, "--out", out] + TINY[:0])
    assert "contradict" in _error(capsys, ["--resume", "--overwrite", "--out", out])
    assert "exceeds the 16 training images" in _error(
        capsys, ["--out", out, "--limit-train", "16", "--batch-size", "32", "--no-progress"])
    assert not os.path.exists(out) or not os.listdir(out)  # nothing written by any of these


def test_frozen_random_encoder_keeps_weights_and_estimates_bn_statistics(tmp_path):
    from nac_fast.vae.model import VAE
    out = tmp_path / "rf"
    assert _run(["--init", "random", "--freeze", "--epochs", "1", "--seed", "3",
                 "--out", str(out)] + TINY) == 0
    torch.manual_seed(3)
    init = VAE("resnet-tiny", 1, 28, latent_dim=4).encoder.state_dict()
    got = load_checkpoint(str(out / "last.pt"), require=cli.STATE_KEYS)["model"]
    for k, v in init.items():
        if "running_" in k or "num_batches" in k:
            continue
        assert torch.equal(got["encoder." + k], v), k          # weights: fixed
    assert not torch.equal(got["encoder.net.bn1.running_mean"], init["net.bn1.running_mean"])


def test_damaged_last_checkpoint_falls_back_to_prev(tmp_path, capsys):
    """A torn last.pt: --resume continues from prev.pt, exactly (same weights as a straight run)."""
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["--init", "random", "--epochs", "1", "--save-every", "1"] + TINY
    assert _run(base + ["--out", str(a)]) == 0
    assert _run(base + ["--out", str(b), "--stop-at-step", "3"]) == 0
    assert load_checkpoint(str(b / "prev.pt"), require=cli.STATE_KEYS)["step"] == 2
    data = (b / "last.pt").read_bytes()
    (b / "last.pt").write_bytes(data[: len(data) // 2])
    assert _run(base + ["--out", str(b), "--resume"]) == 0
    assert "truncated" in capsys.readouterr().err
    sa = load_checkpoint(str(a / "last.pt"), require=cli.STATE_KEYS)["model"]
    sb = load_checkpoint(str(b / "last.pt"), require=cli.STATE_KEYS)["model"]
    assert all(torch.equal(v, sb[k]) for k, v in sa.items())


# ---- regressions of the audit (/tmp/audit_vae/REPORT.md, bugs 1-3, 5-9) ---------------------

@pytest.fixture(scope="module")
def finished_vae(tmp_path_factory):
    """A finished tiny VAE run (1 epoch of 4 steps), copied by the tests that change it."""
    out = tmp_path_factory.mktemp("vae_done") / "run"
    assert _run(["--init", "random", "--epochs", "1", "--out", str(out)] + TINY) == 0
    return out


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _snapshot(d):
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d)) if (d / n).is_file()}


def test_overwrite_refuses_a_folder_that_is_not_a_vae_run(tmp_path, capsys):
    """Bug 1: --overwrite deleted a train.py run (its last.pt, the --init checkpoint) and an
    eval output; the error suggested --overwrite.  Now refused, nothing deleted."""
    trun = tmp_path / "trainrun"
    trun.mkdir()
    _fake_checkpoint(trun / "last.pt", {"encoder.x": torch.zeros(1)})
    (trun / "config.json").write_text(json.dumps({"method": "nac"}))
    (trun / "log.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(trun)
    for extra in ([], ["--overwrite"], ["--resume"]):
        msg = _error(capsys, ["--epochs", "1", "--out", str(trun)] + extra + TINY)
        assert "not a run of python -m nac_fast.vae" in msg, msg
        assert "pass --overwrite" not in msg
        assert _snapshot(trun) == before
    ev = tmp_path / "evalout"
    ev.mkdir()
    (ev / "report.json").write_text("{}")
    assert "not a run of" in _error(capsys, ["--out", str(ev), "--overwrite"] + TINY)
    assert (ev / "report.json").read_text() == "{}"


def test_usage_errors_with_overwrite_delete_nothing(finished_vae, tmp_path, capsys):
    """Bug 2: --overwrite deleted the finished run, then failed on --limit-test / --batch-size."""
    out = _copy(finished_vae, tmp_path / "v")
    before = _snapshot(out)
    base = ["--epochs", "1", "--out", str(out), "--overwrite"] + TINY
    assert "--limit-test 20000" in _error(capsys, base + ["--limit-test", "20000"])
    assert _snapshot(out) == before
    assert "--batch-size 128" in _error(capsys, base + ["--batch-size", "128"])
    assert _snapshot(out) == before


def test_resume_refuses_other_data(tmp_path, monkeypatch, capsys):
    """Bug 3: --data was compared as a string, so a relative path from another folder (or a
    folder whose images changed) resumed on other data."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_image_folder
    for d, n in (("A", 5), ("B", 7)):
        assert make_image_folder.main(["shapes", str(tmp_path / d / "v"), "--per-class", str(n),
                                       "--size", "16"]) == 0
    argv = ["--data", "v", "--epochs", "1", "--batch-size", "8", "--latent-dim", "4",
            "--iwae-k", "2", "--iwae-images", "2", "--iwae-chunk", "2", "--eval-batch-size", "8",
            "--no-progress", "--device", "cpu", "--out", str(tmp_path / "out")]
    monkeypatch.chdir(tmp_path / "A")
    assert _run(argv + ["--stop-at-step", "1"]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["data"] == str(tmp_path / "A" / "v")
    monkeypatch.chdir(tmp_path / "B")
    msg = _error(capsys, argv + ["--resume"])
    assert "--data" in msg and "differs from the run's" in msg, msg


def test_unwritable_out_is_a_usage_error(tmp_path, capsys):
    """Bug 5 (VAE): an --out under a file, or in an unwritable place, gave a traceback."""
    (tmp_path / "afile").write_text("")
    for out in (str(tmp_path / "afile" / "sub"), "/proc/nac_fast_vae_x"):
        msg = _error(capsys, ["--out", out] + TINY)
        assert "--out" in msg and "Traceback" not in msg, msg


def test_overwrite_with_a_folder_named_like_a_run_file(tmp_path, capsys):
    """Bug 6: --overwrite crashed (IsADirectoryError) on a folder named last.pt."""
    (tmp_path / "c" / "last.pt").mkdir(parents=True)
    msg = _error(capsys, ["--epochs", "1", "--out", str(tmp_path / "c"), "--overwrite"] + TINY)
    assert "last.pt" in msg and "not a regular file" in msg, msg
    assert (tmp_path / "c" / "last.pt").is_dir()


def test_seed_out_of_range_is_a_usage_error(tmp_path, capsys):
    """Bug 7: a huge --seed gave a traceback after config.json and log.jsonl were written."""
    out = tmp_path / "s"
    for seed in ("9223372036854775807", "99999999999999999999"):
        assert "--seed" in _error(capsys, ["--seed", seed, "--out", str(out)] + TINY)
    assert not out.exists()


def test_resume_of_a_finished_run_with_other_evaluation_flags_reevaluates(finished_vae, tmp_path,
                                                                          capsys):
    """Bug 8: "nothing to do" although --iwae-k changed; now the run is evaluated again."""
    out = _copy(finished_vae, tmp_path / "v")
    k = TINY.index("--iwae-k")
    argv = ["--init", "random", "--epochs", "1", "--out", str(out), "--resume"]
    assert _run(argv + TINY[:k] + ["--iwae-k", "7"] + TINY[k + 2:]) == 0
    assert "re-evaluat" in capsys.readouterr().out
    assert json.loads((out / "report.json").read_text())["test"]["iwae_k"] == 7
    assert load_checkpoint(str(out / "last.pt"), require=cli.STATE_KEYS)["step"] == 4
    assert _run(argv + TINY[:k] + ["--iwae-k", "7"] + TINY[k + 2:]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_iwae_images_beyond_the_test_split_are_recorded_as_evaluated(finished_vae, tmp_path,
                                                                      capsys):
    """config.json recorded --iwae-images as given, not as evaluated (capped at the test
    images), so a resume with another value above the split evaluated the same subset again."""
    out = _copy(finished_vae, tmp_path / "v")
    k = TINY.index("--iwae-images")
    argv = ["--init", "random", "--epochs", "1", "--out", str(out), "--resume"]
    assert _run(argv + TINY[:k] + ["--iwae-images", "100"] + TINY[k + 2:]) == 0
    assert "re-evaluat" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["iwae_images"] == 12
    assert _run(argv + TINY[:k] + ["--iwae-images", "50"] + TINY[k + 2:]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_resume_with_a_stop_step_already_passed(tmp_path, capsys):
    """Bug 9: --resume --stop-at-step N <= the checkpoint's step trained one more step."""
    out = tmp_path / "ss"
    base = ["--epochs", "1", "--out", str(out)] + TINY
    assert _run(base + ["--stop-at-step", "2"]) == 0
    msg = _error(capsys, base + ["--stop-at-step", "1", "--resume"])
    assert "--stop-at-step 1" in msg and "step 2" in msg, msg
    assert load_checkpoint(str(out / "last.pt"), require=cli.STATE_KEYS)["step"] == 2


def test_vae_init_from_a_diverged_checkpoint_is_a_usage_error(run, tmp_path, capsys):
    """--init a checkpoint whose encoder holds inf / NaN: the run started, wrote config.json and
    log.jsonl and stopped at step 1 with "non-finite loss ... (try a lower --lr)", advice that
    does not help.  Now a usage error naming --init, before anything is written."""
    bad = edited_checkpoint(run[0], tmp_path / "inf.pt", inf_in_encoder)
    out = tmp_path / "v"
    err = usage_error(capsys, cli.main, ["--init", bad, "--data", run[1], "--out", str(out),
                                         "--epochs", "1", "--batch-size", "4",
                                         "--no-progress", "--device", "cpu"])
    assert f"--init {bad!r}" in err and "NaN or inf" in err and "conv1" in err, err
    assert not out.exists()
