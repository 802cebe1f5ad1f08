"""train.py flag checks (clear errors before any work), models, and the per-method losses.

Recipes and flags as a user drives them (an audit): a recipe that cannot be read, a recipe queue
that is not a multiple of the batch, a recipe switch undone by its opposite flag, --seed out of
range, a DALI loader on synthetic data: each a usage error naming the file or the option (exit
status 2, one line, --out left as it was); the steps refuse an x that is not two views."""
import errno
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train.config import UsageError, parse  # noqa: E402
from nac_fast.train.methods import code_stats, nac_mq_step, nac_step, simclr_step  # noqa: E402
from nac_fast.train.models import build_model, swap_halves  # noqa: E402

from _train_main import SMALL, main_captured as _main, refused as _refused  # noqa: E402


def _fails(argv, capsys, match, monkeypatch=None, world=None):
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err, err
    assert err.rstrip().splitlines()[-1].startswith("train.py: exit status 2 ("), err


@pytest.mark.parametrize("argv,match", [
    (["--bogus"], "unrecognized arguments"),
    (["--method", "moco"], "invalid choice"),
    (["--arch", "vgg"], "invalid choice"),
    (["--p", "0.5"], "--p must lie in (0, 0.5)"),               # the flag as typed
    (["--flip-prob", "0.5"], "--flip-prob must lie in (0, 0.5)"),
    (["--flip-prob=0"], "--flip-prob must lie in (0, 0.5)"),
    (["--flip-prob-final", "0.5"], "--flip-prob-final must lie in (0, 0.5)"),
    (["--flip-prob-final=-0.1"], "--flip-prob-final must lie in (0, 0.5)"),
    (["--flip-prob-final-min-images", "0"], "--flip-prob-final-min-images must be >= 1"),
    (["--flip-prob-final-min-images", "1.5"],
     "--flip-prob-final-min-images: invalid integer or 'none' value: '1.5'"),
    (["--flip-prob-final-min-steps", "x"],
     "--flip-prob-final-min-steps: invalid integer or 'none' value: 'x'"),
    (["--flip-prob-final", "0.3x"], "--flip-prob-final: invalid number or 'none' value"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--method", "nac-mq", "--batch-size", "64", "--queue-size", "100"],
     "--queue-size 100 must be a multiple of the global batch 64"),
    (["--method", "nac-mq", "--batch-size", "64", "--queue-size", "64"],
     "must hold at least the two views"),
    (["--momentum", "1.0"], "--momentum (EMA decay) must lie in [0, 1)"),
    (["--sync-bn"], "--sync-bn needs several processes"),
    (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs a GPU"),
    (["--data", "/nonexistent/imagenet"], "no such file or directory"),
    (["--data", "synthetic:16", "--batch-size", "32"], "larger than the data set (16 images)"),
    (["--data", "synthetic:64", "--batch-size", "32", "--epochs", "1", "--min-steps", "1",
      "--warmup-epochs", "3"],
     "longer than the run"),
])
def test_bad_flags(argv, match, capsys, tmp_path):
    _fails(argv + ["--out", str(tmp_path)], capsys, match)
    assert not (tmp_path / "last.pt").exists()


def test_batch_not_divisible_by_world(capsys, monkeypatch, tmp_path):
    _fails(["--batch-size", "33", "--out", str(tmp_path)], capsys,
           "not divisible by the world size 2", monkeypatch, world=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="SyncBN works on GPUs")
def test_sync_bn_needs_cuda(capsys, monkeypatch, tmp_path):
    _fails(["--sync-bn", "--out", str(tmp_path)], capsys, "--sync-bn needs CUDA", monkeypatch,
           world=2)


def test_missing_fashion_mnist_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    from nac_fast.data.sources import fashion_mnist
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", str(tmp_path / "none"))
    monkeypatch.delenv("NAC_FASHION_MNIST_DIR", raising=False)
    _fails(["--out", str(tmp_path)], capsys, "apt-get install dataset-fashion-mnist")


def test_empty_data_dir(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert train.main(["--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "--data" in capsys.readouterr().err


def test_resume_without_checkpoint_file(capsys, tmp_path):
    _fails(["--data", "synthetic:64", "--batch-size", "32", "--image-size", "8",
            "--out", str(tmp_path), "--resume", str(tmp_path / "nope.pt")], capsys,
           "no such checkpoint")


def test_model_stems_and_dims():
    m = build_model("resnet-tiny", in_channels=1, image_size=28, code_dim=16)
    conv1 = m.encoder.net.conv1
    assert conv1.kernel_size == (3, 3) and conv1.stride == (1, 1) and conv1.in_channels == 1
    assert isinstance(m.encoder.net.maxpool, torch.nn.Identity)
    h, a, r = m(torch.randn(4, 1, 28, 28))
    assert h.shape == (4, 128) and a.shape == (4, 16) and r.shape == (4, 16)
    big = build_model("resnet18", in_channels=3, image_size=224)
    assert big.encoder.net.conv1.kernel_size == (7, 7) and big.encoder.net.conv1.stride == (2, 2)
    assert not isinstance(big.encoder.net.maxpool, torch.nn.Identity)
    assert build_model("resnet50", 3, 32).feature_dim == 2048
    assert build_model("resnet18-small", 1, 32).feature_dim == 256
    assert build_model("resnet-tiny", 1, 28, inference_net=False).infer is None
    with pytest.raises(ValueError, match="arch"):
        build_model("resnet7", 3, 32)
    with pytest.raises(ValueError, match="in_channels"):
        build_model("resnet18", 0, 32)


def test_cross_pathway_and_scaling():
    torch.manual_seed(0)
    m = build_model("resnet-tiny", 1, 8, code_dim=8).eval()
    x = torch.randn(6, 1, 8, 8)
    h, a, r = m(x)
    # r of view-1 rows comes from h of view 2 and vice versa
    torch.testing.assert_close(r, m.infer(swap_halves(h)) / math.sqrt(8))
    torch.testing.assert_close(a, m.head(h) / math.sqrt(8))
    u = build_model("resnet-tiny", 1, 8, code_dim=8, scale_codes=False)
    assert u.scale == 1.0


def test_code_stats_hand_example():
    a = torch.tensor([[1.0, 1.0, -1.0, 2.0],
                      [1.0, 1.0, -1.0, 2.0],
                      [-1.0, 1.0, 1.0, -2.0]])
    st = code_stats(a)
    assert st["distinct_frac"] == pytest.approx(2 / 3)
    # distances: d01 = 0, d02 = 3, d12 = 3 -> mean over ordered pairs i != j = 12/6
    assert st["mean_hamming"] == pytest.approx(2.0)
    # q = [2/3, 1, 1/3, 2/3] -> |2q-1| = [1/3, 1, 1/3, 1/3] -> 1 - 0.5 = 0.5
    assert st["balance_score"] == pytest.approx(0.5)
    assert st["code_sat"] == pytest.approx(float(torch.tanh(a).abs().mean()))


def test_simclr_matches_nt_xent_formula():
    torch.manual_seed(0)
    m = build_model("resnet-tiny", 1, 8, code_dim=8, inference_net=False).eval()
    x = torch.randn(6, 1, 8, 8)
    loss, a = simclr_step(m, x, tau=0.5)
    u = F.normalize(a.detach(), dim=1)
    n, k = 6, 3
    total = 0.0
    for i in range(n):
        pos = (i + k) % n
        den = sum(math.exp(float(u[i] @ u[j]) / 0.5) for j in range(n) if j != i)
        total += -(float(u[i] @ u[pos]) / 0.5 - math.log(den))
    assert float(loss.detach()) == pytest.approx(total / n, rel=1e-5)


def test_nac_step_equals_loss_on_own_codes():
    import nac_fast
    torch.manual_seed(0)
    m = build_model("resnet-tiny", 1, 8, code_dim=8).eval()
    x = torch.randn(6, 1, 8, 8)
    noise = nac_fast.draw_noise((6, 8), 0.1)
    loss, a = nac_step(m, x, 0.1, noise=noise)
    _, a2, r2 = m(x)
    ref = nac_fast.nac_loss(a2, r2, 0.1, noise=noise, backend="reference")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def test_imagefolder_defaults_and_run(tmp_path):
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    root = tmp_path / "imnet"
    write_jpeg_folder(str(root / "train"), num_classes=2, per_class=8, size_range=(40, 60))
    from nac_fast.train.config import parse
    a = parse(["--data", str(root)])
    # 16 images of 40-60 px: small data, whatever the file format (auto_recipe); the recipe's
    # batch of 256 halved to 4, a quarter of the images (fit_batch), and the start line says why
    assert os.path.basename(a.recipe) == "small.toml" and (a.batch_size, a.epochs) == (4, 2)
    assert a.batch_note == ("the recipe's 256 halved to a quarter of the 16 training images or "
                            "less; --batch-size sets it")
    assert parse(["--data", str(root), "--batch-size", "16"]).batch_size == 16  # typed: kept
    out = tmp_path / "o"
    assert train.main(["--data", str(root), "--image-size", "32", "--batch-size", "8",
                       "--max-steps", "2", "--loader", "torchvision", "--workers", "0",
                       "--no-progress", "--out", str(out)]) == 0
    cfg = __import__("json").loads((out / "config.json").read_text())
    assert cfg["in_channels"] == 3 and cfg["image_size"] == 32 and cfg["num_images"] == 16


def test_a_recipe_batch_fits_the_data():
    """fit_batch: halved while more than a quarter of the images, staying a multiple of the
    world size; Fashion-MNIST keeps the recipe's batch."""
    from nac_fast.train.config import fit_batch, parse
    assert fit_batch(256, 60_000, 1) == 256 and fit_batch(256, 1024, 2) == 256
    assert fit_batch(256, 1023, 2) == 128 and fit_batch(256, 60, 1) == 8
    assert fit_batch(256, 3, 1) == 1 and fit_batch(256, 3, 2) == 2 and fit_batch(96, 10, 3) == 3
    assert fit_batch(100, 10, 1) == 25  # odd: halving stops
    assert fit_batch(256, 0, 1) == 1
    for args, name in (((0, 10, 1), "batch"), ((256, 10, 0), "world"), ((256, -1, 1), "num_images"),
                       ((2.0, 10, 1), "batch")):
        with pytest.raises(ValueError, match=name):
            fit_batch(*args)
    a = parse([])
    assert a.batch_size == 256 and a.batch_note is None


def test_flags_reach_train_py_through_torchrun():
    """torchrun parses its own flags by prefix even after the script name: a train.py flag that
    is a prefix of a torchrun flag is taken by torchrun (torch 2.14: "--p" -> ambiguous with
    --print-completion).  Only --p may clash, and its alias --flip-prob must get through."""
    from torch.distributed.run import get_args_parser

    from nac_fast.train.config import build_parser, parse
    runner = [s for a in get_args_parser()._actions for s in a.option_strings]
    ours = list(build_parser().option_dest)
    clash = sorted(o for o in ours if any(t.startswith(o) for t in runner))
    assert set(clash) <= {"--p", "--help"}, clash
    ns = get_args_parser().parse_args(["--standalone", "--nproc_per_node=2", "train.py",
                                       "--flip-prob", "0.3", "--method", "nac-mq"])
    assert ns.training_script == "train.py"
    assert ns.training_script_args == ["--flip-prob", "0.3", "--method", "nac-mq"]
    assert parse(ns.training_script_args).flip_prob == 0.3


# ---- audit regressions: non-finite floats, synthetic:N, --image-size (typed and read) ----

@pytest.mark.parametrize("flag,value", [("--wd", "nan"), ("--warmup-epochs", "inf"),
                                        ("--lr", "inf"), ("--tau", "inf"), ("--wd", "inf"),
                                        ("--collapse-warn", "nan")])
def test_non_finite_float_flags_are_refused(flag, value, capsys, tmp_path):
    _fails(["--data", "synthetic:64", "--batch-size", "4", "--max-steps", "1", flag, value,
            "--out", str(tmp_path / "o")], capsys, f"{flag} must be a finite number")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("data,match", [("synthetic:abc", "'abc'"), ("synthetic:0", "got 0")])
def test_bad_synthetic_count_names_data(data, match, capsys, tmp_path):
    _fails(["--data", data, "--batch-size", "4", "--max-steps", "1", "--no-progress",
            "--out", str(tmp_path / "o")], capsys, f"--data '{data}': synthetic[:N]")


def test_typed_image_size_below_8_names_the_flag(capsys, tmp_path):
    _fails(["--data", "synthetic:64", "--batch-size", "4", "--max-steps", "1",
            "--image-size", "4", "--out", str(tmp_path / "o")], capsys,
           "--image-size must be >= 8, got 4")


def test_images_below_8_px_exit_2_naming_image_size(capsys, tmp_path):
    from PIL import Image
    root = tmp_path / "tiny"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (7, 5), (40 * i, 90, 200)).save(root / c / f"{i}.png")
    _fails(["--data", str(root), "--batch-size", "4", "--max-steps", "1", "--loader",
            "torchvision", "--no-progress", "--out", str(tmp_path / "o")], capsys,
           "--image-size must be >= 8, got 5 (read from --data")


# ---- recipes that cannot be read -----------------------------------------------------------------

def test_a_recipe_that_is_not_utf8_is_a_usage_error(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"batch_size = 32\n# caf\xe9\n")
    with pytest.raises(UsageError, match=r"--config '.*latin1\.toml': not valid TOML"):
        parse(["--config", str(bad)])


def test_an_unreadable_recipe_is_a_usage_error(tmp_path, monkeypatch):
    recipe = tmp_path / "locked.toml"
    recipe.write_text("batch_size = 32\nepochs = 1\n")
    real_open = open

    def deny(f, *a, **k):  # tests run as root here, where chmod does not stop reads
        if str(f) == str(recipe):
            raise PermissionError(errno.EACCES, "Permission denied", str(f))
        return real_open(f, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(UsageError, match=r"--config '.*locked\.toml' cannot be read: "
                                         r".*Permission denied"):
        parse(["--config", str(recipe)])


# ---- what the recipes say of their numeric queue ------------------------------------------------

@pytest.mark.parametrize("name", ["cifar10.toml", "imagenet.toml", "imagenet_nac_mq.toml"])
def test_a_recipe_queue_is_a_multiple_of_the_batch_as_its_comment_says(name):
    """A recipe's queue_size of a number is held to the rule of a typed --queue-size (a
    multiple of the global batch, error naming the recipe key), not rounded down to one: the
    recipe's own comment must not promise the rounding."""
    path = os.path.join(ROOT, "configs", name)
    with open(path) as f:
        line = next(ln for ln in f if ln.startswith("queue_size"))
    assert "rounded down" not in line, line
    with pytest.raises(UsageError, match=rf"queue_size \(recipe .*{name}\) \d+ must be a "
                                         "multiple of the global batch 768"):
        parse(["--config", path, "--method", "nac-mq", "--data", "synthetic:4096",
               "--batch-size", "768"])


# ---- every switch a recipe sets can be undone on the command line --------------------------------

def test_a_recipe_switch_is_undone_by_its_opposite_flag(tmp_path):
    """Bug: --sync-bn, --tensorboard, --no-shuffle-bn, --no-scale-codes and --no-progress had no
    opposite, so a recipe that set them could not be overridden although "any flag given
    wins"."""
    recipe = tmp_path / "r.toml"
    recipe.write_text("sync_bn = true\ntensorboard = true\nshuffle_bn = false\n"
                      "scale_codes = false\nprogress = false\n")
    base = ["--config", str(recipe), "--data", "synthetic:64", "--batch-size", "16",
            "--max-steps", "2"]
    cfg = parse(base + ["--no-sync-bn", "--no-tensorboard", "--shuffle-bn", "--scale-codes",
                        "--progress"])
    assert (cfg.sync_bn, cfg.tensorboard, cfg.shuffle_bn, cfg.scale_codes, cfg.progress) == (
        False, False, True, True, True)
    cfg = parse(base + ["--no-sync-bn", "--no-tensorboard"])   # the recipe's values otherwise
    assert (cfg.shuffle_bn, cfg.scale_codes, cfg.progress) == (False, False, False)
    with pytest.raises(UsageError, match=r"sync_bn \(recipe .*r\.toml\) needs several"):
        parse(base + ["--no-tensorboard"])
    cfg = parse(["--data", "synthetic:64", "--batch-size", "16", "--max-steps", "2",
                 "--no-shuffle-bn", "--no-scale-codes", "--no-progress"])  # the old spellings
    assert (cfg.shuffle_bn, cfg.scale_codes, cfg.progress) == (False, False, False)


# ---- --seed: its range, and the synthetic loader at a large one ----------------------------------

@pytest.mark.parametrize("seed", [-1, 2**32, 2**62])
def test_a_seed_out_of_range_is_a_usage_error(tmp_path, seed):
    """Bug: --seed 2**62 died in torch.manual_seed(seed * 1000 + rank) with "Overflow when
    unpacking long long" (a traceback), after the start line."""
    out = str(tmp_path / "run")
    _refused(SMALL + ["--max-steps", "1", "--seed", str(seed), "--out", out], out, "--seed",
             "[0, 4294967295]")
    assert not os.path.exists(out)


def test_the_largest_seed_trains_on_synthetic_data(tmp_path):
    """Bug: from --seed ~1.2e9 the synthetic loader's derived seeds ((seed * 7919 + epoch) *
    1000003 + i) * 2 + v overflowed torch's 64 bits, and the error blamed --data.  They are
    reduced mod 2**64 beyond that range; smaller ones are unchanged (the same images)."""
    from nac_fast.data.sources.synthetic_pairs import SyntheticPairLoader, _fit
    status, _, err = _main(SMALL + ["--max-steps", "1", "--seed", str(2**32 - 1),
                                    "--out", str(tmp_path / "run")])
    assert status == 0, err
    assert _fit(12345) == 12345 and _fit(-5) == -5 and _fit(2**64 + 7) == 7
    small = SyntheticPairLoader(num_images=16, batch_size=8, seed=3, image_size=8)
    first = next(iter(small))
    ref = torch.Generator().manual_seed(3 * 31 + 0)   # the formula as it was
    order = torch.randperm(16, generator=ref)
    assert torch.equal(first[0][0], small._view(small._image(int(order[0])), int(order[0]), 0))


# ---- a loader the data cannot use ----------------------------------------------------------------

@pytest.mark.parametrize("loader", ["dali-cpu", "dali-gpu"])
def test_a_dali_loader_on_synthetic_data_is_refused(tmp_path, loader):
    """--loader dali-gpu on synthetic data was silently ignored (the in-memory pairs were used),
    while an in-memory data set refuses a DALI loader by name."""
    out = str(tmp_path / "run")
    _refused(SMALL + ["--max-steps", "1", "--loader", loader, "--out", out], out, "--loader",
             loader, "in memory")


# ---- the steps' x: the two views, concatenated ---------------------------------------------------

@pytest.mark.parametrize("rows", [1, 3, 5])
def test_steps_refuse_an_x_that_is_not_two_views(rows):
    x = torch.randn(rows, 1, 8, 8)
    torch.manual_seed(0)
    simclr = build_model("resnet-tiny", 1, 8, code_dim=8, inference_net=False)
    nac = build_model("resnet-tiny", 1, 8, code_dim=8, inference_net=True)
    with pytest.raises(ValueError, match="x must be cat"):
        simclr_step(simclr, x)   # before: a loss with the wrong positives
    with pytest.raises(ValueError, match="x must be cat"):
        nac_step(nac, x, 0.1)
    with pytest.raises(ValueError, match="x must be cat"):
        nac_mq_step(None, x)
