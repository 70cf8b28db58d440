"""The entry's save folder: whose it is, and its checkpoint read without running code
(docs/security.md, "The OLMo-core entry")."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..rundir import check_out_dir, write_json
from ..train.checkpoint import read_dcp_metadata
from ..train.checkpoint.safe import load_weights_only

__all__ = ["MARKER", "check_save_folder", "mark", "safe_loading", "verify_checkpoint"]

MARKER = ".siamesenorm-olmo-core.json"
_MARKER_TMP = re.compile(re.escape(f".{MARKER}.tmp-") + r"\d+")     # rank 0 writing it (write_json)
# Names the entry writes through (metrics.jsonl, appended) or into (work/): a link there would lead
# the writes outside the folder.
_NO_LINKS = ("metrics.jsonl", "work")
_FORCE, _NO_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def _rng_globals() -> list:
    core = getattr(np, "_core", None) or np.core     # numpy 2, numpy 1
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, type(np.dtype(np.uint32))]


def check_save_folder(folder: Path, adopt: bool, own_work_dir: bool) -> None:
    """Refuse a ``--save-folder`` the entry did not write, unless ``adopt``, and links where it writes."""
    check_out_dir(folder, "--save-folder")
    try:
        names = sorted(p.name for p in folder.iterdir() if not _MARKER_TMP.fullmatch(p.name))
    except FileNotFoundError:
        return
    except OSError as error:
        raise UserError(f"cannot read --save-folder {folder}: {error.strerror or error}") from None
    if names and not adopt and not (folder / MARKER).is_file():
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise UserError(f"--save-folder {folder} holds files this entry did not write ({shown}); "
                        "OLMo-core would resume from them: choose a new or empty folder, or add "
                        "--adopt-save-folder to train there (its checkpoint is checked first)")
    for name in _NO_LINKS if not own_work_dir else _NO_LINKS[:1]:
        if (folder / name).is_symlink():
            raise UserError(f"--save-folder {folder}: {name} is a link (to {os.readlink(folder / name)}); "
                            f"the entry writes its {name} inside the folder: remove the link")


def mark(folder: Path) -> None:
    """Create ``folder`` if missing and mark it as the entry's (rank 0)."""
    from .. import __version__

    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / MARKER).is_file():
            write_json(folder / MARKER, {"created_by": f"siamesenorm {__version__} (olmo_core.train)"})
    except OSError as error:
        raise UserError(f"cannot write --save-folder {folder}: {error.strerror or error}") from None


# ---- the checkpoint OLMo-core will load --------------------------------------------------------
def _checkpoint_to_load(folder: Path) -> Path | None:
    from olmo_core.train.checkpoint import Checkpointer

    if not folder.is_dir():
        return None
    if Checkpointer.dir_is_checkpoint(folder):
        return folder
    try:
        return Path(Checkpointer.latest_checkpoint(folder))
    except FileNotFoundError:
        return None


def verify_checkpoint(folder: Path) -> Path | None:
    """Read every file of the checkpoint OLMo-core would resume from through our allow-lists, unpickling
    nothing else; returns it (``None``: none). Raises :class:`UnsafeCheckpoint` or :class:`UserError`."""
    ckpt = _checkpoint_to_load(folder)
    if ckpt is None:
        return None
    states = sorted((ckpt / "train").glob("rank*.pt"))
    for state in states:
        with torch.serialization.safe_globals(_rng_globals()):
            load_weights_only(state, state)
    dcp = ckpt / "model_and_optim"
    if not (dcp / ".metadata").is_file() and not states:
        dcp = ckpt                          # a model-only checkpoint: .metadata at its top
    metadata = read_dcp_metadata(dcp)
    files: dict[str, io.BufferedReader] = {}
    try:
        for info in metadata.storage_data.values():
            where = dcp / info.relative_path
            if info.relative_path not in files:
                try:
                    files[info.relative_path] = open(where, "rb")  # noqa: SIM115 - closed below
                except OSError as error:
                    raise UserError(f"cannot read checkpoint {where}: {error.strerror or error}") from None
            record = io.BufferedReader(_Slice(files[info.relative_path], info.offset, info.length))
            with torch.serialization.skip_data():   # the pickle, not the tensors' bytes
                load_weights_only(record, where)
    finally:
        for f in files.values():
            f.close()
    return ckpt


class _Slice(io.RawIOBase):
    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        data = self.f.read(n)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


@contextmanager
def safe_loading() -> Iterator[None]:
    """While training: every ``torch.load`` weights-only, and OLMo-core's ``.metadata`` read through
    :func:`read_dcp_metadata`."""
    from olmo_core.distributed.checkpoint.filesystem import RemoteFileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    original = RemoteFileSystemReader.read_metadata

    def read_metadata(self):
        if self._metadata is None:
            metadata = read_dcp_metadata(str(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    saved = {k: os.environ.get(k) for k in (_FORCE, _NO_FORCE)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_NO_FORCE, None)
    RemoteFileSystemReader.read_metadata = read_metadata
    try:
        with torch.serialization.safe_globals(_rng_globals()):
            yield
    finally:
        RemoteFileSystemReader.read_metadata = original
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
