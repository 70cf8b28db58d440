"""timm entry points ``vit_{scheme}_{size}_patch16_224`` (DeiT tiny, small, base) for every scheme,
registered on import when timm imports; no pretrained weights. timm has no plugin hook, so a script
of timm's gets them with ``--device-modules siamesenorm.models.timm_models`` (train.py) or runs under
``python -m siamesenorm.models.timm_models SCRIPT ARGS`` (docs/vision.md)."""

from __future__ import annotations

import copy
import os
import re
import runpy
import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ..errors import UserError
from .vit import VisionTransformer
from .vit_config import ViTConfig

# ImageNet preprocessing of DeiT, for timm's data pipeline (resolve_data_config).
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_SIZES = {"tiny": "DeiT-T", "small": "DeiT-S", "base": "DeiT-B"}
# timm argument -> ViTConfig field; the other arguments timm passes are handled in _timm_config.
_RENAMED = {"drop_path_rate": "drop_path", "drop_rate": "dropout", "img_size": "image_size",
            "num_classes": "num_classes", "in_chans": "in_chans"}
_IGNORED = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")

__all__ = ["REGISTERED", "TimmVisionTransformer", "create_entrypoint", "register_timm_models",
           "run_timm_script"]
REGISTERED: list[str] = []


class TimmVisionTransformer(VisionTransformer):
    """A :class:`VisionTransformer` with timm's classifier interface; ``forward`` returns logits."""

    def __init__(self, config: ViTConfig, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.num_features = config.dim
        self.pretrained_cfg = {
            "input_size": (config.in_chans, config.image_size, config.image_size),
            "num_classes": config.num_classes, "interpolation": "bicubic", "crop_pct": 0.875,
            "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "first_conv": "patch_embed",
            "classifier": "head", "url": "",
        }
        self.default_cfg = self.pretrained_cfg

    @property
    def num_classes(self) -> int:
        return self.config.num_classes

    def forward_features(self, images: Tensor) -> Tensor:
        return self.forward_tokens(images)

    def forward_head(self, tokens: Tensor, pre_logits: bool = False) -> Tensor:
        cls = tokens[:, 0]
        return cls if pre_logits else self.head(cls)

    def forward(self, images: Tensor) -> Tensor:  # type: ignore[override]
        return self.forward_head(self.forward_features(images))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A fresh head for ``num_classes`` classes (0: none, the features come out)."""
        if global_pool not in (None, "token"):
            raise UserError(f"only the class-token pool is supported, got global_pool={global_pool!r}")
        self.config = copy.copy(self.config)   # frozen; 0 (no head) is no ViTConfig value
        object.__setattr__(self.config, "num_classes", num_classes)
        w = self.head.weight if isinstance(self.head, nn.Linear) else self.cls_token
        if num_classes > 0:
            self.head = nn.Linear(self.config.dim, num_classes, device=w.device, dtype=w.dtype)
            nn.init.trunc_normal_(self.head.weight, 0.0, self.config.init_std, -2.0, 2.0)
            nn.init.zeros_(self.head.bias)
        else:
            self.head = nn.Identity()
        self.pretrained_cfg["num_classes"] = num_classes


def _timm_config(size: str, scheme: str, kwargs: dict[str, Any]) -> ViTConfig:
    fields = {"scheme": scheme}
    for key, value in kwargs.items():
        if key in _IGNORED or value is None:
            continue
        if key in _RENAMED:
            fields[_RENAMED[key]] = value
        elif key == "global_pool" and value == "token":
            continue
        elif key in ViTConfig.__dataclass_fields__:
            fields[key] = value
        else:
            raise UserError(f"argument {key}={value!r} is not supported by the siamesenorm ViT; "
                              f"pass ViTConfig fields or {', '.join(_RENAMED)}")
    if isinstance(fields.get("image_size"), (tuple, list)):
        height, width = fields["image_size"]
        if height != width:
            raise UserError(f"img_size must be square, got {height}x{width}")
        fields["image_size"] = height
    return ViTConfig.from_size(_SIZES[size], **fields)


def create_entrypoint(scheme: str, size: str) -> Callable[..., TimmVisionTransformer]:
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> TimmVisionTransformer:
        if pretrained:
            raise UserError("there are no pretrained siamesenorm weights; use pretrained=False and "
                              "load a checkpoint file (checkpoint_path=...)")
        return TimmVisionTransformer(_timm_config(size, scheme, kwargs))

    name = f"vit_{re.sub(r'[^0-9a-zA-Z]+', '_', scheme)}_{size}_patch16_224"
    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = (f"DeiT-{size} ({_SIZES[size]}, patch 16, 224 px) with the {scheme!r} "
                          "residual scheme (siamesenorm).")
    return entrypoint


def register_timm_models(register_model: Callable[[Callable], Callable]) -> list[str]:
    from ..schemes import list_schemes

    names = []
    for scheme in list_schemes():
        for size in _SIZES:
            fn = register_model(create_entrypoint(scheme, size))
            globals()[fn.__name__] = fn
            names.append(fn.__name__)
    return names


USAGE = ("usage: python -m siamesenorm.models.timm_models SCRIPT [ARGS...] runs timm's SCRIPT "
         "(train.py, validate.py, inference.py) with the vit_{scheme}_{size}_patch16_224 models registered")


def run_timm_script(argv: list[str]) -> int:
    """Run ``argv[0]`` with arguments ``argv[1:]`` as ``python SCRIPT ARGS`` does, these models
    registered; 2 (after one line on stderr) when it cannot."""
    problem = None
    if not argv or argv[0] in ("-h", "--help"):
        problem = USAGE
    elif not REGISTERED:
        problem = f"error: timm does not import here ({_TIMM_ERROR}); pip install 'siamesenorm[timm]'"
    elif not os.path.isfile(argv[0]):
        problem = f"error: {argv[0]}: no such file; give the path of timm's train.py, validate.py or " \
                  "inference.py"
    if problem:
        print(problem, file=sys.stderr)
        return 2
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


_TIMM_ERROR = ""
try:  # timm is optional: without it (or with a broken install) nothing is registered.
    from timm.models import register_model as _timm_register_model
except Exception as error:  # ImportError, or the RuntimeError of a torchvision that does not match torch
    _timm_register_model = None
    _TIMM_ERROR = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"

# run with -m this file is __main__: the import below registers the names, once
if _timm_register_model is not None and __name__ != "__main__":
    REGISTERED.extend(register_timm_models(_timm_register_model))

if __name__ == "__main__":
    from siamesenorm.models.timm_models import run_timm_script as _run

    sys.exit(_run(sys.argv[1:]))
