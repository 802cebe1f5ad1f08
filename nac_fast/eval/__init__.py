"""Evaluation of trained encoders and their codes (docs/math.md [M:ap], [M:stats]).

    python -m nac_fast.eval --checkpoint runs/default/last.pt --out runs/eval   # cli.py
    from nac_fast.eval import knn_accuracy, linear_probe, retrieval_split      # metrics.py

The Hamming engine itself is an op (nac_fast/ops: codes.py packing, search.py distances and
ranking, retrieval.py mAP, mAP@K, P@H<=r, PR curve, P@N); code statistics are nac_fast/codestats.py.
"""
from .metrics import knn_accuracy, linear_probe, retrieval_split

__all__ = ["knn_accuracy", "linear_probe", "retrieval_split"]
