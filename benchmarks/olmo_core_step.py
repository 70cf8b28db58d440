"""Step time and memory of SiameseNorm relative to Pre-Norm inside OLMo-core, side by side in one process.

Each variant is our scheme as an OLMo-core model (``siamesenorm.olmo_core.olmo_config`` of the same
``LMConfig`` but for the scheme), trained by OLMo-core's own ``TransformerTrainModule`` (its init,
its AdamW, its loss) in one process. All variants see the same random batch; round after round each
takes one training step (``zero_grads``, ``model_forward`` with labels, ``backward``,
``optim_step``) in turn, the order rotated every round so that machine noise falls on all alike.
Reported per variant, with its ratio to Pre-Norm's at the same size:

- ``saved MiB``: the bytes one training forward keeps for backward (storages the forward creates
  that are still alive when it returns, each counted once:
  :func:`~siamesenorm.models.checkpointing.saved_activation_bytes`), the activation memory of a
  step; on CPU there is no allocator peak to read, so this is the memory figure there;
- ``step ms``: the median step time over ``--rounds`` rounds after ``--warmup``, and
  ``per-round / pre``, the median of the per-round ratios (the more robust figure on a noisy
  machine);
- on CUDA, ``peak MiB``: the peak of one step (``max_memory_allocated``) over what was allocated
  before its forward (parameters, gradients and AdamW state).

Sizes: ``tiny`` (the entry point's ``tiny`` config: dim 64, 2 blocks, 4 heads, SwiGLU 128, vocab
256, batch 4 x 64), ``256`` (dim 256, 12 blocks, 4 heads, SwiGLU 683 -> our LMConfig's default,
vocab 256, batch 8 x 256). Every variant has QK-norm and untied embeddings, as the OLMo presets
(``hybrid_pre`` adds the v norm to it). Needs the ``olmo`` extra.

    python benchmarks/olmo_core_step.py                                  # tiny and 256, CPU
    python benchmarks/olmo_core_step.py --sizes 256 --rounds 31 --threads 2
    python benchmarks/olmo_core_step.py --device cuda --sizes 256,1024 --markdown olmo-gpu.md
"""

from __future__ import annotations

import argparse
import gc
import platform
import shlex
import statistics
import sys
import time

import torch

try:
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import TransformerTrainModuleConfig
except ImportError:                                     # pragma: no cover - printed for the user
    sys.exit("benchmarks/olmo_core_step.py needs the olmo extra: pip install 'siamesenorm[olmo]'")

from siamesenorm.models import LMConfig
from siamesenorm.models.checkpointing import saved_activation_bytes
from siamesenorm.olmo_core import olmo_config

VOCAB = 256
# name: (dim, blocks, heads, mlp hidden or None for LMConfig's default, batch, tokens per sequence)
SIZES = {"tiny": (64, 2, 4, 128, 4, 64), "256": (256, 12, 4, None, 8, 256),
         "1024": (1024, 8, 16, None, 4, 1024)}
DEFAULT_SIZES = ("tiny", "256")
# variant: (scheme, options)
VARIANTS = {"pre": ("pre", {}), "siamese": ("siamese", {}),
            "siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"})}
MIB = 2**20


def lm_config(variant: str, size: str) -> LMConfig:
    scheme, options = VARIANTS[variant]
    dim, blocks, heads, hidden, _, seq = SIZES[size]
    extra = {} if hidden is None else {"mlp_hidden": hidden}
    return LMConfig(vocab_size=VOCAB, dim=dim, n_layers=blocks, n_heads=heads, max_seq_len=seq,
                    scheme=scheme, scheme_options=dict(options), tie_embeddings=False, qk_norm=True,
                    **extra)


def build(variant: str, size: str, device: torch.device):
    """OLMo-core's train module around the variant's model (built on meta, initialised by it)."""
    _, _, _, _, batch, seq = SIZES[size]
    config = olmo_config(lm_config(variant, size), init_seed=0)
    return TransformerTrainModuleConfig(
        rank_microbatch_size=batch * seq, max_sequence_length=seq,
        optim=AdamWConfig(lr=1e-4, weight_decay=0.0),
    ).build(config.build(init_device="meta"), device=device)


