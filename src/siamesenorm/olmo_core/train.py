"""OLMo-core training runs of our schemes: a run's shape, its checks, and OLMo-core's configs.

The command is ``siamesenorm olmo-core train`` (:mod:`siamesenorm.commands.olmo_train`, started by
``torchrun -m siamesenorm olmo-core train ...``); the functions here take its options (``args``).
``python -m siamesenorm.olmo_core.train`` still forwards to it, for one release. docs/olmo-core.md.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError
from ..models.lm_config import LMConfig

# Global batches in sequences: not in the paper; our presets' ranks x batch_size x grad_accum at 8
# ranks (olmo-1b.yaml: 8 x 32 x 8 = 2048, upstream OLMo-1B's; olmo-400m.yaml: 16 x 4 x 8 = 512).
PRESET_RANKS = 8


@dataclass(frozen=True)
class RunShape:
    """The model, the sequence length, the global batch and rank micro-batch (sequences), and the
    optimizer and schedule of a run."""

    model: LMConfig
    seq_len: int
    global_batch: int
    microbatch: int
    steps: int
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup: int
    min_lr_ratio: float
    grad_clip: float | None
    checkpoint_every: int
    tokenizer: str          # "gpt_neox" (OLMo-1B's, ids < 50280) or "bytes" (ids < vocab_size)


def shape_of(run: Any) -> RunShape:
    """The shape of one of our language-model run configurations (a preset, resolved)."""
    data, train = run.data, run.train
    return RunShape(
        model=run.model, seq_len=data.seq_len, microbatch=data.batch_size,
        global_batch=data.batch_size * train.grad_accum * PRESET_RANKS, steps=train.steps,
        lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, warmup=train.warmup,
        min_lr_ratio=train.min_lr_ratio, grad_clip=train.grad_clip or None,
        checkpoint_every=train.checkpoint_every, tokenizer="gpt_neox")


def tiny() -> RunShape:
    """A CPU model for tests."""
    model = LMConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, mlp_hidden=128, max_seq_len=64,
                     qk_norm=True, tie_embeddings=False, scheme="siamese",
                     scheme_options={"form": "hybrid_pre"})
    return RunShape(model=model, seq_len=64, global_batch=4, microbatch=2, steps=10, lr=1e-3,
                    betas=(0.9, 0.95), weight_decay=0.1, warmup=2, min_lr_ratio=0.1, grad_clip=1.0,
                    checkpoint_every=1000, tokenizer="bytes")


def tiny_moe() -> RunShape:
    """``tiny`` with an OLMoE-shaped feed-forward: every block an MoE of 8 experts, 2 per token."""
    shape = tiny()
    model = dataclasses.replace(shape.model, moe={"every": 1, "n_experts": 8, "top_k": 2, "hidden": 32,
                                                  "aux_loss": 0.01, "z_loss": 0.001})
    return dataclasses.replace(shape, model=model)


SMALL = {"tiny": tiny, "tiny-moe": tiny_moe}     # the shapes that are no preset of ours
# SiameseNorm's form in the paper's OLMo runs; other schemes start from their own defaults
DEFAULT_OPTIONS = {"siamese": {"form": "hybrid_pre"}}


def _parse_options(items: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        for part in filter(None, (s.strip() for s in item.split(","))):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or not key:
                raise UserError(f"--scheme-options: expected KEY=VALUE, got {part!r}")
            if key in options:
                raise UserError(f"--scheme-options: {key} is given twice; give each option once")
            options[key] = yaml.safe_load(value) if value.strip() else ""
    return options


def resolve(args: Any, shape: RunShape) -> RunShape:
    """``shape`` with the command's scheme and overrides, every value checked."""
    from ..schemes import check_scheme_options
    scheme = args.scheme or shape.model.scheme
    if args.scheme_options:
        options = _parse_options(args.scheme_options)
    elif scheme == shape.model.scheme:
        options = dict(shape.model.scheme_options)
    else:
        options = dict(DEFAULT_OPTIONS.get(scheme, {}))
    check_scheme_options(scheme, options)
    _check_tp_cp_pp(args, shape)
    _check_ep(args, shape)
    shape = dataclasses.replace(shape, model=dataclasses.replace(shape.model, scheme=scheme,
                                                                 scheme_options=options))
    flags = {"steps": "steps", "global_batch": "global_batch", "microbatch": "microbatch", "lr": "lr",
             "warmup": "warmup", "checkpoint_every": "save_interval"}
    over = {k: getattr(args, a) for k, a in flags.items() if getattr(args, a) is not None}
    for key, value in over.items():
        flag = "--" + flags[key].replace("_", "-")
        if key == "lr" and not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} must be a positive finite number, got {value}")
        elif key != "lr" and value < (0 if key == "warmup" else 1):
            raise UserError(f"{flag} must be {'at least 0' if key == 'warmup' else 'positive'}, got {value}")
    if args.metrics_interval < 1:
        raise UserError(f"--metrics-interval must be at least 1, got {args.metrics_interval}")
    if not 0 <= args.seed < 2 ** 32:
        raise UserError(f"--seed must be in 0..{2 ** 32 - 1} (numpy's seeds), got {args.seed}")
    return dataclasses.replace(shape, **over)


