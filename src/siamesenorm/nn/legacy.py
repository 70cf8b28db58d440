"""State names of an earlier layout, still loaded.

A module class declares ``legacy_state_names``: old name under the module -> new name (prefixes,
``"v_proj.norm."`` -> ``"v_head_norm."``). :class:`LegacyStateNames` renames them in
``load_state_dict``; our run checkpoints
(:func:`~siamesenorm.train.checkpoint.aliases.upgrade_legacy_names`) and transformers'
``from_pretrained`` (:func:`siamesenorm.hf.common.load_legacy_names`) read the same table.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = ["LegacyStateNames", "rename_legacy"]


def rename_legacy(state: dict, prefix: str, names: dict[str, str]) -> None:
    """Rename, in place, the entries of ``state`` under ``prefix`` whose name starts with an old
    name of ``names``."""
    for key in [k for k in state if k.startswith(prefix)]:
        for old, new in names.items():
            if key.startswith(prefix + old):
                state[prefix + new + key[len(prefix + old):]] = state.pop(key)
                break


class LegacyStateNames:
    """Mixed in before ``nn.Module``: ``load_state_dict`` reads ``legacy_state_names`` too."""

    legacy_state_names: ClassVar[dict[str, str]] = {}

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        rename_legacy(state_dict, prefix, self.legacy_state_names)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
