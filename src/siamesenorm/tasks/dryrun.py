"""``siamesenorm train PRESET [key=value ...] --dry-run [--nproc N]``: a run's size and cost from
its configuration alone: the model built on the meta device, plain numbers (:func:`dry_run`) and a
table (:func:`format_dry_run`). :func:`check_fits` refuses a real run whose :func:`memory_floor`
exceeds the device's memory :data:`MEMORY_MARGIN` times over. Formulas: docs/scaling.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import CHECKPOINTING_MODES
from ..errors import UserError
from ..models.host import SchemeHost
from ..parallel.env import World, launched_world_size
from ..parallel.wrap import parallel_mode
from ..schemes import SUBLAYERS_PER_BLOCK
from .registry import get_task

__all__ = ["dry_run", "format_dry_run", "parameter_counts", "world_size"]

GIB = 1024 ** 3
SCALE_OUT = 8   # at one rank the table also shows this many


def world_size(nproc: int | None = None) -> int:
    """``nproc``, else the launcher's ``WORLD_SIZE``, else 1."""
    n = launched_world_size() if nproc is None else nproc
    if n < 1:
        raise UserError(f"--nproc must be at least 1, got {n}")
    return n


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """``total``, ``token_embedding`` (every ``nn.Embedding``), ``head`` (an untied ``lm_head``),
    ``embedding`` (the two), ``non_embedding``, ``active`` (what one token uses: a mixture of
    experts counts its routed experts only; ``total`` for a dense model); a tied weight counts
    once."""
    total = _numel(model)
    token = sum(_numel(m) for m in model.modules() if isinstance(m, nn.Embedding))
    head = _numel(getattr(model, "lm_head", None))
    active = getattr(model, "active_parameters", None)
    return {"total": total, "token_embedding": token, "head": head, "embedding": token + head,
            "non_embedding": total - token - head,
            "active": active() if callable(active) else total}


def _shard_groups(model: nn.Module) -> dict[str, int]:
    """FSDP2's groups as :func:`siamesenorm.parallel.wrap.parallelize` makes them: ``root`` (the
    parameters outside the sublayers) and ``block`` (the largest block's sublayers)."""
    total = _numel(model)
    if not isinstance(model, SchemeHost):
        return {"root": total, "block": 0}
    subs = list(model.sublayers)
    blocks = [sum(_numel(s) for s in subs[i:i + SUBLAYERS_PER_BLOCK])
              for i in range(0, len(subs), SUBLAYERS_PER_BLOCK)]
    return {"root": total - sum(_numel(s) for s in subs), "block": max(blocks, default=0)}


def _precision(cfg: Any) -> str:
    """``bf16`` or ``fp32``: ``train.precision``, with ``auto`` as the run's device decides (bf16 on
    CUDA; ``train.device=auto`` means CUDA when this machine has one)."""
    p, dev = cfg.train.precision, cfg.train.device
    if p != "auto":
        return p
    cuda = dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())
    return "bf16" if cuda else "fp32"


def _activations(model: nn.Module, cfg: Any, dtype: torch.dtype) -> dict[str, int | None]:
    """``activation_memory`` of one micro-batch under each checkpointing mode (None: no estimate)."""
    from ..models.checkpointing import activation_memory

    x, y = get_task(cfg.task).micro_batch(cfg)
    if x.is_floating_point():
        x = x.to(dtype)
    model = model.to(dtype)
    out: dict[str, int | None] = {}
    for mode in CHECKPOINTING_MODES:
        try:
            out[mode] = int(activation_memory(model, x, y, mode))
        except (RuntimeError, NotImplementedError, TypeError, ValueError):  # an op without meta support
            out[mode] = None
    return out


def _memory(engine: str, n: int, p: int, unsharded: int, bf16: bool,
            activations: dict[str, int | None]) -> dict[str, Any]:
    """The terms of one column (docs/scaling.md, "Sizing a run"), in bytes."""
    b = 2 if bf16 else 4
    if engine == "fsdp":
        terms = {"parameters": 4 * p / n + b * unsharded, "weight_copies": 0,
                 "gradients": 4 * p / n + b * unsharded, "buckets": 0, "optimizer": 8 * p / n}
    else:
        terms = {"parameters": 4 * p, "weight_copies": 2 * p if bf16 else 0, "gradients": 4 * p,
                 "buckets": 4 * p if engine == "ddp" else 0, "optimizer": 8 * p}
    terms = {k: int(v) for k, v in terms.items()}
    states = sum(terms.values())
    total = {mode: None if a is None else states + a for mode, a in activations.items()}
    return {"engine": engine, "nproc": n, **terms, "states": states, "activations": activations,
            "total": total}


