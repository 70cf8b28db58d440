"""Training across processes: throughput of 1 process vs N (DDP, FSDP2) and the per-rank bytes of
parameters, gradients and optimizer state, measured on this machine with the library's own engine.

Each variant (1 process; N processes with DDP; N with FSDP2) is one launch of this script's worker
through :func:`siamesenorm.parallel.launch.launch` (torchrun's agent, gloo on CPU, nccl on CUDA).
The variants are interleaved, round after round, so machine noise falls on all of them alike; a
launch times ``--steps`` optimizer steps after ``--warmup`` and reports its median step, and the
figure printed is the median over the rounds. The processes share the machine's cores: N processes
get ``cores / N`` threads each, the single process all of them, so on a CPU the ratio shows the
cost of the communication, not a speed-up. Weak scaling: every rank trains ``--batch`` sequences,
so N processes train N times the tokens of one per step.

Memory is counted, not sampled: after the first step every rank adds the bytes of its own share of
the parameters, of the gradients and of the AdamW state (a sharded tensor's local shard), and the
largest rank's sum is printed. DDP's gradient buckets (one more gradient copy) are not tensors of
the model and are left out.

    python benchmarks/scaling.py                       # ~50M-parameter SiameseNorm LM, 2 processes
    python benchmarks/scaling.py --nproc 4 --scheme pre --dim 768 --layers 12 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t     # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    return {"parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params),
            "optimizer": sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from siamesenorm.models import LanguageModel, LMConfig
    from siamesenorm.parallel import init_world, leave_world
    from siamesenorm.parallel.wrap import parallelize

    world, device = init_world(args.device)
    try:
        torch.manual_seed(0)
        cfg = LMConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                       n_heads=args.heads, max_seq_len=args.seq, scheme=args.scheme)
        model = LanguageModel(cfg, device=device)
        par = parallelize(model, args.mode if world.distributed else "none", world, device, "fp32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1 + world.rank)
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        times, memory = [], None
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            loss = par.module(x[:, :-1], x[:, 1:]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            if memory is None:
                memory = _state_bytes(model, optimizer)
        step = torch.tensor([statistics.median(times)], dtype=torch.float64)
        mem = torch.tensor([memory[k] for k in ("parameters", "gradients", "optimizer")],
                           dtype=torch.float64)
        if world.distributed:            # the slowest rank sets the pace; the fullest sets memory
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        if world.main:
            Path(args.result).write_text(json.dumps({
                "step_s": step.item(), "tokens": world.size * args.batch * args.seq,
                "params": sum(p.numel() for p in model.parameters()),
                "bytes": dict(zip(("parameters", "gradients", "optimizer"), map(int, mem.tolist())))}))
    finally:
        leave_world(world)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheme", default="siamese")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        p = argparse.ArgumentParser()
        _options(p)
        p.add_argument("--mode", required=True)
        p.add_argument("--result", required=True)
        worker(p.parse_args(sys.argv[2:]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _options(p)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from siamesenorm.parallel.launch import launch

    variants = [("1 process", 1, "none"), (f"DDP x{args.nproc}", args.nproc, "ddp"),
                (f"FSDP2 x{args.nproc}", args.nproc, "fsdp")]
    common = _forwarded(args)
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, nproc, mode in variants:
                out = Path(tmp) / f"{mode}-{r}.json"
                launch(nproc, [__file__, "worker", *common, "--mode", mode, "--result", str(out)],
                       what="benchmark")
                results[name].append(json.loads(out.read_text()))
                print(f"round {r + 1}/{args.rounds}: {name:<10} "
                      f"{results[name][-1]['step_s'] * 1e3:8.1f} ms/step", flush=True)
    first = results[variants[0][0]][0]
    print(f"\n{args.scheme} LM, {first['params'] / 1e6:.1f}M parameters ({args.layers} x {args.dim}, "
          f"vocab {args.vocab}), {args.batch} x {args.seq} tokens per rank and step, fp32, "
          f"device {args.device}; medians of {args.rounds} interleaved rounds of {args.steps} steps")
    base = None
    print(f"{'':<12}{'ms/step':>9}{'tokens/s':>10}{'vs 1 proc':>10}"
          f"{'params MiB':>12}{'grads MiB':>11}{'AdamW MiB':>11}{'states vs 1':>13}")
    for name, _, _ in variants:
        rows = results[name]
        step = statistics.median(r["step_s"] for r in rows)
        tps = rows[0]["tokens"] / step
        b = rows[0]["bytes"]
        states = sum(b.values())
        base = base or (tps, states)
        print(f"{name:<12}{step * 1e3:>9.1f}{tps:>10.0f}{tps / base[0]:>10.2f}"
              f"{b['parameters'] / 2**20:>12.1f}{b['gradients'] / 2**20:>11.1f}"
              f"{b['optimizer'] / 2**20:>11.1f}{states / base[1]:>13.2f}")


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The worker's options, as this run has them."""
    keys = ("scheme", "vocab", "dim", "layers", "heads", "batch", "seq", "steps", "warmup", "device")
    return [item for k in keys for item in (f"--{k}", str(getattr(args, k)))]


if __name__ == "__main__":
    main()
