"""Training engine for one run: the loop, AdamW and its schedule, checkpoints, metric logs.

It knows nothing of where batches come from: anything with ``next_batch``, ``state_dict`` and
``load_state_dict`` (:class:`BatchSource`) will do.
"""

from .checkpoint import Checkpoints, load_checkpoint, save_checkpoint
from .hooks import BatchSource, Evaluation
from .loop import train
from .optim import build_optimizer, decay_groups, lr_at
from .probe_hook import StepProbe

__all__ = ["BatchSource", "Checkpoints", "Evaluation", "StepProbe", "build_optimizer", "decay_groups",
           "load_checkpoint", "lr_at", "save_checkpoint", "train"]
