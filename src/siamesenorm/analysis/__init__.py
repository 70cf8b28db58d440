"""Diagnostics of the SiameseNorm paper (arXiv 2602.08064) for any model with a residual scheme.

Probes cheap enough to leave on during training (:class:`TrainingProbes`, ``analysis.every``),
and the analyses of a trained model (:func:`analyze_model`): layer-pruning sensitivity,
per-stream logit lens, angular distance between blocks. All of them observe the streams through
:class:`StreamTap`; a model plugs in with a ``loss_fn`` and a ``head_fn`` (:mod:`.adapters`).
``siamesenorm analyze`` runs them on a finished run (:func:`siamesenorm.tasks.analyze_run`). This
package is a library below the tasks: it never imports ``train``, ``tasks`` or ``run``. See
docs/analysis.md.
"""

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
