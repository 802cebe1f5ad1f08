import sys

from .._omp import passive_openmp
from .cli import main

passive_openmp("nac_fast.eval")  # (nac_fast/_omp.py: why)
sys.exit(main())
