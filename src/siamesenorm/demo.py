"""``siamesenorm demo``: several schemes in the same language model, trained side by side on
embedded text (the same data order and seed, steps interleaved)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from .analysis.probes import block_grad_norms, stream_rms
from .devices import check_threads, choose_threads, machine_memory, use_threads
from .errors import UserError
from .models import LanguageModel, LMConfig
from .schemes import list_schemes
from .tasks.dryrun import refuse_beyond_memory


def embedded_text() -> bytes:
    return Path(argparse.__file__).read_bytes()


def _refuse_beyond_memory(configs: list[LMConfig], batch: int, seq: int) -> None:
    """Refuse, before anything is built, models far beyond this machine's memory: the demo holds every
    scheme's model, gradients, AdamW state and activations at once."""
    available = machine_memory(torch.device("cpu"))
    if available is None:
        return
    params = sum(c.estimated_parameters() for c in configs)
    activations = sum(batch * seq * (2 * c.n_layers * c.dim + c.vocab_size) * 4 for c in configs)
    refuse_beyond_memory(16 * params + activations, available, torch.device("cpu"),
                         f"{len(configs)} models of {params / len(configs):.3g} parameters with their "
                         "gradients, AdamW state and activations",
                         fix="lower --dim or --layers, or give fewer --schemes")


def run_demo(schemes: list[str], n_layers: int = 12, dim: int = 64, steps: int = 60,
             lr: float = 3e-3, seed: int = 0, batch: int = 8, seq: int = 64,
             threads: int | None = None) -> dict:
    """Train ``schemes`` side by side; ``threads``: intra-op threads (``None``: :func:`choose_threads`)."""
    unknown = [s for s in schemes if s not in list_schemes()]
    if unknown:
        raise UserError(f"unknown scheme {unknown[0]!r}; choose from {', '.join(list_schemes())}")
    if steps <= 0 or n_layers <= 0 or dim <= 0 or not lr > 0:
        raise UserError("steps, layers, dim and lr must be positive")
    choice = choose_threads(check_threads(threads, "--threads"), ceiling=torch.get_num_threads())
    with use_threads(choice):
        return _side_by_side(schemes, n_layers, dim, steps, lr, seed, batch, seq, choice.line())


def _side_by_side(schemes: list[str], n_layers: int, dim: int, steps: int, lr: float, seed: int,
                  batch: int, seq: int, threads_line: str) -> dict:
    data = torch.frombuffer(bytearray(embedded_text()), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    heads = max(1, dim // 32)
    configs = {name: LMConfig(vocab_size=256, dim=dim, n_layers=n_layers, n_heads=heads, max_seq_len=seq,
                              scheme=name) for name in schemes}       # sizes checked before any is built
    _refuse_beyond_memory(list(configs.values()), batch, seq)
    print(threads_line)
    models, optims = {}, {}
    for name in schemes:
        torch.manual_seed(seed)
        models[name] = LanguageModel(configs[name])
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=lr, betas=(0.9, 0.95),
                                         weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)

    def batch_from(source: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(source) - seq - 1, (batch,), generator=g)
        x = torch.stack([source[i:i + seq] for i in idx])
        y = torch.stack([source[i + 1:i + seq + 1] for i in idx])
        return x, y

    x0, y0 = batch_from(train, torch.Generator().manual_seed(seed + 1))
    print(f"data: {len(data):,} bytes of {Path(argparse.__file__).name} "
          f"(train {len(train):,}, val {len(val):,}); model: {n_layers} blocks, dim {dim}")
    print("\nat initialisation (same batch for every scheme):")
    for name, model in models.items():
        with torch.no_grad():
            rms = stream_rms(model, x0)
        model(x0, y0).loss.backward()
        g = block_grad_norms(model)
        model.zero_grad(set_to_none=True)
        streams = "  ".join(f"{k}: {v[0]:.3g} -> {v[-1]:.3g}" for k, v in rms.items())
        print(f"  {name:<10} params {model.num_parameters():>9,}  hidden RMS block 1 -> "
              f"{n_layers}: {streams}   grad first/last block {g[0] / g[-1]:.3g}")

    losses = {name: [] for name in schemes}
    seconds = {name: 0.0 for name in schemes}
    print(f"\ntraining {steps} steps, batch {batch} x {seq}, AdamW lr {lr} (no warm-up):")
    for step in range(1, steps + 1):
        x, y = batch_from(train, gen)
        for name in schemes:  # interleaved: every scheme sees this batch now
            t0 = time.perf_counter()
            loss = models[name](x, y).loss
            optims[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
            optims[name].step()
            seconds[name] += time.perf_counter() - t0
            losses[name].append(loss.item())
        if step % max(1, steps // 6) == 0 or step == steps:
            cells = "  ".join(f"{n} {losses[n][-1]:.3f}" for n in schemes)
            print(f"  step {step:>4}  {cells}")

    result = {}
    vgen = torch.Generator().manual_seed(seed + 2)
    val_batches = [batch_from(val, vgen) for _ in range(8)]
    print("\nvalidation (8 batches):")
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            v = sum(model(x, y).loss.item() for x, y in val_batches) / len(val_batches)
        tok_s = steps * batch * seq / seconds[name]
        finite = all(math.isfinite(x) for x in losses[name])
        result[name] = {"val_loss": v, "tokens_per_s": tok_s, "finite": finite}
        print(f"  {name:<10} val loss {v:.4f}  ({tok_s:,.0f} tokens/s)"
              f"{'' if finite else '  non-finite training loss!'}")
    return result
