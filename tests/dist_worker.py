"""A training script for tests/test_parallel.py, run by ``siamesenorm.parallel.launch`` (2 processes,
gloo) or in the test's own process (the single-process reference).

    python dist_worker.py equivalence OUT.json [DIVERGING_RUN_DIR]
        every case of SCHEMES (one per structure that DDP and FSDP2 see, and the model options)
        under DDP and FSDP2: 5 steps, one rank's micro-batch each, and those of CHECKPOINTED with
        activation checkpointing; rank 0 writes
        {"<scheme>/<mode>[/<checkpointing>]": {"losses": [...], "val": ...}} to OUT.json; then,
        with DIVERGING_RUN_DIR, ``run DIVERGING_RUN_DIR fsdp 1 --lr 50`` below in the same launch
    python dist_worker.py run RUN_DIR PARALLEL ACCUM [--resume] [--crash-at-batch N] [--kill-save K]
        [--lr LR]
        one run of 6 steps (checkpoint every 2) of pre; ``--crash-at-batch N`` raises when the
        batch source has drawn N micro-batches (on every rank: all draw the same); ``--kill-save K``
        ends the process abruptly inside the K-th checkpoint save of this session, after the
        sharded files were written and before the swap
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from siamesenorm.config import TrainConfig
from siamesenorm.data import BatchSampler, validation_batches
from siamesenorm.models import LanguageModel, LMConfig, MoEConfig
from siamesenorm.models.checkpointing import set_activation_checkpointing
from siamesenorm.schemes import list_schemes
from siamesenorm.train import train as train_engine

VOCAB, SEQ, BATCH = 64, 16, 4
MOE = {"every": 1, "n_experts": 4, "top_k": 2, "hidden": 16}
# Pre-Norm and SiameseNorm (its default form, post_pre: two streams), then the model options that
# change the sublayers or carry tensors from one sublayer to another: the OLMo form (QKV-norm in
# the attention), a mixture of experts, value residuals and Depth-Attention (carriers).
OPTIONS = {"pre": ("pre", {}), "siamese": ("siamese", {}),
           "siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"}),
           "siamese-moe": ("siamese", {"moe": MOE}),
           "siamese-value_residual": ("siamese", {"model": {"value_residual": True,
                                                            "value_residual_mix": "learned"}}),
           "pre-depth_attention": ("pre", {"model": {"depth_attention": True}})}
# also trained with activation checkpointing (sublayer, selective) under each engine
CHECKPOINTED = ("pre", "hyper", "siamese", "siamese-hybrid_pre", "siamese-value_residual",
                "pre-depth_attention")


def structure(model: LanguageModel) -> tuple[frozenset, frozenset]:
    """What DDP and FSDP2 (``siamesenorm.parallel.wrap``) see of a model: the shapes of the
    parameters of the root group (the embedding, the scheme's norms and connection weights) and
    the names and shapes of the sublayers' (each sublayer its own FSDP2 group). Both engines treat
    every parameter alike, by its shape alone (FSDP2 shards dim 0; DDP reduces it whole); the
    scheme's equations run inside the root's forward, between the sublayers' gathers, and take no
    part in how gradients are reduced. That every parameter gets a gradient (DDP's requirement) is
    tests/test_depth.py's, for every registered scheme."""
    root, subs = set(), set()
    for name, p in model.named_parameters():
        if name.startswith("sublayers."):
            subs.add((name.split(".", 2)[2], tuple(p.shape)))
        else:
            root.add(tuple(p.shape))
    return frozenset(root), frozenset(subs)


def _one_per_structure() -> dict[str, tuple[str, dict]]:
    """OPTIONS, then each registered scheme whose model has a structure none before it has
    (hyper-connections, mHC, Attention Residuals: connection weights of their own shapes; the
    schemes of norm gains alone train as Pre-Norm and SiameseNorm do)."""
    cases = dict(OPTIONS)
    seen = {structure(build(*case)) for case in cases.values()}
    for name in list_schemes():
        found = structure(build(name, {}))
        if found not in seen:
            cases[name] = (name, {})
            seen.add(found)
    return cases


def tokens() -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(0)
    # a learnable sequence: a noisy walk over the vocabulary
    steps = g.integers(1, 4, size=12_000)
    seq = np.cumsum(steps) % VOCAB
    return seq[:10_000].astype(np.int64), seq[10_000:].astype(np.int64)


def build(scheme: str, options: dict) -> LanguageModel:
    """The tiny model of ``scheme``; ``options`` are its scheme options, except ``moe`` (a
    mixture of experts in every block, :class:`~siamesenorm.models.MoEConfig`'s fields) and
    ``model`` (other :class:`LMConfig` fields: value residuals, Depth-Attention)."""
    torch.manual_seed(0)
    options = dict(options)
    moe, model = MoEConfig(**options.pop("moe", {})), options.pop("model", {})
    return LanguageModel(LMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=SEQ,
                                  scheme=scheme, scheme_options=options, moe=moe, **model))


SCHEMES = _one_per_structure()


def settings(steps: int, parallel: str, accum: int, checkpoint_every: int = 0) -> TrainConfig:
    """``checkpoint_every=0``: only at the last step."""
    return TrainConfig(steps=steps, lr=1e-2, warmup=1, grad_accum=accum, eval_every=steps,
                       parallel=parallel, checkpoint_every=checkpoint_every or steps)


def train(model, source, cfg: TrainConfig, run_dir, **kwargs) -> dict:
    """The engine with this file's validation batches and seed 0."""
    return train_engine(model, source, cfg, run_dir, seed=0,
                        eval_batches=validation_batches(tokens()[1], BATCH, SEQ, 3), **kwargs)


def source() -> BatchSampler:
    return BatchSampler(tokens()[0], BATCH, SEQ, seed=0)


def losses(run_dir: Path) -> tuple[list[float], float | None]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], rows[-1].get("val_loss")


