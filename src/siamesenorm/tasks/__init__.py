"""How each task turns a configuration into a training run: ``vit`` (image classification) and
``dit`` (class-conditional diffusion); the language model's run lives in :mod:`siamesenorm.run`."""

from .dit import run_dit
from .vit import run_vit

__all__ = ["run_dit", "run_vit"]
