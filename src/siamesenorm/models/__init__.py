"""Models built from ``siamesenorm.nn`` parts and a residual scheme."""

from .lm import LanguageModel, LMOutput
from .lm_config import LMConfig

__all__ = ["LMConfig", "LMOutput", "LanguageModel"]
