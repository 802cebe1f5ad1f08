"""Evaluation of trained encoders and their codes (docs/math.md [M:ap], [M:stats]).

    python -m nac_fast.eval --checkpoint runs/default/last.pt --out runs/eval   # cli.py
    from nac_fast.eval import knn_accuracy, linear_probe, retrieval_split      # metrics.py

The Hamming retrieval engine itself (packing, distances, ranking, AP, code statistics) is an op:
nac_fast.ops.hamming.
"""
from .metrics import knn_accuracy, linear_probe, retrieval_split

__all__ = ["knn_accuracy", "linear_probe", "retrieval_split"]