def _check_tp_cp_pp(args: Any, shape: RunShape) -> None:
    """``--tp``, ``--cp`` and ``--pp`` against the model and the other options
    (docs/olmo-core.md, "Parallelism")."""
    from .model import PP_REFUSAL
    for flag in ("tp", "cp", "pp"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.pp > 1:
        raise UserError(f"--pp {args.pp}: {PP_REFUSAL}")
    m = shape.model
    if args.tp > 1:
        if args.dp in ("ddp", "none"):
            raise UserError(f"--tp with --dp {args.dp}: tensor parallelism runs with --dp fsdp or hsdp "
                             "(OLMo-core needs a data-parallel config, and its DDP of a TP model is wrong)")
        if m.moe.every or args.ep > 1:
            raise UserError("--tp: tensor parallelism of MoE scheme models is not supported "
                             "(OLMo-core has no TP with EP); use --ep")
        for what, n in (("heads", m.n_heads), ("kv heads", m.n_kv_heads or m.n_heads),
                        ("feed-forward hidden size", m.hidden_dim)):
            if n % args.tp:
                raise UserError(f"--tp {args.tp}: tensor parallelism of degree {args.tp} does not divide "
                                 f"the {n} {what}")
    if args.cp > 1:
        if args.dp == "none":
            raise UserError("--cp with --dp none: OLMo-core's context parallelism needs a data-parallel "
                             "config (--dp fsdp|hsdp|ddp)")
        for what, n in (("heads", m.n_heads), ("kv heads", m.n_kv_heads or m.n_heads)):
            if n % (args.tp * args.cp):
                inner = args.tp * args.cp
                raise UserError(f"--cp {args.cp}: Ulysses context parallelism splits the {n} {what} over "
                                 f"tp x cp = {inner} ranks, and {inner} does not divide {n}")


def parallel_world(args: Any, world: int, gloo: bool) -> int:
    """The data-parallel ranks of ``world`` ranks under ``--tp`` and ``--cp``."""
    inner = args.tp * args.cp
    if world % inner:
        used = [(f, kind) for f, kind in (("tp", "tensor"), ("cp", "context")) if getattr(args, f) > 1]
        flags = " x ".join(f"--{f} {getattr(args, f)}" for f, _ in used)
        kinds = " and ".join(kind for _, kind in used)
        raise UserError(f"{flags}: {kinds} parallelism needs a multiple of {inner} ranks "
                         f"(torchrun --nproc_per_node), got {world}")
    if gloo and 1 < args.cp < world:
        raise UserError(f"--cp {args.cp} of {world} ranks on CPU: torch's gloo all_to_all fails in a "
                         "sub-group, so on CPU --cp must span every rank (no --tp, no data parallelism)")
    return world // inner


def _check_ep(args: Any, shape: RunShape) -> None:
    """``--ep N``: an MoE config whose experts N divides, over HSDP (OLMo-core's EP shards the
    experts over HSDP's shard dimension, N ranks wide)."""
    if args.ep < 1:
        raise UserError(f"--ep must be at least 1, got {args.ep}")
    if args.ep == 1:
        return
    moe = shape.model.moe
    if not moe.every:
        raise UserError(f"--ep {args.ep}: expert parallelism needs an MoE config (olmoe-15b-a2b, tiny-moe)")
    if moe.n_experts % args.ep:
        raise UserError(f"--ep {args.ep} does not divide the {moe.n_experts} experts")
    if args.dp not in (None, "hsdp"):
        raise UserError(f"--ep with --dp {args.dp}: OLMo-core runs expert parallelism over HSDP's shard "
                         "dimension; use --dp hsdp (the default with --ep)")
    if args.cp > 1:
        raise UserError("--ep with --cp: expert and context parallelism together are not supported here")


def check_ep_world(args: Any, world: int) -> None:
    if world % args.ep:
        raise UserError(f"--ep {args.ep} does not divide the {world} ranks")


def default_dp(args: Any, world: int) -> str:
    if args.dp == "hsdp" and world < 2:
        raise UserError("--dp hsdp shards within and replicates across groups of ranks: it needs at "
                         f"least 2 ranks (torchrun --nproc_per_node), got {world}")
    if args.dp:
        return args.dp
    return "hsdp" if args.ep > 1 else "fsdp" if world > 1 else "none"


def world_size(args: Any) -> int:
    n = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if n < 1:
        raise UserError(f"--world-size must be at least 1, got {n}")
    return n


def check_batch(shape: RunShape, world: int) -> None:
    if shape.global_batch % (world * shape.microbatch):
        raise UserError(f"global batch {shape.global_batch} sequences is not a multiple of {world} ranks x "
                         f"micro-batch {shape.microbatch}; set --global-batch or --microbatch")


def model_config(shape: RunShape, seed: int = 0):
    from .convert import olmo_config
    # OLMo-core's "normal" init (truncated normal, std 0.02): OLMo-1's Mitchell init has no
    # OLMo-core counterpart (docs/olmo-core.md)
    return olmo_config(shape.model, init_method="normal", init_std=0.02, init_seed=seed)


# ---- dry run -------------------------------------------------------------------------------
def dry_run_report(shape: RunShape, world: int, dp: str, ep: int = 1) -> dict[str, Any]:
    """Sizes and costs of the run, from the model built on ``meta`` (no memory, no data). With
    expert parallelism (HSDP, shard degree ``ep``) the experts' weights are split over the ``ep``
    ranks of a shard group and FSDP-sharded over the replicas (so over every rank), the other
    parameters over the ``ep`` ranks of the shard group."""
    config = model_config(shape)
    model = config.build(init_device="meta")
    total = model.num_params
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embedding = model.embeddings.weight.numel()
    head = 0 if shape.model.tie_embeddings else model.lm_head.w_out.weight.numel()
    shards = world if dp in ("fsdp", "hsdp") and world > 1 else 1
    other_shards = ep if ep > 1 else shards
    sharded = experts / shards + (total - experts) / other_shards    # parameters held by a rank
    per_param = {"parameters (fp32)": 4, "gradients (fp32)": 4, "AdamW state (fp32 exp_avg, exp_avg_sq)": 8}
    memory = {k: v * sharded for k, v in per_param.items()}
    tokens = shape.global_batch * shape.seq_len
    return {
        "config": shape, "world": world, "dp": dp, "shards": shards, "ep": ep,
        "other_shards": other_shards, "params": total, "active": config.num_active_params,
        "experts": experts, "non_embedding": total - embedding,
        "non_embedding_no_head": total - embedding - head,
        "flops_per_token": model.num_flops_per_token(shape.seq_len), "tokens_per_step": tokens,
        "memory": memory, "memory_total": sum(memory.values()),
    }


def dry_run(args: Any, shape: RunShape) -> dict[str, Any]:
    """:func:`dry_run_report` of the run at ``--world-size`` ranks, planned for GPUs and checked as
    a run is (no data, nothing written)."""
    world = world_size(args)
    dp_world = parallel_world(args, world, gloo=False)
    check_batch(shape, dp_world)
    check_ep_world(args, world)
    report = dry_run_report(shape, world, default_dp(args, world), args.ep)
    return report | {"dp_world": dp_world, "tp": args.tp, "cp": args.cp}


# ---- training ------------------------------------------------------------------------------
def _metrics_callback():
    from olmo_core.distributed.utils import get_rank
    from olmo_core.train.callbacks import Callback

    @dataclass
    class MetricsFileCallback(Callback):
        """Every logged step's metrics, one JSON line each, in ``<save_folder>/metrics.jsonl``
        (rank 0); OLMo-core reduces them over the ranks before ``log_metrics``."""

        name: str = "metrics.jsonl"

        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            if get_rank() != 0:
                return
            path = Path(self.trainer.save_folder) / self.name
            # appended, never through a link planted under the name
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps({"step": step} | {k: float(v) for k, v in metrics.items()}) + "\n")

    return MetricsFileCallback()


