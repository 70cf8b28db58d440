"""Residual schemes: how the residual stream(s) carry state between sublayers and where norms sit.

Importing this package registers every scheme. Add a scheme with one file here and
:func:`register_scheme`; the generic tests pick it up from the registry. A scheme declares each of
its options once, in its ``options`` table, and describes it once, in its docstring::

    @register_scheme
    class Scaled(ResidualScheme):
        # docstring: h <- h + gain * F_i(LN_i(h)), the option gain scaling every branch
        name = "scaled"
        options = {"gain": Option(1.0, Number(low=0, high=10))}   # a float: bounded, finite

        def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
            super().__init__(dim, n_layers, **kwargs)   # checks the options, sets self.gain
            self.pre_norm = self.make_branch_norms(self.n_sublayers)

        def step(self, h, i, branch):
            return h + self.gain * branch(self.pre_norm[i](h))
"""

# isort: off
# The import order is the registry order: the paper's subject first, then its baselines and the
# other schemes, each beside its kin (Keel after DeepNorm: both are Post-Norm with a scaled skip).
from . import pre, siamese, hybridnorm, spannorm, resi_dual, deepnorm, keel, mix_ln, peri_ln, lns
from . import hyper, mhc, attn_res
# isort: on
from .base import (
                   SUBLAYERS_PER_BLOCK,
                   Flag,
                   Number,
                   OneOf,
                   Option,
                   ResidualScheme,
                   SchemeRequirements,
                   build_scheme,
                   check_scheme_options,
                   get_scheme_class,
                   list_schemes,
                   register_scheme,
                   scheme_options,
)

del pre, siamese, hybridnorm, spannorm, resi_dual, deepnorm, keel, mix_ln, peri_ln, lns
del hyper, mhc, attn_res

__all__ = ["SUBLAYERS_PER_BLOCK", "Flag", "Number", "OneOf", "Option", "ResidualScheme",
           "SchemeRequirements", "build_scheme", "check_scheme_options", "get_scheme_class",
           "list_schemes", "register_scheme", "scheme_options"]
