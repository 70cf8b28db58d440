"""Residual schemes: how the residual stream(s) carry state between sublayers and where norms sit.

Importing this package registers every scheme. Add a scheme with one file here and
:func:`register_scheme`; the generic tests pick it up from the registry.
"""

# isort: off
# The import order is the registry order: the paper's subject first, then its baselines.
from . import pre, siamese, hybridnorm, spannorm, resi_dual, deepnorm, mix_ln, peri_ln, lns
from . import hyper, mhc, attn_res
# isort: on
from .base import (
                   SUBLAYERS_PER_BLOCK,
                   ResidualScheme,
                   SchemeRequirements,
                   build_scheme,
                   check_scheme_options,
                   get_scheme_class,
                   list_schemes,
                   register_scheme,
                   scheme_options,
)

del pre, siamese, hybridnorm, spannorm, resi_dual, deepnorm, mix_ln, peri_ln, lns, hyper, mhc, attn_res

__all__ = ["SUBLAYERS_PER_BLOCK", "ResidualScheme", "SchemeRequirements", "build_scheme",
           "check_scheme_options", "get_scheme_class", "list_schemes", "register_scheme",
           "scheme_options"]