class Crashing:
    """A batch source that raises when the inner one has drawn ``at`` micro-batches."""

    def __init__(self, inner: BatchSampler, at: int) -> None:
        self.inner, self.at = inner, at

    def next_batch(self):
        if self.inner.batches_drawn >= self.at:
            raise RuntimeError(f"planned crash after {self.at} micro-batches")
        return self.inner.next_batch()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def _kill_inside_save(k: int) -> None:
    # the module whose save_checkpoint calls install
    import siamesenorm.train.checkpoint.save as checkpoint

    real, count = checkpoint.install, [0]

    def install(tmp, path, keep_as=None):
        count[0] += 1
        if count[0] == k:
            os._exit(9)         # killed: the new checkpoint is written but never swapped in
        real(tmp, path, keep_as)

    checkpoint.install = install


@contextmanager
def _no_save() -> Iterator[None]:
    """Runs end without their final checkpoint (none before it: ``checkpoint_every`` is the last
    step)."""
    from siamesenorm.train.loop import Trainer

    real = Trainer.save
    Trainer.save = lambda self: None
    try:
        yield
    finally:
        Trainer.save = real


def main(argv: list[str]) -> None:
    from siamesenorm.parallel import init_world, leave_world

    world, _ = init_world("cpu")
    try:
        if argv[0] == "equivalence":
            equivalence(world, Path(argv[1]))
            if len(argv) > 2:
                run(Path(argv[2]), "fsdp", 1, ["--lr", "50"])
        else:
            run(Path(argv[1]), argv[2], int(argv[3]), argv[4:])
    finally:
        leave_world(world)


def equivalence(world, out: Path) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        from siamesenorm.parallel import broadcast_object

        tmp = broadcast_object(world, tmp)
        cases = [(name, mode, "none") for name in SCHEMES for mode in ("ddp", "fsdp")]
        cases += [(name, mode, ac) for name in CHECKPOINTED for mode in ("ddp", "fsdp")
                  for ac in ("sublayer", "selective")]
        for name, mode, ac in cases:
            run_dir = Path(tmp) / f"{name}-{mode}-{ac}"
            model = build(*SCHEMES[name])
            set_activation_checkpointing(model, ac)
            # checkpointing changes no parameter or state the final checkpoint holds: the
            # case's run without it saves that checkpoint under this engine
            with _no_save() if ac != "none" else nullcontext():
                train(model, source(), settings(5, mode, 1), run_dir, progress=False)
            if world.main:
                key = f"{name}/{mode}" + ("" if ac == "none" else f"/{ac}")
                results[key] = dict(zip(("losses", "val"), losses(run_dir)))
    if world.main:
        out.write_text(json.dumps(results))


def run(run_dir: Path, parallel: str, accum: int, rest: list[str]) -> None:
    src = source()
    if "--crash-at-batch" in rest:
        src = Crashing(src, int(rest[rest.index("--crash-at-batch") + 1]))
    if "--kill-save" in rest:
        _kill_inside_save(int(rest[rest.index("--kill-save") + 1]))
    s = settings(6, parallel, accum, checkpoint_every=2)
    if "--lr" in rest:
        s = dataclasses.replace(s, lr=float(rest[rest.index("--lr") + 1]))
    train(build("pre", {}), src, s, run_dir, resume="--resume" in rest, progress=False)


if __name__ == "__main__":
    from siamesenorm.errors import ConfigError
    from siamesenorm.parallel import exit_process
    from siamesenorm.parallel.launch import report_failure

    try:
        main(sys.argv[1:])
    except ConfigError as error:
        if not report_failure(error, True):
            raise
        exit_process(2)
    except Exception as error:
        if not report_failure(error, False):
            raise
        exit_process(1)
    exit_process(0)
