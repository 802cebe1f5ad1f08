"""Retrieval scores of Hamming ranking, as hashing papers report them (docs/math.md [M:ap],
[M:ap-at-k], [M:radius], [M:pr-curve], [M:precision-at-n]).

    import nac_fast
    m = nac_fast.mean_average_precision(qc, ql, gc, gl)               # mAP@all
    m = nac_fast.mean_average_precision(qc, ql, gc, gl, topk=1000)    # mAP@1000 (DeepHash-pytorch)
    p = nac_fast.precision_within_radius(qc, ql, gc, gl, radius=2)    # P@H<=2
    curve = nac_fast.pr_curve(qc, ql, gc, gl)                         # by Hamming radius 0..D
    pn = nac_fast.precision_at_n(qc, ql, gc, gl, n=(100, 500, 1000))  # P@N
    everything = nac_fast.retrieval_metrics(qc, ql, gc, gl, topk=(1000,), at_n=(100,), pr=True)

Conventions (docs/math.md):

* Codes as in nac_fast/ops/codes.py.  Each query ranks the whole gallery by Hamming distance,
  ties broken by gallery index [M:rank] (a stable sort; DeepHash-pytorch's np.argsort leaves the
  tie order unspecified).
* Relevance [M:relevance]: same class for (n,) integer class ids; shares at least one label for
  (n, L) 0/1 multi-hot labels (FLICKR-25K / NUS-WIDE style).  Every metric takes either.
* mAP@all [M:ap]: AP over the whole ranking, queries with no relevant item skipped (the mean is
  over the others; ``return_num_queries`` gives how many).
* mAP@K [M:ap-at-k], DeepHash-pytorch's ``CalcTopMap``: AP over the relevant items within the top
  K, normalised by their number; a query with none in its top K adds 0, and the mean is over
  **all** queries (DeepHash "skips" such a query's AP but divides by the number of queries).
* Precision within Hamming radius r [M:radius]: relevant / retrieved among the items at distance
  <= r, 0 for a query that retrieves nothing (the hash-lookup convention); the fraction of such
  queries is reported beside it.
* PR curve [M:pr-curve]: precision and recall of the Hamming ball of radius r = 0..D.
* P@N [M:precision-at-n]: relevant items among the first N of the ranking, / N, mean over all
  queries.

Backends as for the search (nac_fast/ops/search.py): ``"cpu"`` runs one pass of the compiled
kernel per query chunk (csrc/hamming.cpp ``hamming_retrieval``: no Q x G matrix, no sort, exact
[M:ap-count]; its instruction-set level as for the search: ``NAC_FAST_HAMMING_ISA``);
``"reference"`` sorts chunks of the distance matrix with torch (any device);
``"triton"`` is the same counting-sort pass on the GPU (kernels/hamming_triton.py: one program per
block of queries and slice of the gallery, two passes, every score of this module; no Q x G
matrix).
"""
from __future__ import annotations

import math

import torch

from .. import _checks
from .codes import is_integer_dtype, pack_bits, pack_bits_torch
from .search import (cdist_words, cpu_simd, cuda_kernels, pair, ref_chunk_rows, resolve_backend,
                     triton_kernels)

__all__ = ["average_precision", "mean_average_precision", "precision_within_radius",
           "pr_curve", "precision_at_n", "retrieval_metrics"]

# Queries per call of the compiled retrieval pass when histograms are wanted: bounds the two
# (chunk, bins) int64 histograms, bins = 64 x words + 1 (4096 x 129 x 16 bytes = 8 MiB at 128
# bits).  Wider codes take fewer queries a call, so the histograms stay within
# _HIST_BYTES (64 MiB: 4096 queries up to 1024 bits); a fixed 4096 made them 4.3 GB at MAX_BITS,
# ~14 GB peak with retrieval_metrics' temporaries of the same shape.
_HIST_QUERY_CHUNK = 4096
_HIST_BYTES = _HIST_QUERY_CHUNK * (16 * 64 + 1) * 16


