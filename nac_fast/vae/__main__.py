"""python -m nac_fast.vae: train and evaluate a VAE (nac_fast.vae.cli)."""
import sys

from .cli import main

sys.exit(main())
