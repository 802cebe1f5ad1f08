"""The GPU paths users reach without naming a Hamming engine (issue 39), on CUDA tensors, against
the CPU engine on the same codes:

- the evaluation's hashing scores (`python -m nac_fast.eval`, which takes the GPU when there is
  one: `run_hash` with the codes on the GPU, its ITQ baseline included);
- every Hamming engine that runs on CUDA tensors, the plain-PyTorch reference included (the
  fallback engine, which no other test runs on a GPU), through the public functions.

Equal means: distances, indices and tie order identical, counts identical, and every mAP,
precision and recall within 1e-12 of the CPU engine's ([M:ap], [M:ap-count]).  Without a GPU
these skip (CI has none); the GPU suite's hamming stage runs them (bench/gpu_suite.sh)."""
import argparse
import math

import pytest
import torch

import nac_fast
from nac_fast.eval import cli as nac_eval

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the GPU paths: needs a CUDA device")


def _codes(seed, rows, bits, dup_every=0):
    """+-1 int8 codes; with dup_every, every dup_every-th row repeats an earlier one (ties at
    distance 0 whose order is the gallery's)."""
    g = torch.Generator().manual_seed(seed)
    c = (torch.randint(0, 2, (rows, bits), generator=g) * 2 - 1).to(torch.int8)
    if dup_every:
        c[dup_every::dup_every] = c[: len(c[dup_every::dup_every])]
    return c


def _labels(seed, rows, classes=7):
    return torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(seed))


