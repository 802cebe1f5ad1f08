"""Audit of Python paths that run only with CUDA tensors (or matter most there), tested on the CPU."""
import pytest
import torch

from nac_fast.index import hash_index as HI
from nac_fast.index.hash_index import HashIndex
from nac_fast.ops import search as S


def _words(seed, n, W):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 62, 2 ** 62, (n, W), generator=g, dtype=torch.int64)


def test_reference_topk_keeps_no_chunk_matrix(monkeypatch):
    """_ref_topk (the reference engine, the GPU's fallback) must hold only the k columns of each
    query chunk until the final cat, not a view into the chunk's whole (rows, G) sort: those views
    kept a Q x G matrix alive (12 bytes a pair), an OOM on a GPU for a large gallery."""
    q, g, k = _words(1, 300, 2), _words(2, 5000, 2), 10
    held = []
    cat = torch.cat

    def spy(ts, *a, **kw):
        held.extend(t.untyped_storage().nbytes() for t in ts)
        return cat(ts, *a, **kw)

    monkeypatch.setattr(torch, "cat", spy)
    D, I = S._ref_topk(q, g, k)
    monkeypatch.setattr(torch, "cat", cat)
    assert D.shape == (300, k) and I.shape == (300, k)
    # the outputs' own bytes (int32 + int64), not 300 x 5000 x 12
    assert sum(held) == 300 * k * (4 + 8)
    d = S.ref_cdist(q, g)
    sd, si = torch.sort(d, dim=1, stable=True)
    assert torch.equal(D, sd[:, :k]) and torch.equal(I, si[:, :k])


def test_gpu_index_reference_search_checks_its_workspace(monkeypatch):
    """A GPU index searched by the reference engine: its chunks' temporaries count in the free
    memory check (a ValueError before any copy), as the Triton and CUDA engines' workspace does;
    before, only the queries and results were counted and the search ran into a CUDA OOM.  The GPU
    is pretended: the check raises before anything touches it."""
    index = HashIndex(128, backend="reference")
    index.add(_words(3, 1 << 16, 2).ne(0).repeat_interleave(64, 1)[:, :128])
    index._device = torch.device("cuda", 0)   # a GPU index (its codes are never read here)
    monkeypatch.setattr(HI, "resolve_backend", lambda backend, words, nbits=None: "reference")
    monkeypatch.setattr(HI, "gpu_free_bytes", lambda device: 1 << 20)
    empty = torch.empty

    def meta_empty(*a, device=None, **kw):  # the engine's probe tensor, on no real GPU
        cuda = device is not None and torch.device(device).type == "cuda"
        return empty(*a, device="meta" if cuda else device, **kw)

    monkeypatch.setattr(torch, "empty", meta_empty)
    q = torch.ones(4, 128, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"searching 4 queries \(top 10\) in 65,536 codes needs "
                                         r"\d+ MiB on cuda:0, which has 1 MiB free"):
        index.search(q, 10)
    assert S.ref_topk_workspace_bytes(4, 1 << 16, 10, 2) > 1 << 25
