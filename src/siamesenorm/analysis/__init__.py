"""Diagnostics of the SiameseNorm paper (arXiv 2602.08064) for any model with a residual scheme
(docs/analysis.md); a library below the tasks: it never imports ``train``, ``tasks`` or ``run``."""

from .adapters import lm_head, lm_loss
from .angular import angular_distances
from .lens import logit_lens, plain_norm
from .probes import block_grad_norms, grad_norms, norm_gains, stream_rms, sublayer_rms
from .pruning import effective_depth, mean_loss, pruning_sensitivity
from .run_analysis import analyze_model, checkpoint_probes, write_analysis
from .tap import StreamTap, sublayers_of_blocks
from .training_probes import TrainingProbes, read_probes

__all__ = ["StreamTap", "TrainingProbes", "analyze_model",
           "angular_distances", "block_grad_norms", "checkpoint_probes", "effective_depth",
           "grad_norms", "lm_head", "lm_loss", "logit_lens", "mean_loss", "norm_gains", "plain_norm",
           "pruning_sensitivity", "read_probes", "stream_rms", "sublayer_rms", "sublayers_of_blocks",
           "write_analysis"]
