"""Issue 16: the head options that keep NAC's codes from collapsing, the learning statistics of the
training log (JSONL and TensorBoard), the collapse warning, and the recipes: the default (the
'learning' heads since docs/results.md measured them), the paper-faithful one and the named
'learning' one, each one --config away."""
import json
import math
import os
import sys
import types

import numpy as np

import pytest
import torch

import train
from nac_fast.ops.loss import nac_loss, nac_mq_loss, nac_vi_loss
from nac_fast.train.config import CONFIG_DIR, parse
from nac_fast.train.methods import (collapse_warning, learning_stats, nac_step, simclr_step,
                                    zero_code_loss)
from nac_fast.train.models import (A_GAIN_BN, build_model, model_kwargs_from_config,
                                   resolve_r_gain, swap_halves)
from nac_fast.train.monitor import RunLog

D = 16
BN_HEADS = dict(head_bn=True, infer_bn=True, a_gain=3.0, r_gain="auto", infer_init="copy", p=0.1)
SMALL = ["--data", "synthetic:64", "--image-size", "8", "--batch-size", "16", "--code-dim",
         str(D), "--no-progress", "--log-every", "1", "--save-every", "100"]


def _model(**kw):
    torch.manual_seed(0)
    return build_model("resnet-tiny", 1, 8, D, **kw)


def _recipe(name):
    return os.path.join(CONFIG_DIR, name + ".toml")


def _lstsq_slope(z, r):
    """The slope of r on z over all rows and bits with one intercept per bit, by numpy's least
    squares on the design [z, one-hot(bit)] (independent of learning_stats' closed form)."""
    z, r = np.asarray(z, dtype=np.float64), np.asarray(r, dtype=np.float64)
    n, d = z.shape
    design = np.concatenate([z.reshape(-1, 1), np.tile(np.eye(d), (n, 1))], axis=1)
    coef, *_ = np.linalg.lstsq(design, r.reshape(-1), rcond=None)
    return float(coef[0])


def _log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- the model options ---------------------------------------------------------------------