def batch_for(size: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, _, _, batch, seq = SIZES[size]
    gen = torch.Generator().manual_seed(1234 + list(SIZES).index(size))
    x = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(device)
    return x[:, :-1], x[:, 1:]


def measure(size: str, variants: list[str], args, device: torch.device) -> list[dict]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    modules = {v: build(v, size, device) for v in variants}
    inputs, labels = batch_for(size, device)

    def step(v: str) -> tuple[float, int]:
        tm = modules[v]
        tm.zero_grads()
        sync()
        before = 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        loss = tm.model_forward(inputs, labels=labels).loss
        loss.backward()
        tm.optim_step()
        sync()
        elapsed = time.perf_counter() - t0
        return elapsed, (torch.cuda.max_memory_allocated(device) - before if cuda else 0)

    saved, peak = {}, {}
    for v in variants:
        tm = modules[v]
        tm.model.train()
        saved[v] = saved_activation_bytes(lambda tm=tm: tm.model_forward(inputs, labels=labels).loss)
        if cuda:
            step(v)                                 # the first step creates the AdamW state
            peak[v] = step(v)[1]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.warmup + args.rounds):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            t, _ = step(v)
            if r >= args.warmup:
                times[v].append(t)
    rows = []
    for v in variants:
        med, base = statistics.median(times[v]), statistics.median(times["pre"])
        row = {"size": size, "variant": v,
               "params": sum(p.numel() for p in modules[v].model.parameters()) / 1e6,
               "saved_mib": saved[v] / MIB, "saved_ratio": saved[v] / saved["pre"],
               "step_ms": 1e3 * med, "step_ratio": med / base,
               "round_ratio": statistics.median(a / b for a, b in zip(times[v], times["pre"]))}
        if cuda:
            row |= {"peak_mib": peak[v] / MIB, "peak_ratio": peak[v] / peak["pre"]}
        rows.append(row)
    modules.clear()
    gc.collect()
    return rows


COLUMNS = [("size", "size", "{}"), ("variant", "variant", "{}"), ("params", "params M", "{:.2f}"),
           ("saved_mib", "saved MiB", "{:.1f}"), ("saved_ratio", "saved / pre", "{:.3f}"),
           ("step_ms", "step ms", "{:.1f}"), ("step_ratio", "step / pre", "{:.3f}"),
           ("round_ratio", "per-round / pre", "{:.3f}"),
           ("peak_mib", "peak MiB", "{:.1f}"), ("peak_ratio", "peak / pre", "{:.3f}")]


def table(rows: list[dict], markdown: bool) -> str:
    cols = [c for c in COLUMNS if c[0] in rows[0]]
    cells = [[fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    heads = [h for _, h, _ in cols]
    if markdown:
        align = ["---" if k in ("size", "variant") else "---:" for k, _, _ in cols]
        return "\n".join(["| " + " | ".join(heads) + " |", "|" + "|".join(align) + "|"]
                         + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    return "\n".join("  ".join(s.ljust(w) if i < 2 else s.rjust(w)
                               for i, (s, w) in enumerate(zip(line, widths)))
                     for line in [heads] + cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown to this file")
    args = p.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    for name, known, what in ((sizes, SIZES, "size"), (variants, VARIANTS, "variant")):
        for item in name:
            if item not in known:
                p.error(f"unknown {what} {item!r}; choose from {', '.join(known)}")
    if "pre" not in variants:
        variants.insert(0, "pre")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [row for size in sizes for row in measure(size, variants, args, device)]
    print(f"# {shlex.join(sys.argv)}  (torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads, {device})")
    print(table(rows, markdown=False))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table(rows, markdown=True) + "\n")


if __name__ == "__main__":
    main()
