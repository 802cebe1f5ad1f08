"""nac_fast: fused, tested Neural Activation Coding (Park et al., ICML 2021) losses and tools.

    import nac_fast
    criterion = nac_fast.NACLoss(p=0.1)                  # in-batch NAC (nn.Module)
    loss = criterion((a0, r0), (a1, r1))                 # the two views' outputs
    mq = nac_fast.NACMQ(model, queue_size=65536)         # NAC-MQ: momentum model, queue, EMA
    loss = mq(view0, view1).loss                         # one call per step
    nac_fast.NACMQLoss, nac_fast.CodeQueue               # its criterion and queue (nn.Modules)
    loss = nac_fast.nac_loss(a, r, p=0.1)                # the functional forms
    nac_fast.available_backends()                        # ['reference', 'cpu', ...]

    packed = nac_fast.pack_codes(codes)                        # the Hamming engine: +-1 codes
    d, idx = nac_fast.topk(query_codes, gallery_codes, k=10)   # nearest first, ties by index
    m = nac_fast.mean_average_precision(qc, ql, gc, gl, topk=1000)   # also P@H<=2, PR, P@N
    index = nac_fast.HashIndex(128); index.add(codes); D, I = index.search(query_codes, 10)
    stats = nac_fast.code_statistics(a)                        # distinct codes, bit balance, ...

The math: docs/math.md.  Layout (imports point down: ops, data <- codestats <- train <- eval,
index; tests/test_layering.py checks it):
    nac_fast.ops        the ops' Python side: dispatch, reference, noise, the NAC loss op and its
                        API (criteria, CodeQueue, NACMQ), the Hamming engine: codes (packing),
                        search, retrieval (scores) (kernels in csrc/ and kernels/)
    nac_fast.data       two-view loaders: source -> order/sharding -> decode/augment -> batches
    nac_fast.codestats  code statistics (expressivity) for the training log and the evaluation
    nac_fast.train      models, methods, LARS, schedule, checkpoints, DDP
    nac_fast.eval       linear probe, kNN, retrieval protocols; `python -m nac_fast.eval`
    nac_fast.index      HashIndex (a saved packed-code index); `python -m nac_fast.index`
    nac_fast._checks    argument validators (errors name the argument), a leaf for every layer
"""
import importlib.util as _ilu
import os as _os
import sys as _sys


def _kernels_from_source_tree() -> None:
    """Run from a source checkout (PYTHONPATH=<checkout>, e.g. after `setup.py build_ext
    --inplace`), `nac_fast.kernels` is the checkout's top-level kernels/ folder: setup.py installs
    that folder as nac_fast/kernels in wheels and maps it for editable installs, and here it is
    registered the same way.  An install that has the subpackage is left alone."""
    name = __name__ + ".kernels"
    if name in _sys.modules or _ilu.find_spec(name) is not None:
        return
    src = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "kernels")
    init = _os.path.join(src, "__init__.py")
    if not _os.path.isfile(init):
        return  # no kernels anywhere: the Triton backend reports the import error when asked
    spec = _ilu.spec_from_file_location(name, init, submodule_search_locations=[src])
    module = _ilu.module_from_spec(spec)
    _sys.modules[name] = module
    spec.loader.exec_module(module)


_kernels_from_source_tree()

# The public API, one name per line (sorted within each group) so that it extends cleanly.
from .ops.dispatch import available_backends  # noqa: E402
from .ops.loss import (  # noqa: E402
    NACLoss,
    NACMQLoss,
    mq_l2,
    nac_loss,
    nac_mq_loss,
    nac_vi_loss,
)
from .ops.momentum import NACMQ  # noqa: E402
from .ops.noise import channel_scale, draw_noise  # noqa: E402
from .ops.queue import CodeQueue  # noqa: E402
# The Hamming engine (issue 28.4: packing, search, scoring; statistics are not an op)
from .ops.codes import PackedCodes, pack_codes, unpack_codes  # noqa: E402
from .ops.search import hamming_distance, rank, topk  # noqa: E402
from .ops.retrieval import (average_precision, mean_average_precision, pr_curve,  # noqa: E402
                            precision_at_n, precision_within_radius, retrieval_metrics)
from .codestats import CodeStatistics, code_statistics  # noqa: E402
from .index.hash_index import HashIndex  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # losses: criteria, the NAC-MQ module and its queue, the functional forms
    "CodeQueue",
    "NACLoss",
    "NACMQ",
    "NACMQLoss",
    "nac_loss",
    "nac_mq_loss",
    "nac_vi_loss",
    # the channel and the backends
    "available_backends",
    "channel_scale",
    "mq_l2",
    "draw_noise",
    # the Hamming engine, code statistics and the index
    "PackedCodes",
    "pack_codes",
    "unpack_codes",
    "hamming_distance",
    "topk",
    "rank",
    "average_precision",
    "mean_average_precision",
    "precision_within_radius",
    "pr_curve",
    "precision_at_n",
    "retrieval_metrics",
    "CodeStatistics",
    "code_statistics",
    "HashIndex",
    "__version__",
]
