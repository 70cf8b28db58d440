"""Many runs, one table, one report: ``siamesenorm compare``."""

from .compare import compare
from .grid import build_grid

__all__ = ["build_grid", "compare"]
