"""Many runs, one table, one report: ``siamesenorm compare``."""

from .compare import compare, read_runs
from .grid import build_grid

__all__ = ["build_grid", "compare", "read_runs"]
