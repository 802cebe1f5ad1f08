import sys

from .._omp import passive_openmp
from .cli import main

passive_openmp("nac_fast.index")  # (nac_fast/_omp.py: why)
sys.exit(main())