def _data_paths(patterns: list[str]) -> list[str]:
    paths: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else \
            [os.path.expanduser(pattern)]
        found = [p for p in found if os.path.isfile(p)]
        if not found:
            raise UserError(f"--data {pattern}: no such token file")
        paths += found
    return paths


def device_peak_flops(device_name: str | None, precision: str) -> int | None:
    """Peak dense FLOP/s of the GPU ``device_name`` in ``precision`` (``bf16`` or ``fp32``) from our
    table (:func:`~siamesenorm.train.throughput.table_peak`), for OLMo-core's speed monitor;
    ``None`` (OLMo-core's own guess) on a CPU or a GPU the table does not know."""
    if device_name is None:
        return None
    import torch

    from ..train.throughput import table_peak
    peak = table_peak(device_name, precision, tf32=torch.get_float32_matmul_precision() != "highest")
    return None if peak is None else round(peak.tflops * 1e12)


def speed_monitor(flops_per_token: int, device_name: str | None, precision: str):
    """OLMo-core's ``SpeedMonitorCallback`` measuring MFU against our peak of the device (OLMo-core
    3.0's own table takes every GPU but H100 and B200 for an A100: MFU 136% on an H200)."""
    from olmo_core.train.callbacks import SpeedMonitorCallback
    return SpeedMonitorCallback(num_flops_per_token=flops_per_token,
                                device_peak_flops_per_second=device_peak_flops(device_name, precision))