def dry_run(cfg: Any, nproc: int | None = None) -> dict[str, Any]:
    """The size and cost of the run ``cfg`` at ``nproc`` ranks, from a model built on the meta
    device: parameters, FLOPs and tokens per step, and memory per rank under each engine and
    activation-checkpointing mode (keys: see the return value); nothing is loaded or written."""
    n = world_size(nproc)
    task = get_task(cfg.task)
    engine = parallel_mode(cfg.train.parallel, World(size=n))   # refuses parallel=none at n > 1
    precision = _precision(cfg)
    bf16 = precision == "bf16"
    model = task.build_model(cfg, torch.device("meta"))
    counts = parameter_counts(model)
    groups = _shard_groups(model)
    seq_len = getattr(cfg.data, "seq_len", None)
    flops = model.flops_per_token(seq_len)
    x, _ = task.micro_batch(cfg)
    per_sample = seq_len if seq_len is not None else model.tokens_in(x) // cfg.data.batch_size
    tokens_per_step = n * cfg.data.batch_size * per_sample * cfg.train.grad_accum
    activations = _activations(model, cfg, torch.bfloat16 if bf16 else torch.float32)
    unsharded = groups["root"] + groups["block"]
    columns = [("none", 1), ("ddp", SCALE_OUT), ("fsdp", SCALE_OUT)] if n == 1 else \
        [("ddp", n), ("fsdp", n)]
    memory = [_memory(e, k, counts["total"], unsharded, bf16, activations) for e, k in columns]
    mine = next(c for c in memory if c["engine"] == engine)   # "none" at one rank
    steps = cfg.train.steps
    return {
        "task": cfg.task, "nproc": n, "precision": precision, "parameters": counts,
        "shard_groups": groups, "seq_len": seq_len, "flops_per_token": flops,
        "tokens_per_sample": per_sample, "tokens_per_step": tokens_per_step,
        "batch_size": cfg.data.batch_size, "grad_accum": cfg.train.grad_accum, "steps": steps,
        "tokens": steps * tokens_per_step,
        "flops": None if flops is None else flops * steps * tokens_per_step,
        "activations": activations, "memory": memory,
        "configured": {"parallel": engine, "activation_checkpointing": cfg.train.activation_checkpointing,
                       "total": mine["total"][cfg.train.activation_checkpointing]},
        "model": _describe(cfg),
        "machine": _machine(cfg),
    }


def _machine(cfg: Any) -> dict[str, Any] | None:
    """The device this machine would run ``cfg`` on and its memory in bytes (``None``: the
    configured device is not here, or its memory is unknown)."""
    from ..devices import machine_memory

    name = cfg.train.device
    cuda = name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())
    if (cuda and not torch.cuda.is_available()) or name.startswith("mps"):
        return None
    device = torch.device(name if cuda and name != "auto" else "cuda" if cuda else "cpu")
    memory = machine_memory(device)
    return None if memory is None else {"device": str(device), "memory": memory}


# ---- a floor under a real run's memory, from the configuration alone ------------------------------
# A real run is refused when even this floor exceeds the machine's memory this many times over:
# the estimate leaves out much (see memory_floor), so only a run that cannot fit by far is refused.
MEMORY_MARGIN = 2


def memory_floor(cfg: Any, world_size: int = 1) -> dict[str, int]:
    """A lower bound on the bytes one process of ``cfg`` needs, from its sizes alone:
    ``parameters`` (the estimate plus the scheme's own), ``states`` (16 bytes a parameter, sharded
    under FSDP2), ``buffers``, ``activations`` (each sublayer's input, a language model's fp32
    logits) and ``total``. Left out: the blocks' norms, other saved tensors, the framework."""
    m = cfg.model
    params = m.estimated_parameters() + _scheme_parameters(m)
    engine = parallel_mode(cfg.train.parallel, World(size=world_size))
    states = 16 * params // (world_size if engine == "fsdp" else 1)
    b = 2 if _precision(cfg) == "bf16" else 4
    task = get_task(cfg.task)
    tokens = cfg.data.batch_size * task.tokens_per_sample(cfg)
    head, buffers = task.head_memory(cfg, tokens)
    activations = SUBLAYERS_PER_BLOCK * m.n_layers * tokens * m.dim * b + head
    return {"parameters": params, "states": states, "buffers": buffers, "activations": activations,
            "total": states + buffers + activations}


