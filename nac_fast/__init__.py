"""nac_fast: fused, tested Neural Activation Coding (Park et al., ICML 2021) losses and tools.

    import nac_fast
    loss = nac_fast.nac_loss(a, r, p=0.1)                      # in-batch NAC
    loss = nac_fast.nac_mq_loss(a, r_hat, queue, p=0.1)        # NAC with a momentum queue
    nac_fast.available_backends()                              # ['reference', 'cpu', ...]

Modules: nac_fast.hashing (Hamming engine, mAP, code statistics), nac_fast.eval_metrics (kNN,
linear probe), nac_fast.data (two-view loaders), nac_fast.models / lars / momentum / distributed /
checkpoint (what train.py is built from).
"""
from ._backends import available_backends
from .loss import channel_scale, draw_noise, nac_loss, nac_mq_loss, nac_vi_loss

__version__ = "0.1.0"

__all__ = ["available_backends", "channel_scale", "draw_noise", "nac_loss", "nac_mq_loss",
           "nac_vi_loss", "__version__"]
