"""``load_corpus(spec, **options)``: one entry point for every corpus (specs and options: docs/tasks.md)."""

from __future__ import annotations

import glob
import inspect
import stat
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ...errors import UserError
from .arithmetic import check_arithmetic_options, load_arithmetic
from .corpus import Corpus
from .hf_datasets import load_hf
from .pystdlib import load_pystdlib
from .textfiles import folder_files, load_text_files, visible_files
from .tokenfiles import load_token_files

__all__ = ["check_corpus_options", "load_corpus", "names_token_files", "resolve_paths"]

_GLOB_CHARS = set("*?[")


def _file_kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "something else")


def resolve_paths(spec: str | Path) -> tuple[list[Path], bool]:
    """``(files, is_tokens)`` of a path spec (a file, a folder, a glob), sorted; a folder with ``.bin``
    files at its top level names those shards. A path that is not a regular file or folder is refused."""
    text = str(spec)
    if not text.strip():        # Path("") is the working folder: never read it unasked
        raise UserError("corpus path is empty; give pystdlib, arithmetic, hf:NAME, or a text file, "
                        "folder or .bin file")
    path = Path(text).expanduser()
    if path.is_dir():
        shards = sorted(p for p in path.glob("*.bin") if p.is_file())
        if shards:
            return shards, True
        files = folder_files(path)
        if not files:
            raise UserError(f"corpus folder {path} is empty")
        return files, False
    if path.exists():
        if not path.is_file():
            raise UserError(f"corpus path {path} is {_file_kind(path)}, not a regular file; give a "
                              "text file, a folder or a .bin file")
        files = [path]
    elif _GLOB_CHARS & set(text):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise UserError(f"corpus pattern {text} matches no file")
    else:
        raise UserError(f"corpus path {path} does not exist; give pystdlib, arithmetic, hf:NAME, or "
                          "an existing text file, folder or .bin file")
    bins = [f.suffix == ".bin" for f in files]
    if any(bins) and not all(bins):
        raise UserError(f"corpus {text} mixes .bin token files and text files; name one kind")
    return files, all(bins)


def _load_path(spec: str, *, max_bytes: int | None = None, val: str | None = None) -> Corpus:
    """A path corpus: tokens for ``.bin`` files, text otherwise; ``val`` names validation data."""
    files, is_tokens = resolve_paths(spec)
    val_files, val_is_tokens = resolve_paths(val) if val is not None else (None, is_tokens)
    if val_is_tokens != is_tokens:
        raise UserError(f"corpus {spec} and its val={val} must both be text or both .bin tokens")
    if not is_tokens:
        return load_text_files(files, spec, max_bytes=max_bytes, val_files=val_files)
    if max_bytes is not None:
        raise UserError(f"corpus {spec} is .bin tokens; max_bytes applies to text corpora only")
    return load_token_files(files, name=spec, val=val_files)


def _loader(spec: str) -> tuple[Callable[..., Corpus], bool]:
    if spec == "pystdlib":
        return load_pystdlib, False
    if spec == "arithmetic":
        return load_arithmetic, False
    if spec.startswith("hf:"):
        return load_hf, True
    return _load_path, True


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is Iterable:
        return isinstance(value, (str, list, tuple)) and all(_matches(v, args[0]) for v in value)
    return True  # Any, or a type the loader checks itself


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is Iterable:
        inner = _describe(typing.get_args(hint)[0]).removeprefix("a ")
        return f"a {inner} or a list of {inner}s"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             type(None): "null"}
    return names.get(hint, str(hint))


def _check_option_types(loader: Callable[..., Corpus], kind: str, options: dict) -> None:
    hints = typing.get_type_hints(loader)
    for name, value in options.items():
        if name in hints and not _matches(value, hints[name]):
            raise UserError(f"corpus {kind!r}: option {name} must be {_describe(hints[name])}, got "
                              f"{value!r}; fix data.corpus_options.{name}")


def check_corpus_options(spec: str, options: dict) -> tuple[Callable[..., Corpus], bool]:
    """Refuse an option the loader of ``spec`` does not take, or a value of the wrong type; returns
    ``(loader, takes_spec)``."""
    if not isinstance(spec, str) or not spec:
        raise UserError(f"corpus must be a non-empty string, got {spec!r}")
    loader, takes_spec = _loader(spec)
    accepted = [n for n, p in inspect.signature(loader).parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    kind = spec if not takes_spec else ("hf" if spec.startswith("hf:") else "path")
    if unknown:
        raise UserError(f"corpus {kind!r} has no option {', '.join(map(repr, unknown))}; its options: "
                          f"{', '.join(accepted) or 'none'}")
    _check_option_types(loader, kind, options)
    if loader is load_arithmetic:       # its counts too: a generated corpus is made in memory
        check_arithmetic_options(**options)
    return loader, takes_spec


def names_token_files(spec: str) -> bool:
    """Whether ``spec`` names ``.bin`` token files (read as the ids they hold, with no tokenizer);
    False for anything else, a spec naming no files yet included (its loading refuses it)."""
    if not isinstance(spec, str) or not spec.strip() or _loader(spec)[0] is not _load_path:
        return False
    path = Path(spec).expanduser()
    if path.is_dir():       # token files when all its files are .bin: stop at the first that is not
        if any(p.is_file() for p in path.glob("*.bin")):       # shards at its top
            return True
        found = False
        for file in visible_files(path):
            if file.suffix != ".bin" and file.is_file():
                return False
            found = found or file.is_file()
        return found
    try:
        return resolve_paths(spec)[1]
    except UserError:
        return False


def load_corpus(spec: str, **options) -> Corpus:
    """Load the corpus ``spec`` names, with the options of its loader (docs/tasks.md)."""
    loader, takes_spec = check_corpus_options(spec, options)
    return loader(spec, **options) if takes_spec else loader(**options)
