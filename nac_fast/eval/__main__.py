"""python -m nac_fast.eval: the evaluation command (nac_fast.eval.cli)."""
import sys

from .cli import main

sys.exit(main())
