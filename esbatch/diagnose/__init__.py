"""Diagnostics that probe the estimators around a checkpoint without training it (``esbatch diagnose``).

``kappa``: the local subtraction diagnostic of the paper's Appendix E (kappa_base, kappa_pair, Table 13).
"""
