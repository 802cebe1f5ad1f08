"""Issue 16: the head options that keep NAC's codes from collapsing, the learning statistics of the
training log, the collapse warning, and the default recipe (the one that learns) against the
paper-faithful one."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import train
from nac_fast.ops.loss import nac_loss, nac_mq_loss, nac_vi_loss
from nac_fast.train.config import CONFIG_DIR, parse
from nac_fast.train.methods import (collapse_warning, learning_stats, nac_step, simclr_step,
                                    zero_code_loss)
from nac_fast.train.models import (A_GAIN_BN, build_model, model_kwargs_from_config,
                                   resolve_r_gain, swap_halves)

D = 16
BN_HEADS = dict(head_bn=True, infer_bn=True, a_gain=3.0, r_gain="auto", infer_init="copy", p=0.1)
SMALL = ["--data", "synthetic:64", "--image-size", "8", "--batch-size", "16", "--code-dim",
         str(D), "--no-progress", "--log-every", "1", "--save-every", "100"]


def _model(**kw):
    torch.manual_seed(0)
    return build_model("resnet-tiny", 1, 8, D, **kw)


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


def test_learnable_gains_and_checkpoint_round_trip():
    m = _model(**BN_HEADS, learn_gain=True)
    torch.testing.assert_close(m.a_gain.weight.detach(), torch.full((D,), 3.0))
    torch.testing.assert_close(m.r_gain.weight.detach(), torch.full((D,), 4.8))
    cfg = dict(arch="resnet-tiny", in_channels=1, image_size=8, code_dim=D, method="nac",
               scale_codes=True, p=0.1, **{k: v for k, v in BN_HEADS.items() if k != "p"},
               learn_gain=True)
    m2 = build_model(**model_kwargs_from_config(cfg))
    m2.load_state_dict(m.state_dict())  # the same modules, parameters and buffers
    # a checkpoint from before the options gets the authors' heads
    old = {k: cfg[k] for k in ("arch", "in_channels", "image_size", "code_dim", "method",
                               "scale_codes")}
    assert model_kwargs_from_config(old)["head_bn"] is False
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


def test_log_records_the_statistics_and_warns_once_on_collapse(tmp_path, capsys):
    out = str(tmp_path / "paper")
    # the paper heads with tiny codes (a gain 1e-3): collapsed from the start
    argv = SMALL + ["--config", os.path.join(CONFIG_DIR, "fashion_mnist_paper.toml"),
                    "--a-gain", "1e-3", "--max-steps", "3", "--out", out]
    assert train.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("warning: the codes are collapsing") == 1
    assert "configs/fashion_mnist.toml" in err
    recs = _log(out)
    for rec in recs:
        assert {"code_mag", "r_mag", "r_slope", "loss_excess", "bit_balance"} <= set(rec)
        assert rec["loss_excess"] == pytest.approx(rec["loss"] - D * math.log(2), abs=1e-9)
        assert rec["code_mag"] < 0.01


def test_default_recipe_does_not_warn_and_differs_from_the_paper_only_in_the_heads(tmp_path,
                                                                                     capsys):
    out = str(tmp_path / "bn")
    assert train.main(SMALL + ["--max-steps", "3", "--out", out]) == 0
    assert "collapsing" not in capsys.readouterr().err
    recs = _log(out)
    assert all(r["code_mag"] > 0.1 for r in recs)
    default, paper = parse([]), parse(["--config", os.path.join(CONFIG_DIR,
                                                                  "fashion_mnist_paper.toml")])
    assert default.recipe == "fashion_mnist" and paper.recipe == "fashion_mnist_paper"
    diff = {k for k in vars(default) if getattr(default, k) != getattr(paper, k)}
    assert diff == {"config", "recipe", "head_bn", "infer_bn", "a_gain", "r_gain", "infer_init"}
    assert (default.head_bn, default.infer_bn, default.a_gain, default.r_gain,
            default.infer_init) == (True, True, 3.0, "auto", "copy")
    assert (paper.head_bn, paper.infer_bn, paper.a_gain, paper.r_gain,
            paper.infer_init) == (False, False, 1.0, 1.0, "independent")