def train_module_config(args: Any, shape: RunShape, world: int, dp: str, precision: str,
                        cuda: bool):
    """OLMo-core's ``TransformerTrainModuleConfig`` of the run (benchmarks/gpu.py trains it too)."""
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.optim import AdamWConfig, CosWithWarmup, OptimGroupOverride
    from olmo_core.train.train_module import (
        TransformerActivationCheckpointingConfig,
        TransformerContextParallelConfig,
        TransformerDataParallelConfig,
        TransformerExpertParallelConfig,
        TransformerTensorParallelConfig,
        TransformerTrainModuleConfig,
    )
    from olmo_core.train.train_module.transformer.config import (
        TransformerActivationCheckpointingMode,
        TransformerDataParallelWrappingStrategy,
    )

    dp_config = None
    if dp != "none":
        dp_config = TransformerDataParallelConfig(
            name=DataParallelType(dp), reduce_dtype=DType.float32,
            param_dtype=DType.bfloat16 if precision == "bf16" and dp != "ddp" else None,
            wrapping_strategy=TransformerDataParallelWrappingStrategy.blocks,
            # expert parallelism runs over HSDP's shard dimension: args.ep ranks wide
            **({"shard_degree": args.ep, "num_replicas": world // args.ep} if args.ep > 1 else {}))
    ac = None if args.ac == "none" else TransformerActivationCheckpointingConfig(
        mode=TransformerActivationCheckpointingMode(args.ac))
    return TransformerTrainModuleConfig(
        rank_microbatch_size=shape.microbatch * shape.seq_len, max_sequence_length=shape.seq_len,
        optim=AdamWConfig(lr=shape.lr, betas=shape.betas, weight_decay=shape.weight_decay,
                          # no decay on embeddings, as OLMo-core's own configs
                          group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                                              opts=dict(weight_decay=0.0))]),
        scheduler=CosWithWarmup(warmup=shape.warmup, alpha_f=shape.min_lr_ratio),
        max_grad_norm=shape.grad_clip, dp_config=dp_config, ac_config=ac, compile_model=args.compile,
        ep_config=TransformerExpertParallelConfig(degree=args.ep) if args.ep > 1 else None,
        tp_config=TransformerTensorParallelConfig(degree=args.tp) if args.tp > 1 else None,
        cp_config=TransformerContextParallelConfig.ulysses(args.cp) if args.cp > 1 else None,
        autocast_precision=DType.bfloat16 if precision == "bf16" and dp_config is None and cuda else None)


def build_experiment(args: Any, shape: RunShape, world: int) -> dict[str, Any]:
    """OLMo-core's configs of the run: model, dataset, data loader, train module and trainer."""
    import torch
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.data.types import NumpyDatasetDType
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import (
        CheckpointerCallback,
        ConfigSaverCallback,
        GarbageCollectorCallback,
        GPUMemoryMonitorCallback,
    )

    cuda = torch.cuda.is_available()
    precision = args.precision or ("bf16" if cuda else "fp32")
    dp = default_dp(args, world)
    model = model_config(shape, args.seed)
    if shape.tokenizer == "gpt_neox":
        tokenizer = TokenizerConfig.gpt_neox_olmo_dolma_v1_5()
    else:
        vocab = shape.model.vocab_size
        tokenizer = TokenizerConfig(vocab_size=vocab, eos_token_id=vocab - 1, pad_token_id=0)
    work_dir = args.work_dir or str(Path(args.save_folder) / "work")
    dataset = NumpyFSLDatasetConfig(
        tokenizer=tokenizer, paths=_data_paths(args.data), sequence_length=shape.seq_len,
        dtype=NumpyDatasetDType(args.data_dtype), work_dir=work_dir)
    data_loader = NumpyDataLoaderConfig(global_batch_size=shape.global_batch * shape.seq_len,
                                        seed=args.seed, num_workers=0, work_dir=work_dir)
    train_module = train_module_config(args, shape, world, dp, precision, cuda)
    config = model.build(init_device="meta")
    flops = config.num_flops_per_token(shape.seq_len)
    del config
    trainer = TrainerConfig(
        save_folder=args.save_folder, work_dir=work_dir, save_overwrite=True,
        metrics_collect_interval=args.metrics_interval, cancel_check_interval=10,
        max_duration=Duration.steps(shape.steps),
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=shape.checkpoint_every, save_async=False),
            "speed_monitor": speed_monitor(flops, torch.cuda.get_device_name() if cuda else None,
                                           precision),
            "config_saver": ConfigSaverCallback(),
            "garbage_collector": GarbageCollectorCallback(),
            "metrics_file": _metrics_callback(),
        } | ({"gpu_memory": GPUMemoryMonitorCallback()} if cuda else {}))
    return {"model": model, "dataset": dataset, "data_loader": data_loader, "train_module": train_module,
            "trainer": trainer}


