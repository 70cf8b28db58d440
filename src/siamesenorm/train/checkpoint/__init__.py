"""Checkpoints: a directory written beside its target and renamed into place; one contract for one
process and for many.

:func:`save_checkpoint` and :func:`load_checkpoint` take what the engine trains (a plain module, a
DDP-wrapped one, or one sharded by FSDP2's ``fully_shard``) and the world of the run; under several
processes both are collectives (every rank calls them). The world size decides the layout written.

One process (e.g. ``run_dir/checkpoints/last/``)::

    model.safetensors   the model's state_dict; a tensor that shares storage with another entry
                        (tied weights) is stored once, under the first name that holds it
    state.pt            {"format": 1, "optimizer": optimizer.state_dict(), "extra": {...}};
                        plain containers, numbers, strings and tensors only, so that it loads
                        with ``torch.load(weights_only=True)``

Several processes::

    dcp/        torch.distributed.checkpoint: {"model": ..., "optim": ...} keyed by parameter name,
                each rank writing its own shards (one file a rank) and rank 0 the metadata
    state.pt    {"format": 2, "extra": {...}} from rank 0 (no optimizer: it is in dcp/)

Both layouts::

    checksums.json      the SHA-256 and size of every other file of the checkpoint, written last;
                        loading verifies them first (under several processes rank 0 verifies once
                        for every rank) and refuses a damaged checkpoint (flipped or missing bytes)
                        with one line instead of training a corrupted model (a checkpoint without
                        the file, from an older version, is not verified)

Atomicity: the files are written and fsynced in a fresh temporary directory ``.<name>.tmp-*`` next
to the target (under several processes rank 0 names it and every rank writes into it). Rank 0 then
swaps it in: it renames the old checkpoint to ``.<name>.old-*``, renames the new one to ``<name>``
and deletes the old one. A crash at any point leaves either ``<name>`` complete (old or new) or, in
the instant between the two renames, no ``<name>`` but a complete ``.<name>.old-*``, which
:func:`layout`, :func:`load_checkpoint` and the next :func:`save_checkpoint` move back into
place. Hidden ``.tmp-`` directories are never read; the next save deletes them. One writer per
checkpoint directory at a time.

Loading never runs code from the checkpoint (a run folder is something people download):
``state.pt`` and every tensor load with ``torch.load(weights_only=True)``, ``dcp/.metadata`` (a
pickle) through :func:`read_dcp_metadata`, an unpickler that resolves only the metadata's own
classes, and DCP's non-tensor values with ``weights_only`` too (:func:`read_dcp`). A file that names
anything else is refused as :class:`UnsafeCheckpoint` (one line, never fallen back from); see
``docs/security.md``.

Either layout loads at any world size: the names are the model's own (FSDP2 keeps them; DDP's
``module.`` is removed), ``torch.distributed.checkpoint`` reshards what N ranks saved into M (or into
one process without a process group), and a single-process checkpoint is read whole by every rank
of a spread model.

The modules, one concern each: :mod:`.names` (file names, formats), :mod:`.aliases` (tied
weights, wrapped models), :mod:`.atomic` (temporary folder, fsync, checksums, swap), :mod:`.keep`
(``step_<N>``), :mod:`.safe` (the restricted unpickler, DCP metadata checks), :mod:`.dcp` (DCP on
first use), :mod:`.save`, :mod:`.load` (the three layouts), :mod:`.run` (:class:`Checkpoints`).
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
