"""VAEs with a random or a NAC / NAC-MQ / SimCLR-pretrained encoder (the paper's Table 5).

    python -m nac_fast.vae --data fashion-mnist --init runs/nac/last.pt --epochs 2 --out runs/vae

    likelihood.py  discretised Gaussian over the 256 values of a sub-pixel [M:vae-dgauss]
    bounds.py      KL, ELBO, IWAE bound, the linear-Gaussian test model [M:vae-kl],
                   [M:vae-elbo], [M:vae-iwae], [M:vae-linear]
    model.py       ResNet encoder + linear posterior layer + mirrored transposed-conv decoder
    encoder.py     the encoder of any train.py checkpoint (online or momentum model)
    data.py        a split as 8-bit images in memory, the epoch order
    images.py      PNG grids
    cli.py         training, exact resume, evaluation, report (python -m nac_fast.vae)

The math (docs/math.md, section "VAE with a pretrained encoder").
"""
from .bounds import IWAEResult, LinearGaussian, elbo_terms, gaussian_kl, iwae_bound
from .encoder import load_pretrained_encoder
from .likelihood import discretized_gaussian_log_prob
from .model import VAE

__all__ = ["VAE", "discretized_gaussian_log_prob", "gaussian_kl", "elbo_terms", "iwae_bound",
           "IWAEResult", "LinearGaussian", "load_pretrained_encoder"]
