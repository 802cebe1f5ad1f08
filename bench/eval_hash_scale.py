"""The Hamming engine at ImageNet-100 scale (issue 55 point 4): 5,000 queries ranking a database
of 128,503 codes each, mAP@1000 (and mAP@all) at 64, 32 and 16 bits, on the engine the
evaluation uses for CPU tensors (nac_fast.ops.retrieval, the C++ engine).

    python bench/eval_hash_scale.py                           # the recorded run
    python bench/eval_hash_scale.py --queries 500 --database 10000   # a quick look

Synthetic codes: --classes class prototypes (random +-1), every code its class's prototype with
each bit flipped with probability --flip, labels uniform.  Timed per bit length (wall seconds,
best of --repeats): mean_average_precision(topk=1000) alone, and retrieval_metrics(topk=(1000,))
(mAP@all and mAP@1000 from one pass, as the evaluation's hash task computes them, without the PR
curve and P@N).  Prints one JSON line per bit length.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nac_fast.ops.retrieval import mean_average_precision, retrieval_metrics  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--database", type=int, default=128503)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--bits", default="64,32,16")
    ap.add_argument("--flip", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    for bits in (int(b) for b in args.bits.split(",")):
        g = torch.Generator().manual_seed(bits)
        proto = torch.where(torch.rand(args.classes, bits, generator=g) < 0.5, 1, -1)
        ql = torch.randint(0, args.classes, (args.queries,), generator=g)
        gl = torch.randint(0, args.classes, (args.database,), generator=g)

        def codes(lab):
            c = proto[lab].clone()
            c[torch.rand(c.shape, generator=g) < args.flip] *= -1
            return c.to(torch.int8)

        qc, gc = codes(ql), codes(gl)
        t_map, t_all = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            m = mean_average_precision(qc, ql, gc, gl, topk=1000)
            t_map.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = retrieval_metrics(qc, ql, gc, gl, topk=(1000,))
            t_all.append(time.perf_counter() - t0)
        print(json.dumps({"bits": bits, "queries": args.queries, "database": args.database,
                          "map_at_1000": round(m, 4), "map_all": round(r["map_all"], 4),
                          "map_at_1000_s": round(min(t_map), 3),
                          "retrieval_metrics_s": round(min(t_all), 3),
                          "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                          "load_1min": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
