"""State names of an earlier layout, still loaded."""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = ["LegacyStateNames", "rename_legacy"]


def rename_legacy(state: dict, prefix: str, names: dict[str, str]) -> None:
    """Rename in place the entries of ``state`` under ``prefix`` that start with an old name."""
    for key in [k for k in state if k.startswith(prefix)]:
        for old, new in names.items():
            if key.startswith(prefix + old):
                state[prefix + new + key[len(prefix + old):]] = state.pop(key)
                break


class LegacyStateNames:
    """Mixed in before ``nn.Module``: ``load_state_dict`` renames ``legacy_state_names`` (old -> new)."""

    legacy_state_names: ClassVar[dict[str, str]] = {}

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        rename_legacy(state_dict, prefix, self.legacy_state_names)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