def test_bn_heads_end_in_batchnorm_and_have_the_documented_scales():
    m = _model(**BN_HEADS).train()
    for net in (m.head, m.infer):
        assert isinstance(net[-1], torch.nn.BatchNorm1d) and not net[-1].affine
    x = torch.randn(32, 1, 8, 8)
    h, a, r = m(x)
    assert a.shape == r.shape == (32, D) and h.shape == (32, m.feature_dim)
    # BN(affine=False) -> unit variance per bit; a = BN * 3 / sqrt(D), r = BN * 2(1-2p) 3 / sqrt(D)
    torch.testing.assert_close(a.std(0, unbiased=False), torch.full((D,), 3 / math.sqrt(D)),
                               rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(a.mean(0), torch.zeros(D), rtol=0, atol=1e-5)
    r_gain = 2 * (1 - 2 * 0.1) * A_GAIN_BN
    assert m.options["r_gain"] == pytest.approx(r_gain) and resolve_r_gain("auto", 3.0, 0.4) == \
        pytest.approx(2 * 0.2 * 3)
    torch.testing.assert_close(r.std(0, unbiased=False),
                               torch.full((D,), r_gain / math.sqrt(D)), rtol=1e-3, atol=1e-3)
    # copy-init: phi = g at step 0, so r_i = (r_gain / a_gain) x a of row i's partner, exactly
    torch.testing.assert_close(r, (r_gain / 3.0) * swap_halves(a), rtol=1e-5, atol=1e-6)
    # no learnable gains unless asked; the paper heads are the plain MLPs
    assert m.a_gain.weight is None and m.r_gain.weight is None
    p = _model()
    assert len(p.head) == 3 and len(p.infer) == 3 and p.options["a_gain"] == 1.0
    assert not torch.equal(p.infer[2].weight, p.head[2].weight)


def test_end_bn_outputs_are_standardised_per_bit_in_train_mode():
    m = _model(**BN_HEADS).train()
    h = torch.randn(64, m.feature_dim) * 5 + 3  # any scale and offset
    for net in (m.head, m.infer):
        y = net(h)  # the BatchNorm1d(affine=False) output, before the gain and the 1/sqrt(D)
        torch.testing.assert_close(y.mean(0), torch.zeros(D), rtol=0, atol=1e-5)
        # BatchNorm normalises by the biased variance (+ eps = 1e-5)
        torch.testing.assert_close(y.var(0, unbiased=False), torch.full((D,), 1.0), rtol=0,
                                   atol=1e-3)
    # the paper's heads do not standardise: the same input gives other moments
    y = _model().train().head(h).detach()
    assert float((y.var(0, unbiased=False) - 1).abs().max()) > 0.1


def test_copy_init_makes_the_inference_net_equal_the_code_head():
    m = _model(**BN_HEADS)
    heads = [(n, t) for n, t in m.head.state_dict().items()]
    infer = m.infer.state_dict()
    assert [n for n, _ in heads] == list(infer)  # same layers, BatchNorm buffers included
    for name, t in heads:
        assert torch.equal(infer[name], t), name
    assert m.infer[0].weight.data_ptr() != m.head[0].weight.data_ptr()  # copies, not shared
    ind = _model(**dict(BN_HEADS, infer_init="independent"))
    assert not torch.equal(ind.infer[0].weight, ind.head[0].weight)
    assert not torch.equal(ind.infer[2].weight, ind.head[2].weight)


def test_learnable_gains_and_checkpoint_round_trip():
    m = _model(**BN_HEADS, learn_gain=True)
    torch.testing.assert_close(m.a_gain.weight.detach(), torch.full((D,), 3.0))
    torch.testing.assert_close(m.r_gain.weight.detach(), torch.full((D,), 4.8))
    cfg = dict(arch="resnet-tiny", in_channels=1, image_size=8, code_dim=D, method="nac",
               scale_codes=True, flip_prob=0.1,
               **{k: v for k, v in BN_HEADS.items() if k != "p"}, learn_gain=True, bn_per_view=False)
    m2 = build_model(**model_kwargs_from_config(cfg))
    m2.load_state_dict(m.state_dict())  # the same modules, parameters and buffers
    # a config without the head options is not one of this train.py: refused, naming them
    old = {k: cfg[k] for k in ("arch", "in_channels", "image_size", "code_dim", "method",
                               "scale_codes", "flip_prob")}
    with pytest.raises(ValueError, match="no head_bn, infer_bn, a_gain"):
        model_kwargs_from_config(old)
    with pytest.raises(ValueError, match="r_gain"):
        resolve_r_gain("big", 3.0, 0.1)
    with pytest.raises(ValueError, match="infer_init"):
        _model(infer_init="tied")


def test_bn_per_view_normalises_each_view_separately():
    m = _model(head_bn=True, bn_per_view=True).train()
    x = torch.randn(16, 1, 8, 8)
    _, a, _ = m(x)
    torch.testing.assert_close(a[:8].mean(0), torch.zeros(D), rtol=0, atol=1e-5)
    torch.testing.assert_close(a[8:].mean(0), torch.zeros(D), rtol=0, atol=1e-5)


def test_frozen_codes_train_only_the_inference_network():
    m = _model(**BN_HEADS)
    loss, _ = nac_step(m, torch.randn(16, 1, 8, 8), 0.1, backend="reference", freeze_codes=True)
    loss.backward()
    assert all(p.grad is None for p in list(m.encoder.parameters()) + list(m.head.parameters()))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.infer.parameters())


# ---- the learning statistics ---------------------------------------------------------------

def test_learning_stats_on_a_known_case():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, D, generator=g, dtype=torch.float64)
    z = torch.tanh(a)
    r = 1.7 * z + torch.linspace(-1, 1, D, dtype=torch.float64)  # exactly linear in z, one intercept per bit
    st = learning_stats(a, r, loss=88.0, zero_loss=D * math.log(2))
    assert st["r_slope"] == pytest.approx(1.7, rel=1e-9)
    assert st["code_mag"] == pytest.approx(float(z.abs().mean()), rel=1e-6)
    assert st["r_mag"] == pytest.approx(float(r.abs().mean()), rel=1e-6)
    assert st["loss_excess"] == pytest.approx(88.0 - D * math.log(2))
    assert learning_stats(torch.zeros(4, D), torch.ones(4, D))["r_slope"] is None
    assert set(learning_stats(a, None)) == {"code_mag"}


