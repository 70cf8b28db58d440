"""``siamesenorm olmo-core train CONFIG ...``: one of our schemes trained by OLMo-core's trainer, on
OLMo-core numpy token files (:mod:`siamesenorm.olmo_core.train`; docs/olmo-core.md)::

    torchrun --nproc_per_node 8 -m siamesenorm olmo-core train olmo-1b --scheme siamese \\
        --data '/data/*.npy' --save-folder runs/1b
    siamesenorm olmo-core train olmo-1b --dry-run --world-size 8     # sizes, no data

``olmo-1b``, ``olmo-400m`` and ``olmoe-15b-a2b`` take the model, optimizer, schedule and batch of our
presets of those names; ``tiny`` and ``tiny-moe`` are CPU models for tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from ..errors import UserError

PRESETS = ("olmo-1b", "olmo-400m", "olmoe-15b-a2b")     # configs/NAME.yaml
CONFIGS = (*PRESETS, "tiny", "tiny-moe")


def add_parser(sub: Any) -> None:
    """``olmo-core train`` on the ``siamesenorm`` parser's subcommands ``sub``."""
    group = sub.add_parser("olmo-core", help="train a scheme as an OLMo-core Transformer with OLMo-core's "
                                             "trainer (torchrun -m siamesenorm olmo-core train ...)")
    actions = group.add_subparsers(dest="olmo_core_command", metavar="ACTION", required=True)
    p = actions.add_parser("train", help="train one run of a config into an OLMo-core save folder",
                           description="Train one of our schemes as an OLMo-core Transformer "
                                       "(launch with torchrun -m siamesenorm olmo-core train ...).")
    p.add_argument("config", choices=CONFIGS, help="the run's shape and recipe")
    p.add_argument("--scheme", help="residual scheme (default: the config's, siamese)")
    p.add_argument("--scheme-options", action="append", metavar="K=V[,K=V]",
                   help="scheme options (default: the config's; siamese's form=hybrid_pre)")
    p.add_argument("--data", nargs="+", metavar="PATH_OR_GLOB",
                   help="OLMo-core numpy token files (raw token ids; a run needs them, default none)")
    p.add_argument("--data-dtype", default="uint16", choices=["uint8", "uint16", "uint32", "uint64"],
                   help="the token files' integer type (default %(default)s)")
    p.add_argument("--save-folder", help="OLMo-core checkpoints and metrics.jsonl (a new or empty folder, "
                   "or one this command wrote: the run resumes from its latest checkpoint; a run "
                   "needs it, default none)")
    p.add_argument("--adopt-save-folder", action="store_true",
                   help="train in a --save-folder this command did not write (resuming its OLMo-core "
                        "checkpoint, which is checked first)")
    p.add_argument("--work-dir", help="dataset cache (default: <save-folder>/work)")
    p.add_argument("--steps", type=int, help="train steps (default: the config's)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the config's)")
    p.add_argument("--microbatch", type=int, help="sequences per rank per forward (default: the config's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the config's)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default: the config's)")
    p.add_argument("--save-interval", type=int, help="checkpoint every N steps (default: the config's)")
    p.add_argument("--metrics-interval", type=int, default=10,
                   help="OLMo-core's metrics_collect_interval (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="init and data order seed (default %(default)s)")
    p.add_argument("--dp", choices=["fsdp", "hsdp", "ddp", "none"],
                   help="data parallelism (default: fsdp with several ranks)")
    p.add_argument("--precision", choices=["bf16", "fp32"],
                   help="bf16: FSDP bf16 params, fp32 reductions (default on CUDA); fp32 otherwise")
    p.add_argument("--ac", choices=["none", "full", "selected_ops"], default="none",
                   help="OLMo-core activation checkpointing (default %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism degree (the scheme's streams replicated over the group; "
                        "with --dp fsdp or hsdp; default %(default)s)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism degree (Ulysses: each rank "
                                                     "holds 1/cp of the sequence; default %(default)s)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline parallelism: not supported (default and only value %(default)s)")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism degree (MoE configs; runs over "
                                                     "HSDP's shard dimension; default %(default)s)")
    p.add_argument("--world-size", type=int, help="dry run: ranks to shard over (default: $WORLD_SIZE or 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="print sizes, FLOPs and memory per rank; build on meta only, load no data, "
                        "write nothing")
    p.set_defaults(func=run, command="olmo-core train")


def config_shape(name: str):
    """The :class:`~siamesenorm.olmo_core.train.RunShape` of the config ``name``."""
    from ..olmo_core import train as recipe

    if name in PRESETS:
        from ..tasks.registry import load_config  # our preset reader: every value checked

        return recipe.shape_of(load_config(name))
    return recipe.SMALL[name]()


def resolve(args: argparse.Namespace):
    """The run's shape: its config with the command line's scheme and overrides, checked."""
    if importlib.util.find_spec("olmo_core") is None:
        raise UserError("olmo-core train trains with OLMo-core: pip install 'siamesenorm[olmo]'")
    from ..olmo_core import train as recipe

    return recipe.resolve(args, config_shape(args.config))


def run(args: argparse.Namespace) -> int:
    shape = resolve(args)
    from ..olmo_core import train as recipe

    if args.dry_run:
        print(format_dry_run(recipe.dry_run(args, shape)))
    else:
        recipe.train(args, shape)
    return 0


def format_dry_run(r: dict[str, Any]) -> str:
    """The dry run's report (:func:`siamesenorm.olmo_core.train.dry_run`) as lines to print."""
    s = r["config"]
    gib = 2 ** 30
    dp_world = r.get("dp_world", r["world"])   # the ranks that read different data
    per_pass = dp_world * s.microbatch
    accum = s.global_batch // per_pass if s.global_batch % per_pass == 0 else float("nan")
    moe = s.model.moe
    experts = (f"MoE of {moe.n_experts} SwiGLU experts of hidden {moe.expert_hidden(s.model.dim)}, "
               f"top-{moe.top_k}")
    mlp = (experts if moe.every == 1 else f"SwiGLU {s.model.hidden_dim}"
           + (f" and every {moe.every}th block an {experts}" if moe.every else ""))
    lines = [
        f"model: {s.model.n_layers} layers, width {s.model.dim}, {s.model.n_heads} heads, {mlp}, "
        f"vocab {s.model.vocab_size}, context {s.seq_len}, scheme {s.model.scheme} "
        f"{json.dumps(s.model.scheme_options)}",
        f"parameters: {r['params']:,} (non-embedding {r['non_embedding']:,}; without the head too "
        f"{r['non_embedding_no_head']:,})",
    ]
    if moe.every:
        lines.append(f"active parameters per token: {r['active']:,} (experts {r['experts']:,} in all)")
    lines += [
        f"FLOPs per token (OLMo-core, forward+backward, seq {s.seq_len}): {r['flops_per_token']:.4g}",
        f"batch: {s.global_batch} sequences x {s.seq_len} = {r['tokens_per_step']:,} tokens per step; "
        f"{dp_world} ranks x micro-batch {s.microbatch} x {accum} accumulation; {s.steps:,} steps "
        f"= {r['tokens_per_step'] * s.steps / 1e9:.1f}B tokens",
        f"FLOPs per step: {r['flops_per_token'] * r['tokens_per_step']:.4g}",
        f"optimizer: AdamW lr {s.lr:g} betas {s.betas} wd {s.weight_decay:g}, cosine with {s.warmup} "
        f"warm-up steps to {s.min_lr_ratio:g} of the peak, clip {s.grad_clip}",
        f"memory per rank ({r['dp']}, parameters sharded over {r['shards']}):" if r["ep"] == 1 else
        f"memory per rank ({r['dp']} with expert parallelism {r['ep']}: experts sharded over "
        f"{r['shards']} ranks, the other parameters over {r['other_shards']}):",
    ]
    if r.get("tp", 1) > 1 or r.get("cp", 1) > 1:
        lines.insert(-1, f"parallelism: tensor {r['tp']} x context {r['cp']} x data {dp_world} ranks "
                         "(a TP/CP group shares one micro-batch; FSDP shards over data x context)")
    lines += [f"  {k}: {v / gib:.2f} GiB" for k, v in r["memory"].items()]
    lines += [f"  total: {r['memory_total'] / gib:.2f} GiB",
              "  not counted: activations, FSDP's all-gathered bf16 block parameters and gradients, "
              "temporaries, the CUDA context and allocator caching"]
    return "\n".join(lines)