def train(args: Any, shape: RunShape) -> None:
    from olmo_core.train import prepare_training_environment, teardown_training_environment
    from olmo_core.utils import seed_all

    distributed = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
    if args.world_size is not None and args.world_size != world:
        raise UserError(f"--world-size {args.world_size} is for dry runs; torchrun gave {world} ranks")
    import torch
    check_batch(shape, parallel_world(args, world, gloo=not torch.cuda.is_available()))
    check_ep_world(args, world)
    if not args.data:
        raise UserError("--data is required (OLMo-core numpy token files, e.g. --data '/data/*.npy')")
    if not args.save_folder:
        raise UserError("--save-folder is required (where OLMo-core writes its checkpoints)")
    default_dp(args, world)
    from ..rundir import check_out_dir
    from .save_folder import check_save_folder, mark, safe_loading, verify_checkpoint
    from .token_data import check_token_files
    folder = Path(args.save_folder)
    check_save_folder(folder, args.adopt_save_folder, own_work_dir=args.work_dir is not None)
    check_out_dir(Path(args.work_dir or folder / "work"), "--work-dir")     # before the marker is written
    check_token_files(_data_paths(args.data), args.data_dtype, shape.model.vocab_size, shape.seq_len,
                      shape.global_batch)
    verify_checkpoint(folder)           # what OLMo-core resumes from, before it reads it
    if int(os.environ.get("RANK", "0")) == 0:
        mark(folder)
    parts = build_experiment(args, shape, world)
    backend = ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo") if distributed else None
    prepare_training_environment(seed=args.seed, backend=backend)
    try:
        with safe_loading():     # whatever OLMo-core loads: weights-only, metadata allow-listed
            seed_all(args.seed)
            model = parts["model"].build(init_device="meta")
            train_module = parts["train_module"].build(model)
            dataset = parts["dataset"].build()
            data_loader = parts["data_loader"].build(dataset, dp_process_group=train_module.dp_process_group)
            trainer = parts["trainer"].build(train_module, data_loader)
            trainer.callbacks["config_saver"].config = {
                "siamesenorm": {"config": args.config, "scheme": shape.model.scheme,
                                "scheme_options": shape.model.scheme_options},
                **{k: v.as_config_dict() for k, v in parts.items() if k != "trainer"}}
            trainer.fit()
    finally:
        teardown_training_environment()


if __name__ == "__main__":     # the old entry, for one release: siamesenorm olmo-core train
    import sys

    from ..cli import entry

    sys.argv[1:1] = ["olmo-core", "train"]
    entry()
