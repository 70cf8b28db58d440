"""Checkpoints: a directory written beside its target and renamed into place; one contract for one
process and for many.

:func:`save_checkpoint` and :func:`load_checkpoint` take what the engine trains (a plain module, a
DDP-wrapped one, or one sharded by FSDP2's ``fully_shard``) and the world of the run; under several
processes both are collectives (every rank calls them). One process writes ``model.safetensors``
(tied weights stored once) and ``state.pt`` (optimizer and extras, plain containers only); several
write ``dcp/`` (``torch.distributed.checkpoint``) and ``state.pt`` from rank 0. Both add
``checksums.json``, written last and verified first. The files are written in a temporary
``.<name>.tmp-*`` beside the target and swapped in by rank 0 through ``.<name>.old-*``, so a crash
leaves a complete checkpoint, old or new (one writer per directory). Loading never runs code from
the checkpoint (``weights_only`` loads, an allow-list unpickler for DCP metadata; anything else is
:class:`UnsafeCheckpoint`, docs/security.md), and either layout loads at any world size. Layouts,
swap and resharding: docs/scaling.md, "Checkpoints".
"""

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
