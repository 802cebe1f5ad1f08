"""Triton kernels of nac_fast, installed as the subpackage `nac_fast.kernels` (see setup.py)."""
