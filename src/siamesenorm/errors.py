"""Errors a user can cause. The command line turns these into one line on stderr and exit status 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value: an unknown scheme, an option it does not have, a bad dimension."""
