"""nac_fast: fused, tested Neural Activation Coding (Park et al., ICML 2021) losses and tools.

    import nac_fast
    criterion = nac_fast.NACLoss(p=0.1)                  # in-batch NAC (nn.Module)
    loss = criterion((a0, r0), (a1, r1))                 # the two views' outputs
    mq = nac_fast.NACMQ(model, queue_size=65536)         # NAC-MQ: momentum model, queue, EMA
    loss = mq(view0, view1).loss                         # one call per step
    nac_fast.NACMQLoss, nac_fast.CodeQueue               # its criterion and queue (nn.Modules)
    loss = nac_fast.nac_loss(a, r, p=0.1)                # the functional forms
    nac_fast.available_backends()                        # ['reference', 'cpu', ...]

The math: docs/math.md.  Layout (imports point down: ops <- train <- train.py, ops <- eval):
    nac_fast.ops     the ops' Python side: dispatch, reference, noise, the NAC loss op and its
                     API (criteria, CodeQueue, NACMQ), the Hamming engine (kernels in csrc/ and
                     kernels/)
    nac_fast.data    two-view loaders: source -> order/sharding -> decode/augment -> batches
    nac_fast.train   models, methods, LARS, schedule, checkpoints, DDP
    nac_fast.eval    linear probe, kNN, retrieval protocols; `python -m nac_fast.eval`
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
    nac_loss,
    nac_mq_loss,
    nac_vi_loss,
)
from .ops.momentum import NACMQ  # noqa: E402
from .ops.noise import channel_scale, draw_noise  # noqa: E402
from .ops.queue import CodeQueue  # noqa: E402

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
    "draw_noise",
    "__version__",
]
