"""Activation memory and step time of every scheme relative to Pre-Norm, side by side in one process.

For each size and norm, every scheme's language model is built once; then, round after round, each
takes one training step (forward, backward, AdamW) in turn, the order rotated every round so machine
noise falls on all alike. Reported per scheme: the bytes its forward keeps for backward
(``saved_activation_bytes``: storages a forward leaves alive, counted once) and their ratio to
Pre-Norm's; the median step time, its ratio to Pre-Norm's median, and the median of the per-round
ratios (more robust on a noisy machine); on CUDA also the peak memory of a step over what was
allocated before it. ``--reference`` adds every scheme on the plain path (``reference_path()``),
interleaved with the lean one, so the gain is visible.

    python benchmarks/memory.py                                    # all schemes, 3 sizes, 2 norms
    python benchmarks/memory.py --sizes default --norms rmsnorm --schemes pre,siamese --reference
    python benchmarks/memory.py --device cuda --markdown results.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.models.checkpointing import saved_activation_bytes
from siamesenorm.nn.fused import reference_path
from siamesenorm.schemes import list_schemes

# name: (dim, blocks, heads, batch, tokens per sequence)
SIZES = {"default": (64, 12, 4, 16, 128), "256": (256, 12, 4, 8, 256), "512": (512, 8, 8, 4, 256)}
VARIANTS = {"siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"})}


def build(spec: str, size: str, norm: str, device: torch.device):
    name, options = VARIANTS.get(spec, (spec, {}))
    dim, blocks, heads, _, seq = SIZES[size]
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, dim=dim, n_layers=blocks, n_heads=heads, max_seq_len=seq,
                   scheme=name, scheme_options=options, norm=norm)
    model = LanguageModel(cfg, device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def measure(size: str, norm: str, specs: list[str], args, device: torch.device) -> list[dict]:
    _, _, _, batch, seq = SIZES[size]
    paths = (False, True) if args.reference else (False,)
    keys = [(s, ref) for s in specs for ref in paths]
    models = {k: build(k[0], size, norm, device) for k in keys}
    x = torch.randint(0, 256, (batch, seq + 1), device=device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(key) -> float:
        model, opt = models[key]
        sync()
        t0 = time.perf_counter()
        with reference_path(key[1]):
            loss = model(x[:, :-1], x[:, 1:]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sync()
        return time.perf_counter() - t0

    saved, peak = {}, {}
    for key in keys:
        model = models[key][0]
        with reference_path(key[1]):
            saved[key] = saved_activation_bytes(lambda m=model: m(x[:, :-1], x[:, 1:]).loss)
        if cuda:
            step(key)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step(key)
            peak[key] = torch.cuda.max_memory_allocated() - before
    times = {k: [] for k in keys}
    for r in range(args.warmup + args.rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            t = step(key)
            if r >= args.warmup:
                times[key].append(t)
    rows = []
    for key in keys:
        base = ("pre", key[1])
        row = {"scheme": key[0], "path": "reference" if key[1] else "lean",
               "saved_mib": saved[key] / 2**20, "saved_ratio": saved[key] / saved[base],
               "step_ms": 1e3 * statistics.median(times[key]),
               "step_ratio": statistics.median(times[key]) / statistics.median(times[base]),
               "round_ratio": statistics.median(a / b for a, b in zip(times[key], times[base]))}
        if cuda:
            row |= {"peak_mib": peak[key] / 2**20, "peak_ratio": peak[key] / peak[base]}
        rows.append(row)
    return rows


def table(rows: list[dict], markdown: bool) -> str:
    cols = [("scheme", "scheme", "{}"), ("path", "path", "{}"), ("saved_mib", "saved MiB", "{:.1f}"),
            ("saved_ratio", "saved / pre", "{:.3f}"), ("step_ms", "step ms", "{:.1f}"),
            ("step_ratio", "step / pre", "{:.3f}"), ("round_ratio", "per-round / pre", "{:.3f}")]
    if "peak_mib" in rows[0]:
        cols += [("peak_mib", "CUDA peak MiB", "{:.1f}"), ("peak_ratio", "peak / pre", "{:.3f}")]
    cells = [[fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(h for _, h, _ in cols) + " |",
                 "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    out = ["  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths))]
    return "\n".join(out + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--norms", default="rmsnorm,layernorm")
    p.add_argument("--schemes", default=",".join([*list_schemes(), *VARIANTS]))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reference", action="store_true", help="also measure the plain path")
    p.add_argument("--markdown", default=None, help="also write the tables to this Markdown file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [s for s in args.schemes.split(",") if s]
    specs = ["pre", *[s for s in specs if s != "pre"]]
    for s in specs:
        if s not in VARIANTS and s not in list_schemes():
            p.error(f"unknown scheme {s!r}; choose from {', '.join([*list_schemes(), *VARIANTS])}")
    for s in args.sizes.split(","):
        if s not in SIZES:
            p.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    header = (f"device {device} ({name or platform.machine()}), torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds; "
              f"command: python {' '.join(sys.argv)}")
    print(header)
    parts = [header]
    for size in args.sizes.split(","):
        for norm in args.norms.split(","):
            dim, blocks, _, batch, seq = SIZES[size]
            title = f"size {size}: dim {dim}, {blocks} blocks, batch {batch} x {seq}, {norm}"
            rows = measure(size, norm, specs, args, device)
            print(f"\n{title}\n{table(rows, False)}", flush=True)
            parts.append(f"\n#### {title}\n\n{table(rows, True)}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