def _scheme_parameters(m: Any) -> int:
    """The parameters of the model's residual scheme, counted by its class."""
    return m.resolved_scheme.num_parameters(m.dim, m.n_layers, m.norm)


def _bytes(n: int) -> str:
    for unit, size in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def check_fits(cfg: Any, device: torch.device, world_size: int = 1, local_processes: int = 1) -> None:
    """Refuse, in one line and before anything is built or written, a run whose
    :func:`memory_floor` exceeds the memory of ``device`` by :data:`MEMORY_MARGIN` times or more
    (on the CPU the ``local_processes`` ranks of this machine share it; a GPU is each rank's)."""
    from ..devices import machine_memory

    available = machine_memory(device)
    if available is None:
        return
    floor = memory_floor(cfg, world_size)
    sharing = local_processes if device.type == "cpu" else 1
    need = floor["total"] * sharing
    refuse_beyond_memory(need, available, device, f"{floor['parameters']:.3g} parameters: "
                         f"{_bytes(floor['states'] * sharing)} of weights, gradients and AdamW state, "
                         f"{_bytes((floor['activations'] + floor['buffers']) * sharing)} of activations "
                         f"and buffers{f' over {sharing} processes' if sharing > 1 else ''}")


def refuse_beyond_memory(need: int, available: int, device: torch.device, detail: str,
                         fix: str = "shrink the model or the batch (train --dry-run prints the "
                                    "estimate)") -> None:
    """The one-line refusal of :func:`check_fits`, for any estimate ``need`` (``detail``: what it
    is made of; ``fix``: what to do)."""
    if need > MEMORY_MARGIN * available:
        raise UserError(f"this run needs at least {_bytes(need)} ({detail}) but {device.type} memory "
                          f"here is {_bytes(available)}; {fix}")


def _describe(cfg: Any) -> str:
    m = cfg.model
    opts = ", ".join(f"{k}={v}" for k, v in m.scheme_options.items())
    scheme = f"{m.scheme} ({opts})" if opts else m.scheme
    parts = [scheme, f"{m.n_layers} layers x {m.dim}", f"{m.n_heads} heads"]
    if hasattr(m, "vocab_size"):
        tied = "tied" if m.tie_embeddings else "untied"
        parts += [f"vocab {m.vocab_size} ({tied})", f"seq {cfg.data.seq_len}"]
    return ", ".join(parts)


# ---- the table ----------------------------------------------------------------------------------
def _int(v: int) -> str:
    return f"{v:,}"


def _si(v: float, unit: str = "", big: str = "G") -> str:
    """``7.87 GFLOP``; with ``big="B"`` counts read ``1.28 B`` (billions), ``100.0 B tokens``."""
    for factor, prefix in ((1e12, "T"), (1e9, big), (1e6, "M"), (1e3, "k")):
        if abs(v) >= factor:
            sep = "" if unit == "FLOP" else " "
            return f"{v / factor:.{1 if unit == 'tokens' else 2}f} {prefix}{sep}{unit}".rstrip()
    return f"{v:.0f} {unit}".rstrip()


def _gib(v: int | None) -> str:
    return "n/a" if v is None else f"{v / GIB:.2f}"


_ENGINE_NAMES = {"none": "1 process", "ddp": "DDP", "fsdp": "FSDP2"}
_ROWS = (("parameters", "parameters (fp32 master)"), ("weight_copies", "bf16 weight copies"),
         ("gradients", "gradients (fp32)"), ("buckets", "DDP gradient buckets"),
         ("optimizer", "AdamW state (2 x fp32)"))


# Why an activation figure (and the totals with it) reads n/a: _activations caught the failed pass.
UNMEASURED = ("n/a: activations are measured by one micro-batch's forward on the meta device; this "
              "model's forward has an operation that cannot run there")
UNMEASURED_WHY = ("(in a model.family model, transformers' causal mask reads tensor values, which meta "
                  "tensors lack), so they and the totals with them are not estimated")


