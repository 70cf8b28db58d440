"""``hf:NAME[:CONFIG]`` corpora through the optional ``datasets`` package, offline: the dataset must be
in the local cache. The rows' ``text_field`` values are joined with blank lines."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...errors import UserError
from .corpus import Corpus
from .textfiles import SEPARATOR, text_fingerprint

__all__ = ["load_hf", "parse_hf_spec"]

_OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_FLAG_MODULES = ("huggingface_hub.constants", "datasets.config")


def parse_hf_spec(spec: str) -> tuple[str, str | None]:
    """``"hf:NAME[:CONFIG]"`` -> ``(NAME, CONFIG or None)``."""
    body = spec.removeprefix("hf:")
    name, _, config = body.partition(":")
    if not name:
        raise UserError(f"corpus {spec!r}: write hf:NAME or hf:NAME:CONFIG, "
                          "e.g. hf:wikitext:wikitext-2-raw-v1")
    return name, config or None


@contextmanager
def _offline() -> Iterator[None]:
    """Force the Hugging Face libraries offline (environment and module flags) for the duration."""
    saved_env = {k: os.environ.get(k) for k in _OFFLINE_FLAGS}
    os.environ.update({k: "1" for k in _OFFLINE_FLAGS})
    saved_attrs: list[tuple[Any, str, Any]] = []
    try:
        for module_name in _FLAG_MODULES:
            module = sys.modules.get(module_name)
            for flag in _OFFLINE_FLAGS:
                if module is not None and hasattr(module, flag):
                    saved_attrs.append((module, flag, getattr(module, flag)))
                    setattr(module, flag, True)
        yield
    finally:
        for module, flag, value in saved_attrs:
            setattr(module, flag, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _join_rows(rows: Any, field: str, spec: str, max_bytes: int | None) -> str:
    pieces, size = [], 0
    for row in rows:
        if field not in row:
            raise UserError(f"corpus {spec}: rows have no field {field!r} (fields: "
                              f"{', '.join(map(str, row))}); set text_field")
        piece = (SEPARATOR if pieces else "") + str(row[field])
        data = piece.encode("utf-8")
        if max_bytes is not None and size + len(data) > max_bytes:
            pieces.append(data[:max_bytes - size].decode("utf-8", errors="ignore"))
            break
        pieces.append(piece)
        size += len(data)
    return "".join(pieces)


def load_hf(spec: str, *, split: str = "train", val_split: str | None = None, text_field: str = "text",
            max_bytes: int | None = None) -> Corpus:
    """The ``text_field`` of ``split`` of a locally cached dataset; ``val_split`` gives validation text."""
    name, config = parse_hf_spec(spec)
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise UserError(f"corpus {spec} needs the datasets package: pip install datasets") from None

    def load(which: str) -> str:
        try:
            with _offline():
                rows = datasets.load_dataset(name, config, split=which)
                return _join_rows(rows, text_field, spec, max_bytes if which == split else None)
        except UserError:
            raise
        except Exception as exc:  # any failure of the loader (not cached, bad name, bad split, ...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"cannot load dataset {name!r}{f' ({config})' if config else ''} split "
                              f"{which!r} offline: {first}") from None

    text = load(split)
    if not text.strip():
        raise UserError(f"corpus {spec}: split {split!r} has no text in field {text_field!r}")
    val_text = load(val_split) if val_split is not None else None
    meta = {"dataset": name, "config": config, "split": split, "val_split": val_split,
            "text_field": text_field, "max_bytes": max_bytes, "fingerprint": text_fingerprint(text, 0)}
    return Corpus(name=spec, text=text, meta=meta, val_text=val_text)