def hist_query_chunk(words: int) -> int:
    """Default queries per call when histograms are wanted, for codes of ``words`` int64 words."""
    return max(1, min(_HIST_QUERY_CHUNK, _HIST_BYTES // ((64 * words + 1) * 16)))


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def check_labels(name: str, labels, n: int, n_name: str) -> torch.Tensor:
    """Validate labels; returns int64 (n,) class ids or bool (n, L) multi-hot."""
    _checks.tensor(name, labels)
    if labels.dim() not in (1, 2):
        raise ValueError(f"{name} must be (n,) class ids or (n, L) multi-hot, got shape "
                         f"{tuple(labels.shape)}")
    if labels.shape[0] != n:
        raise ValueError(f"{name} has {labels.shape[0]} rows but {n_name} has {n} codes")
    labels = labels.detach()
    if labels.dim() == 1:
        if not is_integer_dtype(labels.dtype):
            raise TypeError(f"{name} (1-D class ids) must have an integer dtype, got {labels.dtype}"
                            " (multi-label relevance needs (n, L) multi-hot)")
        return labels.to(torch.int64)
    if labels.shape[1] < 1:
        raise ValueError(f"{name} multi-hot must have at least one label column")
    if labels.dtype == torch.bool:
        return labels
    if labels.is_complex() or not (labels.is_floating_point() or is_integer_dtype(labels.dtype)):
        raise TypeError(f"{name} must have an integer, float or bool dtype, got {labels.dtype}")
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError(f"{name} (n, L) multi-hot must contain only 0 and 1")
    return labels == 1


def _checked(query_codes, query_labels, gallery_codes, gallery_labels, zero_one, backend):
    """Checked packed codes, labels (int64 ids or bool multi-hot) and the resolved backend."""
    q, g = pair(query_codes, gallery_codes, zero_one)
    ql = check_labels("query_labels", query_labels, q.words.shape[0], "query_codes")
    gl = check_labels("gallery_labels", gallery_labels, g.words.shape[0], "gallery_codes")
    if ql.dim() != gl.dim() or (ql.dim() == 2 and ql.shape[1] != gl.shape[1]):
        raise ValueError(f"query_labels {tuple(ql.shape)} and gallery_labels {tuple(gl.shape)} "
                         "must both be (n,) class ids or both (n, L) multi-hot with the same L")
    if ql.device != q.words.device or gl.device != q.words.device:
        raise ValueError("labels must be on the same device as the codes")
    return q, g, ql, gl, resolve_backend(backend, q.words, q.nbits)


def _positive_ints(name: str, values, *, most: int | None = None) -> tuple:
    if _checks.is_int(values, numpy=True):
        values = (values,)
    try:
        out = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got "
                        f"{type(values).__name__}") from None
    for v in out:
        if not _checks.is_int(v, numpy=True):
            raise TypeError(f"{name} must hold ints, got {v!r}")
        if v < 1:
            raise ValueError(f"{name} values must be >= 1, got {int(v)}")
        if most is not None and v > most:
            raise ValueError(f"{name} values must be <= {most} (the gallery size), got {int(v)}")
    return tuple(int(v) for v in out)


# --------------------------------------------------------------------------------------------
# Reference backend: chunks of the distance matrix, sorted stably
# --------------------------------------------------------------------------------------------

def _ref_relevance(ql: torch.Tensor, gl: torch.Tensor) -> torch.Tensor:
    if ql.dim() == 1:
        return ql[:, None] == gl[None, :]
    return (ql.to(torch.float32) @ gl.to(torch.float32).T) > 0.5  # 0/1 counts: exact in fp32


def _ref_pass(qw, gw, ql, gl, cuts, hist: bool, nbits: int, backend: str):
    """What the compiled ``hamming_retrieval`` returns, from sorted chunks of the distance matrix
    (``backend`` computes the distances: "reference")."""
    G = gw.shape[0]
    nb = gw.shape[1] * 64 + 1
    dev = qw.device
    ranks = torch.arange(1, G + 1, device=dev, dtype=torch.float64)
    cut_idx = torch.tensor([min(c, G) - 1 for c in cuts], device=dev, dtype=torch.int64)
    out = {k: [] for k in ("ap", "nrel", "hits", "psum", "hist", "relhist")}
    step = ref_chunk_rows(G, max(gw.shape[1], 2))
    for s in range(0, qw.shape[0], step):
        d = cdist_words(qw[s:s + step], gw, backend)
        rel_u = _ref_relevance(ql[s:s + step], gl)
        order = torch.sort(d, dim=1, stable=True).indices
        rel = torch.gather(rel_u, 1, order)
        nrel = rel.sum(1)
        hits = rel.to(torch.float64).cumsum(1)
        prec = hits / ranks * rel
        ap = torch.where(nrel > 0, prec.sum(1) / nrel.clamp(min=1), torch.nan)
        out["ap"].append(ap)
        out["nrel"].append(nrel.to(torch.int64))
        if cuts:
            out["hits"].append(hits[:, cut_idx].round().to(torch.int64))
            out["psum"].append(prec.cumsum(1)[:, cut_idx])
        if hist:
            dl = d.to(torch.int64)
            h = torch.zeros(d.shape[0], nb, dtype=torch.int64, device=dev)
            out["hist"].append(h.scatter_add(1, dl, torch.ones_like(dl)))
            out["relhist"].append(torch.zeros_like(h).scatter_add(1, dl, rel_u.to(torch.int64)))
    Q = qw.shape[0]
    empty2 = lambda cols, dt: torch.zeros(Q, cols, dtype=dt, device=dev)  # noqa: E731
    return (torch.cat(out["ap"]), torch.cat(out["nrel"]),
            torch.cat(out["hits"]) if cuts else empty2(0, torch.int64),
            torch.cat(out["psum"]) if cuts else empty2(0, torch.float64),
            torch.cat(out["hist"]) if hist else torch.zeros(0, nb, dtype=torch.int64, device=dev),
            torch.cat(out["relhist"]) if hist else torch.zeros(0, nb, dtype=torch.int64, device=dev))


def _pass(q, g, ql, gl, be, cuts=(), hist=False):
    """(ap, nrel, hits (Q, C), psum (Q, C), hist (Q, D+1), relhist (Q, D+1)) for one query set."""
    if be == "cpu":
        if ql.dim() == 2:  # multi-hot -> packed words, relevance = (q & g) != 0
            ql, gl = pack_bits(ql), pack_bits(gl)
        out = torch.ops.nac_fast.hamming_retrieval(q.words, g.words, ql, gl, list(cuts), hist,
                                                   cpu_simd())
        if hist:  # the kernel's histograms have W * 64 + 1 bins; keep the D + 1 that can be hit
            out = (*out[:4], out[4][:, :q.nbits + 1], out[5][:, :q.nbits + 1])
        return out
    if be == "triton":  # both passes on the tensors' device, no Q x G matrix [M:ap-count]
        if ql.dim() == 2:
            ql, gl = pack_bits_torch(ql), pack_bits_torch(gl)
        return triton_kernels().retrieval(q.words, g.words, ql, gl, q.nbits, cuts, hist)
    if be == "cuda":  # the same passes, each query's counters in shared memory
        if ql.dim() == 2:
            ql, gl = pack_bits_torch(ql), pack_bits_torch(gl)
        return cuda_kernels().retrieval(q.words, g.words, ql, gl, q.nbits, cuts, hist)
    out = _ref_pass(q.words, g.words, ql, gl, cuts, hist, q.nbits, be)
    if hist:
        out = (*out[:4], out[4][:, :q.nbits + 1], out[5][:, :q.nbits + 1])
    return out


def average_precision(query_codes, query_labels, gallery_codes, gallery_labels, *,
                      zero_one: bool = False, backend: str = "auto"):
    """Per-query average precision over the whole Hamming ranking (ties by gallery index).

    Returns ``(ap, num_relevant)``: float64 (Q,) and int64 (Q,) CPU-or-input-device tensors;
    ``ap`` is NaN for a query with no relevant gallery item.  Arguments as in
    :func:`mean_average_precision`."""
    q, g, ql, gl, be = _checked(query_codes, query_labels, gallery_codes, gallery_labels,
                                zero_one, backend)
    if be == "cpu":
        if ql.dim() == 2:  # multi-hot -> packed words, relevance = (q & g) != 0
            ql, gl = pack_bits(ql), pack_bits(gl)
        return torch.ops.nac_fast.hamming_average_precision(q.words, g.words, ql, gl, cpu_simd())
    return _pass(q, g, ql, gl, be)[:2]


def mean_average_precision(query_codes, query_labels, gallery_codes, gallery_labels, *,
                           topk: int | None = None, zero_one: bool = False,
                           backend: str = "auto", return_num_queries: bool = False):
    """mAP of Hamming-ranking retrieval, as in the hashing tables (docs/math.md [M:ap], [M:ap-at-k]).

    query_codes (Q, D), gallery_codes (G, D): +-1 codes (bool: True = +1), or 0/1 with
    ``zero_one=True``, or :class:`PackedCodes`.  query_labels / gallery_labels: (n,) integer
    class ids (relevant = same class) or (n, L) 0/1 multi-hot (relevant = shares a label).
    Each query ranks the whole gallery by Hamming distance, ties broken by gallery index
    [M:rank].

    ``topk=None``: mAP@all.  A query's AP is the precision averaged over its R relevant items
    [M:ap]; queries with R = 0 are **skipped** (the mean is over the others); NaN if no query
    has a relevant item.  ``return_num_queries=True`` gives ``(map, num_used)``.

    ``topk=K`` (K >= 1; K > G means the whole gallery): mAP@K with DeepHash-pytorch's convention
    [M:ap-at-k]: AP over the relevant items within the top K (normalised by their number, not by
    R), a query with none there adds 0, and the mean is over **all** Q queries;
    ``return_num_queries=True`` gives ``(map, queries with a relevant item in the top K)``.

    Errors: TypeError / ValueError naming the argument for non-tensors, wrong dtypes, codes that
    are not +-1 (or 0/1), mismatched bit counts, label shapes that do not match the codes, empty
    query or gallery sets, a ``topk`` that is not one int (several K: :func:`retrieval_metrics`)
    and flags that are not bools.
    """
    _checks.flag("return_num_queries", return_num_queries)
    if topk is not None:
        if not _checks.is_int(topk, numpy=True):
            several = (f" (for several K: retrieval_metrics(topk={tuple(topk)!r}))"
                       if isinstance(topk, (list, tuple)) else "")
            raise TypeError(f"topk must be an int or None{several}, got {topk!r}")
        (k,) = _positive_ints("topk", topk)
        r = retrieval_metrics(query_codes, query_labels, gallery_codes, gallery_labels,
                              topk=(k,), zero_one=zero_one, backend=backend)
        m, used = r["map_at"][k], r["queries_with_hit_at"][k]
        return (m, used) if return_num_queries else m
    ap, nrel = average_precision(query_codes, query_labels, gallery_codes, gallery_labels,
                                 zero_one=zero_one, backend=backend)
    used = nrel > 0
    n_used = int(used.sum())
    m = float(ap[used].sum() / n_used) if n_used else math.nan
    return (m, n_used) if return_num_queries else m


def precision_within_radius(query_codes, query_labels, gallery_codes, gallery_labels, *,
                            radius: int = 2, zero_one: bool = False, backend: str = "auto",
                            return_empty_fraction: bool = False):
    """Precision of hash lookup within Hamming radius ``radius`` (P@H<=2 for radius 2, docs/math.md
    [M:radius]): per query, relevant / retrieved among the gallery items at distance <= radius,
    **0 for a query that retrieves nothing**; the mean over all queries.  With
    ``return_empty_fraction=True``: ``(precision, fraction of queries that retrieved nothing)``.
    ``radius`` must be in [0, D]."""
    _checks.flag("return_empty_fraction", return_empty_fraction)
    r = retrieval_metrics(query_codes, query_labels, gallery_codes, gallery_labels,
                          radius=(radius,), zero_one=zero_one, backend=backend)
    p, e = r["precision_within_radius"][radius], r["empty_ball_fraction"][radius]
    return (p, e) if return_empty_fraction else p


def pr_curve(query_codes, query_labels, gallery_codes, gallery_labels, *, zero_one: bool = False,
             backend: str = "auto") -> dict:
    """Precision-recall curve of Hamming ranking by radius (docs/math.md [M:pr-curve]): for every
    radius r = 0..D the gallery items at distance <= r are retrieved (tie order plays no part).

    Returns a dict of lists, one entry per radius: ``radius``, ``precision`` (mean over the
    queries that retrieve something), ``precision_empty_as_zero`` (mean over all queries, 0 for
    an empty ball: the P@H<=r of :func:`precision_within_radius`), ``recall`` (mean over the
    queries with a relevant item), ``nonempty_fraction`` and ``mean_retrieved``."""
    return retrieval_metrics(query_codes, query_labels, gallery_codes, gallery_labels, pr=True,
                             zero_one=zero_one, backend=backend)["pr_curve"]


def precision_at_n(query_codes, query_labels, gallery_codes, gallery_labels, *,
                   n=(1, 10, 100, 500, 1000), zero_one: bool = False,
                   backend: str = "auto") -> dict:
    """P@N (docs/math.md [M:precision-at-n]): the relevant items among the first N of the
    Hamming ranking (ties by gallery index), / N, averaged over all queries.  ``n``: an int or a
    sequence, each in [1, G].  Returns ``{N: precision}``."""
    return retrieval_metrics(query_codes, query_labels, gallery_codes, gallery_labels, at_n=n,
                             zero_one=zero_one, backend=backend)["precision_at_n"]


def retrieval_metrics(query_codes, query_labels, gallery_codes, gallery_labels, *, topk=(),
                      at_n=(), radius=(), pr: bool = False, zero_one: bool = False,
                      backend: str = "auto", progress: bool = False,
                      query_chunk: int | None = None) -> dict:
    """Every retrieval score of this module from one pass over the gallery per query chunk.

    ``topk``: K values of mAP@K; ``at_n``: N values of P@N (each <= G); ``radius``: radii of
    P@H<=r (each in [0, D]); ``pr``: the PR curve by radius.  mAP@all is always computed.
    ``progress``: a tqdm bar over the queries.  Returns a dict: ``num_queries``,
    ``num_gallery``, ``code_bits``, ``tie_order``, ``map_all``, ``queries_with_relevant``,
    ``map_at`` / ``queries_with_hit_at`` ({K: ...}), ``precision_at_n`` ({N: ...}),
    ``precision_within_radius`` / ``empty_ball_fraction`` ({r: ...}), ``pr_curve`` (see
    :func:`pr_curve`) when asked."""
    q, g, ql, gl, be = _checked(query_codes, query_labels, gallery_codes, gallery_labels,
                                zero_one, backend)
    Q, G, D = q.words.shape[0], g.words.shape[0], q.nbits
    ks = _positive_ints("topk", topk)
    ns = _positive_ints("at_n", at_n, most=G)
    if _checks.is_int(radius, numpy=True):
        radius = (radius,)
    try:
        radii = tuple(radius)
    except TypeError:
        raise TypeError(f"radius must be an int or a sequence of ints, got "
                        f"{type(radius).__name__}") from None
    for r in radii:
        if not _checks.is_int(r, numpy=True) or not 0 <= r <= D:
            raise ValueError(f"radius values must be ints in [0, {D}] (the code length), got {r!r}")
    _checks.flag("pr", pr)
    _checks.flag("progress", progress)
    hist = pr or bool(radii)
    cuts = tuple(dict.fromkeys(min(k, G) for k in ks + ns))
    if query_chunk is None:
        query_chunk = (hist_query_chunk(q.words.shape[1]) if hist
                       else _HIST_QUERY_CHUNK if progress else Q)
    _checks.positive_int("query_chunk", query_chunk)

    ap_sum, n_rel_q = 0.0, 0
    k_sum = {k: 0.0 for k in ks}
    k_hit = {k: 0 for k in ks}
    n_sum = {n: 0.0 for n in ns}
    prec_sum = torch.zeros(D + 1, dtype=torch.float64)
    nonempty = torch.zeros(D + 1, dtype=torch.int64)
    rec_sum = torch.zeros(D + 1, dtype=torch.float64)
    retrieved = torch.zeros(D + 1, dtype=torch.float64)
    from tqdm.auto import tqdm
    with tqdm(total=Q, desc="hashing metrics", unit="query", disable=not progress,
              leave=False) as bar:
        for s in range(0, Q, query_chunk):
            qc = type(q)(q.words[s:s + query_chunk], q.nbits)
            ap, nrel, hits, psum, h, rh = (t.cpu() for t in _pass(
                qc, g, ql[s:s + query_chunk], gl, be, cuts, hist))
            used = nrel > 0
            ap_sum += float(ap[used].sum())
            n_rel_q += int(used.sum())
            col = {c: i for i, c in enumerate(cuts)}
            for k in ks:
                hk, pk = hits[:, col[min(k, G)]], psum[:, col[min(k, G)]]
                k_sum[k] += float(torch.where(hk > 0, pk / hk.clamp(min=1).to(torch.float64), 0.0).sum())
                k_hit[k] += int((hk > 0).sum())
            for n in ns:
                n_sum[n] += float(hits[:, col[n]].sum()) / n
            if hist:
                cum, rcum = h.cumsum(1), rh.cumsum(1).to(torch.float64)  # exact division
                ok = cum > 0
                prec_sum += torch.where(ok, rcum / cum.clamp(min=1), 0.0).sum(0)
                nonempty += ok.sum(0)
                rq = nrel > 0
                rec_sum += (rcum[rq] / nrel[rq, None]).sum(0)
                retrieved += cum.to(torch.float64).sum(0)
            bar.update(qc.words.shape[0])

    nan = math.nan
    out = {"num_queries": Q, "num_gallery": G, "code_bits": D,
           "tie_order": "gallery index (stable sort by Hamming distance)",
           "map_all": ap_sum / n_rel_q if n_rel_q else nan, "queries_with_relevant": n_rel_q,
           "map_at": {k: k_sum[k] / Q for k in ks}, "queries_with_hit_at": dict(k_hit),
           "precision_at_n": {n: n_sum[n] / Q for n in ns}}
    if radii:
        out["precision_within_radius"] = {int(r): float(prec_sum[r]) / Q for r in radii}
        out["empty_ball_fraction"] = {int(r): 1.0 - float(nonempty[r]) / Q for r in radii}
    if pr:
        ne = nonempty.to(torch.float64)
        out["pr_curve"] = {
            "radius": list(range(D + 1)),
            "precision": torch.where(ne > 0, prec_sum / ne.clamp(min=1), nan).tolist(),
            "precision_empty_as_zero": (prec_sum / Q).tolist(),
            "recall": (rec_sum / n_rel_q).tolist() if n_rel_q else [nan] * (D + 1),
            "nonempty_fraction": (ne / Q).tolist(),
            "mean_retrieved": (retrieved / Q).tolist()}
    return out
