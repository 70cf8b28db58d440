"""Checkpoints: a directory written beside its target and swapped in, for one process or many. Layouts
and resharding: docs/scaling.md, "Checkpoints"; loading runs no code: docs/security.md."""

from .aliases import unique_tensors
from .atomic import verify_checksums, write_checksums
from .dcp import read_dcp
from .keep import kept_name, older_checkpoints
from .load import checkpoint_extra, layout, load_checkpoint, load_dcp_into, read_model, read_state
from .names import CHECKSUM_FILE, DCP_DIR, MODEL_FILE, SHARDED_FORMAT, STATE_FILE
from .run import Checkpoints
from .safe import UnsafeCheckpoint, read_dcp_metadata
from .save import _write_dcp, _write_model, _write_state, save_checkpoint

__all__ = ["CHECKSUM_FILE", "DCP_DIR", "MODEL_FILE", "SHARDED_FORMAT", "STATE_FILE", "Checkpoints",
           "UnsafeCheckpoint", "_write_dcp", "_write_model", "_write_state", "checkpoint_extra",
           "kept_name", "layout", "load_checkpoint", "load_dcp_into", "older_checkpoints", "read_dcp",
           "read_dcp_metadata", "read_model", "read_state", "save_checkpoint", "unique_tensors",
           "verify_checksums", "write_checksums"]
