"""Training-step time of each scheme relative to Pre-Norm, measured side by side in one process.

Every scheme gets the same model size and batch; the schemes' steps are interleaved, round after
round, so machine noise falls on all of them alike; the figure reported is the median step time
over the rounds and its ratio to Pre-Norm's median.

    python benchmarks/step_time.py                         # default: 12 blocks, dim 128, CPU
    python benchmarks/step_time.py --schemes pre,siamese --layers 24 --dim 256 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.schemes import list_schemes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(list_schemes()))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    names = args.schemes.split(",")
    if "pre" not in names:
        names.insert(0, "pre")
    dev = torch.device(args.device)
    models, optims = {}, {}
    for name in names:
        torch.manual_seed(0)
        cfg = LMConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       max_seq_len=args.seq, scheme=name)
        models[name] = LanguageModel(cfg, device=dev)
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    x = torch.randint(0, 256, (args.batch, args.seq + 1), device=dev)
    times: dict[str, list[float]] = {n: [] for n in names}

    def step(name: str) -> float:
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        loss = models[name](x[:, :-1], x[:, 1:]).loss
        optims[name].zero_grad(set_to_none=True)
        loss.backward()
        optims[name].step()
        sync()
        return time.perf_counter() - t0

    for r in range(args.warmup + args.rounds):
        for name in names:
            t = step(name)
            if r >= args.warmup:
                times[name].append(t)
    base = statistics.median(times["pre"])
    print(f"device {dev}, {args.layers} blocks, dim {args.dim}, batch {args.batch} x {args.seq}, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'scheme':<12}{'params':>12}{'step ms':>10}{'/ pre':>8}")
    for name in names:
        med = statistics.median(times[name])
        print(f"{name:<12}{models[name].num_parameters():>12,}{1e3 * med:>10.1f}{med / base:>8.3f}")


if __name__ == "__main__":
    main()