def test_gain_stats_are_the_learnable_gains_means():
    from nac_fast.train.methods import gain_stats
    from nac_fast.train.models import build_model
    m = build_model("resnet-tiny", 1, 28, code_dim=16, head_bn=True, infer_bn=True, a_gain=6.0,
                    r_gain=3.0, learn_gain=True)
    assert gain_stats(m) == {"a_gain": pytest.approx(6.0), "r_gain": pytest.approx(3.0)}
    with torch.no_grad():
        m.a_gain.weight.copy_(torch.linspace(1.0, 3.0, 16))
    assert gain_stats(m)["a_gain"] == pytest.approx(2.0)
    # fixed gains and the paper's heads log none
    assert gain_stats(build_model("resnet-tiny", 1, 28, code_dim=16, a_gain=6.0)) == {}
    assert gain_stats(build_model("resnet-tiny", 1, 28, code_dim=16)) == {}


def test_r_slope_is_the_least_squares_fit_with_one_intercept_per_bit():
    g = torch.Generator().manual_seed(1)
    a = 0.3 * torch.randn(200, D, generator=g, dtype=torch.float64)
    # r: partly linear in z with per-bit offsets, plus noise, plus a per-bit scale that differs
    # (the pooled slope is not any one bit's slope)
    scale = torch.linspace(0.5, 2.5, D, dtype=torch.float64)
    r = scale * torch.tanh(a) + torch.randn(D, generator=g, dtype=torch.float64) + \
        0.2 * torch.randn(200, D, generator=g, dtype=torch.float64)
    st = learning_stats(a, r)
    want = _lstsq_slope(torch.tanh(a), r)
    assert st["r_slope"] == pytest.approx(want, rel=1e-9)
    assert 0.5 < want < 2.5
    # one intercept per bit matters: with a single global intercept the fit differs
    zf, rf = torch.tanh(a).reshape(-1).numpy(), r.reshape(-1).numpy()
    global_fit = np.polyfit(zf, rf, 1)[0]
    assert abs(global_fit - want) > 1e-3


