"""nac_fast: fused, tested Neural Activation Coding (Park et al., ICML 2021) losses and tools.

    import nac_fast
    loss = nac_fast.nac_loss(a, r, p=0.1)                      # in-batch NAC
    loss = nac_fast.nac_mq_loss(a, r_hat, queue, p=0.1)        # NAC with a momentum queue
    nac_fast.available_backends()                              # ['reference', 'cpu', ...]

Modules: nac_fast.hashing (Hamming engine, mAP, code statistics), nac_fast.eval_metrics (kNN,
linear probe), nac_fast.data (two-view loaders), nac_fast.models / lars / momentum / distributed /
checkpoint (what train.py is built from).
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

from ._backends import available_backends  # noqa: E402
from .loss import channel_scale, draw_noise, nac_loss, nac_mq_loss, nac_vi_loss  # noqa: E402

__version__ = "0.1.0"

__all__ = ["available_backends", "channel_scale", "draw_noise", "nac_loss", "nac_mq_loss",
           "nac_vi_loss", "__version__"]
