"""siamesenorm: the normalisation topology of Transformers as a swappable, tested part.

Centre: SiameseNorm (Li et al., ICML 2026, arXiv 2602.08064), two residual streams (a
Post-Norm-like X and a Pre-Norm-like Y) sharing every sublayer, with every baseline it is compared
with, behind one interface (:class:`ResidualScheme`) and one registry.
"""

from .compute import use_path
from .errors import ConfigError, UserError
from .models.stack import ResidualStack
from .schemes import (
                      ResidualScheme,
                      SchemeRequirements,
                      build_scheme,
                      list_schemes,
                      register_scheme,
                      scheme_options,
)
from .version import __version__

__all__ = ["ConfigError", "ResidualScheme", "ResidualStack", "SchemeRequirements", "UserError", "__version__",
           "build_scheme", "list_schemes", "register_scheme", "scheme_options", "use_path"]