def format_dry_run(result: dict[str, Any], name: str = "") -> str:
    """``result`` of :func:`dry_run` as the table ``--dry-run`` prints."""
    r, p = result, result["parameters"]
    w = 18
    lines = [f"dry run{' of ' + name if name else ''}: task {r['task']}, {r['model']}",
             f"{'parameters':<{w}}{_int(p['total']):>15}  ({_si(p['total'], big='B')})"]
    emb = f"token embedding {_int(p['token_embedding'])}" + \
        (f" + untied head {_int(p['head'])}" if p["head"] else "")
    lines += [f"{'  embedding':<{w}}{_int(p['embedding']):>15}  ({emb})",
              f"{'  non-embedding':<{w}}{_int(p['non_embedding']):>15}"]
    if p.get("active", p["total"]) != p["total"]:
        lines.append(f"{'  active':<{w}}{_int(p['active']):>15}  ({_si(p['active'], big='B')} "
                     "per token: the routed experts only)")
    if r["flops_per_token"] is None:
        lines.append(f"{'FLOPs per token':<{w}}{'n/a':>15}  (a {r['task']} model has no per-token "
                     "FLOPs formula)")
    else:
        lines.append(f"{'FLOPs per token':<{w}}{_si(r['flops_per_token'], 'FLOP'):>15}  "
                     f"(training: forward + backward, at seq {r['seq_len']})")
    per = "seq" if r["seq_len"] is not None else "tokens/sample"
    ranks = f"{r['nproc']} rank{'s' if r['nproc'] > 1 else ''}"
    lines.append(f"{'tokens per step':<{w}}{_int(r['tokens_per_step']):>15}  = {ranks} x {r['batch_size']} "
                 f"batch x {r['tokens_per_sample']} {per} x {r['grad_accum']} grad_accum")
    if r["nproc"] == 1:
        lines.append(f"{'':<{w}}{_int(SCALE_OUT * r['tokens_per_step']):>15}  at {SCALE_OUT} ranks")
    flops = "" if r["flops"] is None else f", {r['flops']:.2e} FLOPs"
    lines.append(f"{'run':<{w}}{_int(r['steps']):>15}  steps = {_si(r['tokens'], 'tokens', big='B')}"
                 f"{flops} at {ranks}")

    cols = r["memory"]
    heads = [f"{_ENGINE_NAMES[c['engine']]} x{c['nproc']}" if c["engine"] != "none" else "1 process"
             for c in cols]
    cw, lw = 12, 34
    title = f"memory per rank (GiB), {r['precision']}"
    lines += ["", f"{title:<{lw}}" + "".join(f"{h:>{cw}}" for h in heads)]
    for key, label in _ROWS:
        if any(c[key] for c in cols):
            lines.append(f"{'  ' + label:<{lw}}" + "".join(f"{_gib(c[key]):>{cw}}" for c in cols))
    for mode in CHECKPOINTING_MODES:
        lines.append(f"{'  activations, ckpt ' + mode:<{lw}}" +
                     "".join(f"{_gib(c['activations'][mode]):>{cw}}" for c in cols))
    conf = r["configured"]
    mode = conf["activation_checkpointing"]
    lines.append(f"{'  total (ckpt ' + mode + ')':<{lw}}" +
                 "".join(f"{_gib(c['total'][mode]):>{cw}}" for c in cols))
    dtype = "bf16, as FSDP2 computes (DDP's autocast keeps the streams in fp32: more there)" \
        if r["precision"] == "bf16" else "fp32"
    states = next(c["states"] for c in cols if c["engine"] == conf["parallel"])
    need = f"{_gib(conf['total'])} GiB per rank" if conf["total"] is not None else \
        f"n/a GiB per rank ({_gib(states)} without the activations, n/a: see below)"
    lines += ["", f"this run: train.parallel -> {conf['parallel']} at {ranks}, {r['precision']}, "
                  f"activation_checkpointing={mode}: {need}"]
    machine = r.get("machine")
    if machine is not None:
        here = machine["memory"] * (1 if machine["device"].startswith("cuda") else 1 / r["nproc"])
        verdict = "; does NOT fit even without activations: shrink the model" if states > here else \
            "; whether it fits is unknown without the activations" if conf["total"] is None else \
            "; fits" if conf["total"] <= here else "; does NOT fit: shrink the model or the batch"
        lines.append(f"this machine: {_gib(machine['memory'])} GiB of {machine['device']} memory"
                     f"{' shared by the ranks' if r['nproc'] > 1 and machine['device'] == 'cpu' else ''}"
                     f"{verdict}")
    lines.append(f"activations: bytes saved for backward by one micro-batch, measured in {dtype}")
    if any(a is None for a in r["activations"].values()):
        lines += [UNMEASURED, "  " + UNMEASURED_WHY]
    lines.append("not counted: CUDA context, allocator fragmentation, kernel temporaries, compile workspace")
    return "\n".join(lines)