def _same(got, want, where="result"):
    """got (from the GPU) equals want (the CPU engine's): exactly for integers, strings, tensors;
    within 1e-12 for floats."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys differ"
        for k in want:
            _same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: length"
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape"
        if want.is_floating_point():
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-12, msg=where)
        else:
            assert torch.equal(got.cpu(), want), f"{where}: differs"
    elif isinstance(want, float):
        assert isinstance(got, float), f"{where}: {got!r} is not a float"
        if math.isnan(want):
            assert math.isnan(got), f"{where}: {got} where the CPU has NaN"
        else:
            assert abs(got - want) <= 1e-12, f"{where}: {got} vs {want}"
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def _cuda_engines():
    return nac_fast.available_backends("cuda", op="hamming")


@pytest.mark.parametrize("engine", ["auto", "reference", "triton", "cuda"])
@pytest.mark.parametrize("bits,zero_one", [(128, False), (37, True)])
def test_every_cuda_engine_gives_the_cpu_engines_answers(engine, bits, zero_one):
    """Distances, top-k (ties by gallery index), mAP@all and the retrieval metrics of one engine
    on CUDA codes, against the C++ engine on the same codes on the CPU."""
    if engine != "auto" and engine not in _cuda_engines():
        pytest.skip(f"the {engine!r} Hamming engine does not run on CUDA here "
                    f"(available: {_cuda_engines()})")
    q, g = _codes(1, 53, bits), _codes(2, 3001, bits, dup_every=5)
    if zero_one:
        q, g = (q > 0).to(torch.uint8), (g > 0).to(torch.uint8)
    ql, gl = _labels(3, 53), _labels(4, 3001)
    kw = {"zero_one": zero_one}
    qd, gd, qld, gld = q.cuda(), g.cuda(), ql.cuda(), gl.cuda()

    d = nac_fast.hamming_distance(qd, gd, backend=engine, **kw)
    assert d.device.type == "cuda"
    _same(d, nac_fast.hamming_distance(q, g, backend="cpu", **kw), "hamming_distance")
    for k in (1, 10, 3001):
        _same(nac_fast.topk(qd, gd, k, backend=engine, **kw),
              nac_fast.topk(q, g, k, backend="cpu", **kw), f"topk k={k}")
    _same(nac_fast.mean_average_precision(qd, qld, gd, gld, backend=engine, **kw),
          nac_fast.mean_average_precision(q, ql, g, gl, backend="cpu", **kw), "mAP@all")
    opts = dict(topk=(10, 1000), at_n=(1, 50), radius=(0, 2, bits // 2), pr=True, **kw)
    _same(nac_fast.retrieval_metrics(qd, qld, gd, gld, backend=engine, **opts),
          nac_fast.retrieval_metrics(q, ql, g, gl, backend="cpu", **opts), "retrieval_metrics")


def test_the_evaluations_hash_scores_on_the_gpu_equal_the_cpus(tmp_path):
    """nac_fast.eval's hashing task with the codes on the GPU (what --device auto takes on a GPU
    machine): every score equal to the CPU engine's, the ITQ baseline's too, and the report
    names the GPU engine it used."""
    g = torch.Generator().manual_seed(5)
    # features with whole-valued entries: many exact zeros (sgn(0) = +1) and many tied distances
    tr = {"a": torch.randint(-2, 3, (2500, 64), generator=g).float(), "labels": _labels(6, 2500)}
    te = {"a": torch.randint(-2, 3, (120, 64), generator=g).float(), "labels": _labels(7, 120)}
    reports = {}
    for dev in ("cpu", "cuda"):
        out = tmp_path / dev
        out.mkdir()
        args = argparse.Namespace(hash_protocol="standard", map_at=[10, 100, 2500],
                                  precision_at_n=[1, 10, 100], radius=2, progress=False,
                                  out=str(out), itq=True, seed=0)
        reports[dev] = nac_eval.run_hash(args, tr, te, [16, 64], torch.device(dev))
    cpu, gpu = reports["cpu"], reports["cuda"]
    assert cpu["engine"].endswith("(cpu)") and gpu["engine"].endswith("(cuda)"), gpu["engine"]
    assert not gpu["engine"].startswith("reference"), gpu["engine"]  # a GPU engine, not the oracle
    for name in ("engine", "files"):
        cpu.pop(name), gpu.pop(name)
    _same(gpu, cpu, "report")
    for name in ("hash_pr_curve.csv", "hash_precision_at_n.csv"):
        a = (tmp_path / "cpu" / name).read_text().splitlines()
        b = (tmp_path / "cuda" / name).read_text().splitlines()
        assert len(a) == len(b) and a[0] == b[0], name
        for ra, rb in zip(a[1:], b[1:]):
            for x, y in zip(ra.split(","), rb.split(",")):
                assert x == y or abs(float(x) - float(y)) <= 1e-12, (name, ra, rb)


def test_the_evaluation_runs_whole_on_the_gpu(tmp_path):
    """python -m nac_fast.eval --device cuda end to end on a tiny checkpoint: feature extraction,
    kNN, the linear probe, the hashing scores with ITQ, on the GPU; the report says where and
    with which engine, and its hash scores are those of the CPU engine on the same features
    (the features cache is the GPU run's: the same codes for both)."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    data = write_jpeg_folder(str(tmp_path / "photos"), num_classes=3, per_class=12,
                             size_range=(40, 56))
    run = tmp_path / "run"
    assert train.main(["--data", data, "--max-steps", "1", "--batch-size", "8", "--code-dim",
                       "16", "--out", str(run), "--no-progress", "--device", "cpu"]) == 0
    out = tmp_path / "eval"
    assert nac_eval.main(["--checkpoint", str(run / "last.pt"), "--out", str(out),
                          "--linear-epochs", "2", "--itq", "--map-at", "5", "--hash-protocol",
                          "standard", "--device", "cuda",
                          "--no-progress"]) == 0
    rep = json.load(open(out / "report.json"))
    assert rep["device"].startswith("cuda"), rep["device"]
    res = rep["results"]
    assert {"knn", "linear", "hash"} <= set(res), sorted(res)
    assert res["hash"]["engine"].endswith("(cuda)"), res["hash"]["engine"]
    # the same scores from the CPU engine on the features the GPU run cached
    tr, te = (torch.load(out / f"features_{split}.pt", map_location="cpu", weights_only=True)
              for split in ("train", "test"))
    args = argparse.Namespace(hash_protocol="standard", map_at=[5],
                              precision_at_n=sorted(int(n) for n in
                                                    next(iter(res["hash"]["precision_at_n"]
                                                              .values()))),
                              radius=res["hash"]["radius"], progress=False,
                              out=str(tmp_path / "cpu"), itq=True, seed=0)
    (tmp_path / "cpu").mkdir()
    bits = sorted(int(k) for k in res["hash"]["map"])
    cpu = nac_eval.run_hash(args, tr, te, bits, torch.device("cpu"))
    for name in ("map", "map_at", "precision_within_radius", "precision_at_n", "map_itq"):
        _same(res["hash"][name], json.loads(json.dumps(cpu[name])), f"hash {name}")
