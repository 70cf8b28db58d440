"""The package's version: a leaf, so that every layer may name it."""

__version__ = "0.1.0"
