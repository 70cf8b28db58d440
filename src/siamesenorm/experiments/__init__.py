"""Many runs, one table, one report: ``siamesenorm compare``."""

from .compare import compare

__all__ = ["compare"]
