"""Models over a residual scheme: a language model, a DeiT-style ViT and a DiT (``timm_models``
registers the ViTs with timm when imported)."""

from .dit import DiT
from .dit_config import DIT_SIZES, DiTConfig
from .dit_official import DiT_models
from .lm import LanguageModel, LMOutput
from .lm_config import LMConfig, MoEConfig
from .stack import ResidualStack
from .vit import VisionTransformer, ViTOutput
from .vit_config import VIT_SIZES, ViTConfig

__all__ = ["DIT_SIZES", "VIT_SIZES", "DiT", "DiTConfig", "DiT_models", "LMConfig", "LMOutput",
           "LanguageModel", "MoEConfig", "ResidualStack", "ViTConfig", "ViTOutput", "VisionTransformer"]
