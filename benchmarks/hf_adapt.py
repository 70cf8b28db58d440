"""A transformers Qwen3 under ``siamesenorm.hf.adapt``: training-step time and saved activations.

Three models built from the same Qwen3 weights: the family's own ``Qwen3ForCausalLM``
(``original``), ``adapt(original, "pre")`` (the same function through our ``ResidualStack``) and
``adapt(original, "siamese")``. Their forward + backward steps (``labels`` given, no optimiser) are
interleaved, round after round, so machine noise falls on all alike; reported are the median step
times and the ratios adapted-pre / original (the overhead of running the family's layers through
the stack: expected 1.00 +- 0.02) and siamese / adapted-pre (what SiameseNorm's second stream
costs), and the bytes each forward keeps for backward
(:func:`siamesenorm.models.checkpointing.saved_activation_bytes`).

    python benchmarks/hf_adapt.py                                  # 4 layers, width 256, CPU
    python benchmarks/hf_adapt.py --layers 12 --dim 512 --seq 512 --device cuda --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import siamesenorm.hf as H
from siamesenorm.models.checkpointing import saved_activation_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default 3 x dim)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.dim, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.dim // args.heads, intermediate_size=args.ffn or 3 * args.dim,
        max_position_embeddings=args.seq, use_cache=False)
    cfg._attn_implementation = args.attn
    original = transformers.Qwen3ForCausalLM(cfg).to(dev).train()
    models = {"original": original, "pre": H.adapt(original, "pre").train(),
              "siamese": H.adapt(original, "siamese").train()}
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(model) -> float:
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        model(x, labels=x).loss.backward()
        sync()
        return time.perf_counter() - t0

    with torch.no_grad():
        ref = original(x).logits
        same = (models["pre"](x).logits - ref).abs().max().item()
    saved = {name: saved_activation_bytes(lambda m=m: m(x, labels=x).loss) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.warmup + args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            t = step(models[name])
            if r >= args.warmup:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"Qwen3 {args.layers} layers, width {args.dim}, {args.heads}/{args.kv_heads} heads, batch "
          f"{args.batch} x {args.seq} tokens, {args.attn}, {dev.type}"
          + (f" ({args.threads} threads)" if dev.type == "cpu" else "")
          + f"; {args.rounds} interleaved rounds; pre vs original max |logit diff| {same:.1e}")
    print(f"{'model':<10}{'step ms (median)':>18}{'saved MiB':>12}")
    for name in models:
        print(f"{name:<10}{1e3 * med[name]:>18.2f}{saved[name] / 2**20:>12.2f}")
    print(f"adapted-pre / original: time {med['pre'] / med['original']:.3f}, "
          f"saved {saved['pre'] / saved['original']:.3f}")
    print(f"siamese / adapted-pre:  time {med['siamese'] / med['pre']:.3f}, "
          f"saved {saved['siamese'] / saved['pre']:.3f}")


if __name__ == "__main__":
    main()