def test_zero_code_values_are_the_losses_at_zero_codes():
    n, z0, r0 = 12, torch.zeros(12, D), torch.zeros(12, D)
    assert float(nac_loss(z0, r0, 0.1, backend="reference")) == pytest.approx(
        zero_code_loss("nac", D, n // 2), rel=1e-6)
    queue = torch.tanh(torch.randn(48, D))  # any keys: the queries are 0
    total = nac_mq_loss(z0, r0, queue, 0.1, backend="reference") + nac_vi_loss(z0, r0, 0.1)
    assert float(total) == pytest.approx(zero_code_loss("nac-mq", D, n // 2), rel=1e-6)
    # r != 0 at zero codes costs sum_d log cosh(r/2) > 0: D ln 2 is the minimum over r
    assert float(nac_loss(z0, torch.full((n, D), 0.5), 0.1, backend="reference")) > \
        zero_code_loss("nac", D, n // 2)

    class Const(torch.nn.Module):  # SimCLR with every embedding equal
        def forward(self, x, with_r=True):
            return None, torch.ones(x.shape[0], D), None
    loss, _ = simclr_step(Const(), torch.zeros(n, 1), tau=0.5)
    assert float(loss) == pytest.approx(zero_code_loss("simclr", D, n // 2), rel=1e-6)
    with pytest.raises(ValueError, match="method"):
        zero_code_loss("moco", D, 8)


def test_collapse_warning_rule():
    assert collapse_warning(100, 50, {"code_mag": 0.004}, 0.05).startswith(
        "warning: the codes are collapsing to zero: mean |tanh a| = 0.0040 at step 100")
    assert collapse_warning(40, 50, {"code_mag": 0.004}, 0.05) is None    # in the warm-up
    assert collapse_warning(100, 50, {"code_mag": 0.2}, 0.05) is None     # healthy
    assert collapse_warning(100, 50, {"code_mag": 0.004}, 0.0) is None    # disabled


def test_log_records_the_statistics_and_warns_once_on_collapse(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "paper")
    seen = []  # the (a, r) rows each log point's statistics were computed from
    real = train.learning_stats

    def spy(a, r, *args, **kw):
        seen.append((a.detach().double().clone(), r.detach().double().clone()))
        return real(a, r, *args, **kw)
    monkeypatch.setattr(train, "learning_stats", spy)
    # the paper heads with tiny codes (a gain 1e-3): collapsed from the start
    argv = SMALL + ["--config", _recipe("fashion_mnist_paper"), "--a-gain", "1e-3",
                    "--max-steps", "3", "--out", out]
    assert train.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("warning: the codes are collapsing") == 1
    assert "--head-bn --infer-bn" in err and "configs/small.toml" in err
    recs = _log(out)
    assert [r["step"] for r in recs] == [1, 2, 3] and len(seen) == 3
    for rec, (a, r) in zip(recs, seen):
        assert {"code_mag", "r_mag", "r_slope", "loss_excess", "balance_score"} <= set(rec)
        assert rec["loss_excess"] == pytest.approx(rec["loss"] - D * math.log(2), abs=1e-9)
        assert rec["code_mag"] < 0.01
        # the logged figures are those of the step's view-1 rows (one per image of the batch)
        assert a.shape == r.shape == (16, D)
        assert rec["code_mag"] == pytest.approx(float(torch.tanh(a).abs().mean()), rel=1e-9)
        assert rec["r_mag"] == pytest.approx(float(r.abs().mean()), rel=1e-9)
        assert rec["r_slope"] == pytest.approx(_lstsq_slope(torch.tanh(a), r), rel=1e-6)
        assert 0.0 <= rec["balance_score"] <= 1.0
        assert "a_gain" not in rec and "r_gain" not in rec  # the paper's heads: fixed gains


def test_learning_recipe_does_not_warn(tmp_path, capsys):
    out = str(tmp_path / "learning")
    argv = SMALL + ["--config", _recipe("fashion_mnist_learning"), "--max-steps", "3",
                    "--out", out]
    assert train.main(argv) == 0
    assert "collapsing" not in capsys.readouterr().err
    recs = _log(out)
    assert all(r["code_mag"] > 0.1 for r in recs)  # a = BN * 3 / sqrt(16): |tanh a| ~ 0.5


def test_collapse_warning_waits_for_the_lr_warm_up(tmp_path, capsys):
    # collapsed codes from step 1, lr warm-up 3 steps (0.75 epochs of 64 images / 16): the
    # warning comes at step 3, the warm-up's end, not before, and once
    out = str(tmp_path / "warm")
    argv = SMALL + ["--config", _recipe("fashion_mnist_paper"), "--a-gain", "1e-3",
                    "--max-steps", "5", "--warmup-epochs", "0.75", "--out", out]
    assert train.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("collapsing") == 1 and "at step 3 " in err
    assert all(r["code_mag"] < 0.01 for r in _log(out))
    # --collapse-warn 0 silences it
    out = str(tmp_path / "off")
    argv = SMALL + ["--config", _recipe("fashion_mnist_paper"), "--a-gain", "1e-3",
                    "--max-steps", "3", "--collapse-warn", "0", "--out", out]
    assert train.main(argv) == 0
    assert "collapsing" not in capsys.readouterr().err


def test_nac_mq_log_excess_is_over_two_d_ln2(tmp_path, capsys):
    out = str(tmp_path / "mq")
    argv = SMALL + ["--config", _recipe("fashion_mnist_paper"), "--method", "nac-mq",
                    "--max-steps", "2", "--out", out]
    assert train.main(argv) == 0
    for rec in _log(out):
        assert rec["loss_excess"] == pytest.approx(rec["loss"] - 2 * D * math.log(2), abs=1e-9)
        assert {"code_mag", "r_mag", "r_slope"} <= set(rec)


@pytest.mark.parametrize("method", ["nac", "nac-mq"])
def test_log_records_the_learnable_gains_of_the_online_model(tmp_path, method):
    """The default small recipe's learnable gains are logged as their means (a_gain, r_gain),
    those of the model the checkpoint saves (NAC-MQ: not its momentum copy's); the paper's heads
    log none (test_log_records_the_statistics_and_warns_once_on_collapse)."""
    out = str(tmp_path / method)
    assert train.main(SMALL + ["--method", method, "--max-steps", "2", "--out", out]) == 0
    recs = _log(out)
    assert all({"a_gain", "r_gain"} <= set(r) for r in recs)
    model = torch.load(os.path.join(out, "last.pt"), map_location="cpu", weights_only=False)["model"]
    gains = {k.split(".")[-2]: float(v.double().mean()) for k, v in model.items()
             if k.endswith("_gain.weight")}
    assert recs[-1]["a_gain"] == pytest.approx(gains["a_gain"], rel=1e-12)
    assert recs[-1]["r_gain"] == pytest.approx(gains["r_gain"], rel=1e-12)
    assert recs[0]["a_gain"] != 6.0 and abs(recs[0]["a_gain"] - 6.0) < 0.5  # moved from its start


def test_tensorboard_gets_the_learning_statistics(tmp_path, monkeypatch):
    written = []

    class Writer:  # stands in for torch.utils.tensorboard.SummaryWriter (not installed here)
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    log = RunLog(str(tmp_path), True, tensorboard=True)
    rec = {"step": 7, "loss": 88.0, "code_mag": 0.2, "r_mag": 0.3, "r_slope": 1.5,
           "loss_excess": -0.7, "balance_score": 0.9, "distinct_frac": 1.0}
    log.write(rec)
    log.write(dict(rec, step=8, r_slope=None))  # None (constant codes) is left out
    log.close()
    tags7 = {t: v for t, v, s in written if s == 7}
    assert tags7 == {k: v for k, v in rec.items() if k != "step"}
    assert "r_slope" not in {t for t, _, s in written if s == 8}
    assert [json.loads(x)["step"] for x in open(tmp_path / "log.jsonl")] == [7, 8]


def test_recipes_default_paper_and_learning_are_one_config_apart():
    default, paper, learning = parse([]), parse(["--config", _recipe("fashion_mnist_paper")]), \
        parse(["--config", _recipe("fashion_mnist_learning")])
    assert os.path.basename(default.recipe) == "small.toml"
    assert os.path.basename(paper.recipe) == "fashion_mnist_paper.toml"
    assert os.path.basename(learning.recipe) == "fashion_mnist_learning.toml"

    def diff(x, y):
        return {k for k in vars(x) if getattr(x, k) != getattr(y, k)}
    # the default recipe (make train) trains the learning heads with learnable gains at
    # p rising from 0.25 to 0.4 over the run, a_gain 6 and at least 400 steps (docs/math.md
    # [M:recipe-small], [M:p-schedule]); the fixed-gain learning heads at p = 0.1 and the
    # paper's recipe are one flag away
    # (--config configs/fashion_mnist_learning.toml / fashion_mnist_paper.toml)
    # (runs that see at least 450,000 images; no step threshold)
    small = {"recipe", "flip_prob", "flip_prob_final", "flip_prob_final_min_images", "a_gain",
             "min_steps", "l2"}
    assert diff(default, learning) == small | {"learn_gain"}
    assert default.learn_gain is True and learning.learn_gain is False
    assert (default.flip_prob, default.flip_prob_final, default.flip_prob_final_min_steps,
            default.flip_prob_final_min_images, default.a_gain,
            default.min_steps) == (0.25, 0.4, None, 450_000, 6.0, 400)
    assert (paper.flip_prob, paper.flip_prob_final, paper.min_steps) == (0.1, None, None)
    # NAC-MQ's lambda: none on small data, the paper's 0.1 in its recipes ([M:mq-l2])
    assert (default.l2, paper.l2, learning.l2) == (0.0, 0.1, 0.1)
    # a constant p in the default recipe, from the command line
    assert parse(["--flip-prob-final", "none"]).flip_prob_final is None
    assert diff(default, paper) == small | {"head_bn", "infer_bn", "r_gain", "infer_init",
                                            "learn_gain"}
    assert diff(learning, paper) == {"recipe", "head_bn", "infer_bn", "a_gain",
                                     "r_gain", "infer_init"}
    assert (learning.head_bn, learning.infer_bn, learning.a_gain, learning.r_gain,
            learning.infer_init) == (True, True, 3.0, "auto", "copy")
    assert (paper.head_bn, paper.infer_bn, paper.a_gain, paper.r_gain,
            paper.infer_init) == (False, False, 1.0, 1.0, "independent")
