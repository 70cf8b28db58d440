"""Training engine for one run: the loop, AdamW and its schedule, checkpoints, metric logs; batches
come from any :class:`BatchSource`."""

from .checkpoint import Checkpoints, load_checkpoint, save_checkpoint
from .hooks import BatchSource, Evaluation
from .loop import train
from .optim import build_optimizer, decay_groups, lr_at
from .probe_hook import StepProbe

__all__ = ["BatchSource", "Checkpoints", "Evaluation", "StepProbe", "build_optimizer", "decay_groups",
           "load_checkpoint", "lr_at", "save_checkpoint", "train"]
