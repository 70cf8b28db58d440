"""Activation memory and step time of every scheme relative to Pre-Norm, side by side in one process.

For each size and norm, every scheme's language model (vocab 256, fp32, AdamW lr 1e-4) is built
once and all of them see the same random batch; then, round after round, each takes one training
step (forward, backward, optimizer step) in turn, the order rotated every round so machine noise
falls on all alike. Reported per scheme, each with its ratio to Pre-Norm's at the same size and
norm (and on the same path):

- ``saved MiB``: the bytes one training forward keeps for backward, measured on the real device
  with :func:`~siamesenorm.models.checkpointing.saved_activation_bytes` (storages the forward
  creates that are still alive when it returns, each counted once);
- ``step ms``: the median step time over ``--rounds`` rounds (after ``--warmup``) and its ratio to
  Pre-Norm's median; ``per-round / pre`` is the median of the per-round ratios (the scheme's time
  over Pre-Norm's in the same round), the more robust figure on a noisy machine;
- on CUDA, ``peak MiB``: the peak memory of one step (``max_memory_allocated``) over what was
  allocated before its forward (parameters and optimizer state: gradients are released first).

``--reference`` also builds every scheme on the plain path (``use_path("reference")``: modules composed
as written, not the memory-lean functions) and interleaves its steps with the lean ones; rows are
labelled ``lean`` / ``plain`` and the lean rows gain ``saved / plain``, the before/after of the
lean path. All models of one size and norm are alive together: at size 512 about 0.4 GB each
(parameters, gradients, AdamW state), twice as many with ``--reference``.

Sizes: ``default`` (dim 64, 12 blocks, 4 heads, batch 16 x 128: the default preset), ``256`` (dim
256, 12 blocks, 4 heads, batch 8 x 256), ``512`` (dim 512, 8 blocks, 8 heads, batch 4 x 256), and on
request ``2048`` (dim 2048, 2 blocks, 16 heads, batch 1 x 1024: OLMoE's width, for ``--moe``). The
schemes are every registered one plus ``siamese-hybrid_pre`` (SiameseNorm, ``form=hybrid_pre``) and
``pre+value_residual``, ``siamese+value_residual`` (``model.value_residual=true``, ResFormer),
``pre+value_residual-learned`` (with ``model.value_residual_mix=learned``), ``pre+depth_attention``
and ``siamese+depth_attention`` (``model.depth_attention=true``), ``attn_res-block4``
(Block AttnRes, 4 sublayers per block), ``hyper-fracs2`` and ``hyper-fracs4`` (Frac-Connections,
``n_streams=1, fracs=2/4``).

    python benchmarks/memory.py                                    # all schemes, 3 sizes, 2 norms, CPU
    python benchmarks/memory.py --sizes default --norms rmsnorm --schemes pre,siamese --reference
    python benchmarks/memory.py --threads 2 --rounds 30 --markdown memory.md
    python benchmarks/memory.py --device cuda --sizes 256,512 --markdown memory-gpu.md
    python benchmarks/memory.py --sizes 256 --norms rmsnorm --schemes pre,siamese --moe 8,2
    python benchmarks/memory.py --sizes 2048 --norms rmsnorm --schemes pre,siamese --moe 16,8 --rounds 7
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

from siamesenorm.compute import use_path
from siamesenorm.models import LanguageModel, LMConfig, MoEConfig
from siamesenorm.models.checkpointing import saved_activation_bytes
from siamesenorm.nn.norms import NORM_KINDS
from siamesenorm.schemes import list_schemes

VOCAB = 256
# name: (dim, blocks, heads, batch, tokens per sequence)
SIZES = {"default": (64, 12, 4, 16, 128), "256": (256, 12, 4, 8, 256), "512": (512, 8, 8, 4, 256),
         "2048": (2048, 2, 16, 1, 1024)}
# measured unless --sizes names others; 2048 (OLMoE's width, two blocks) is for --moe on CPU or a GPU
DEFAULT_SIZES = ("default", "256", "512")
# variant name: (scheme, scheme_options, other model options)
VARIANTS = {"siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"}, {}),
            "attn_res-block4": ("attn_res", {"block_size": 4}, {}),
            "hyper-fracs2": ("hyper", {"n_streams": 1, "fracs": 2}, {}),     # Frac-Connections
            "hyper-fracs4": ("hyper", {"n_streams": 1, "fracs": 4}, {}),
            "pre+value_residual": ("pre", {}, {"value_residual": True}),
            "siamese+value_residual": ("siamese", {}, {"value_residual": True}),
            "pre+value_residual-learned": ("pre", {}, {"value_residual": True,
                                                       "value_residual_mix": "learned"}),
            "pre+depth_attention": ("pre", {}, {"depth_attention": True}),          # arXiv 2606.05014
            "siamese+depth_attention": ("siamese", {}, {"depth_attention": True})}
MIB = 2**20
# --moe E,K: every block's MLP is a mixture of E SwiGLU experts (hidden dim / 2, as OLMoE's), K per
# token; None: dense MLPs.
MOE: tuple[int, int] | None = None


def all_specs() -> list[str]:
    return [*list_schemes(), *VARIANTS]


def build(spec: str, size: str, norm: str, device: torch.device):
    """The model and optimizer of scheme (or variant) ``spec``; same seed for every scheme."""
    scheme, options, model_options = VARIANTS.get(spec, (spec, {}, {}))
    dim, blocks, heads, _, seq = SIZES[size]
    torch.manual_seed(0)
    moe = MoEConfig(every=1, n_experts=MOE[0], top_k=MOE[1]) if MOE else MoEConfig()
    cfg = LMConfig(vocab_size=VOCAB, dim=dim, n_layers=blocks, n_heads=heads, max_seq_len=seq,
                   scheme=scheme, scheme_options=dict(options), norm=norm, moe=moe, **model_options)
    model = LanguageModel(cfg, device=device).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch_for(size: str, device: torch.device) -> torch.Tensor:
    """The random batch of ``size`` (inputs and shifted targets): the same for every scheme and norm."""
    _, _, _, batch, seq = SIZES[size]
    gen = torch.Generator().manual_seed(1234 + list(SIZES).index(size))
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(device)


def measure(size: str, norm: str, specs: list[str], args, device: torch.device) -> list[dict]:
    """Saved bytes, step times (and on CUDA peak memory) of every scheme at one size and norm."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    paths = (False, True) if args.reference else (False,)          # the reference path?
    keys = [(spec, ref) for spec in specs for ref in paths]
    models = {key: build(key[0], size, norm, device) for key in keys}
    x = batch_for(size, device)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step(key) -> tuple[float, int]:
        """One training step: its time, and (CUDA) its peak bytes over those allocated before."""
        model, opt = models[key]
        with use_path("reference" if key[1] else "kernels"):
            opt.zero_grad(set_to_none=True)
            sync()
            before = 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            loss = model(inputs, targets).loss
            loss.backward()
            opt.step()
            sync()
            elapsed = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
        return elapsed, peak

    saved, peak = {}, {}
    for key in keys:
        model = models[key][0]
        with use_path("reference" if key[1] else "kernels"):
            saved[key] = saved_activation_bytes(lambda m=model: m(inputs, targets).loss)
        if cuda:
            step(key)                               # first step creates the AdamW state
            peak[key] = step(key)[1]
    times: dict = {key: [] for key in keys}
    for r in range(args.warmup + args.rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            t, _ = step(key)
            if r >= args.warmup:
                times[key].append(t)

    rows = []
    for key in keys:
        base = ("pre", key[1])
        med, base_med = statistics.median(times[key]), statistics.median(times[base])
        row = {"scheme": key[0], "path": "plain" if key[1] else "lean",
               "params": models[key][0].num_parameters() / 1e6,
               "saved_mib": saved[key] / MIB, "saved_ratio": saved[key] / saved[base],
               "step_ms": 1e3 * med, "step_ratio": med / base_med,
               "round_ratio": statistics.median(a / b for a, b in zip(times[key], times[base]))}
        if args.reference:
            row["saved_vs_plain"] = (saved[key] / saved[(key[0], True)]) if not key[1] else None
        if cuda:
            row |= {"peak_mib": peak[key] / MIB, "peak_ratio": peak[key] / peak[base]}
        rows.append(row)
    models.clear()                                  # free them before the next size
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


COLUMNS = [  # key, header, format
    ("scheme", "scheme", "{}"), ("path", "path", "{}"), ("params", "params M", "{:.2f}"),
    ("saved_mib", "saved MiB", "{:.1f}"), ("saved_ratio", "saved / pre", "{:.3f}"),
    ("saved_vs_plain", "saved / plain", "{:.3f}"),
    ("step_ms", "step ms", "{:.1f}"), ("step_ratio", "step / pre", "{:.3f}"),
    ("round_ratio", "per-round / pre", "{:.3f}"),
    ("peak_mib", "peak MiB", "{:.1f}"), ("peak_ratio", "peak / pre", "{:.3f}"),
]


def table(rows: list[dict], markdown: bool) -> str:
    """The rows as an aligned text table, or as a Markdown table."""
    cols = [c for c in COLUMNS if c[0] in rows[0]]
    if len({r["path"] for r in rows}) == 1:
        cols = [c for c in cols if c[0] != "path"]
    cells = [["" if r[k] is None else fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    heads = [h for _, h, _ in cols]
    if markdown:
        align = ["---" if k in ("scheme", "path") else "---:" for k, _, _ in cols]
        lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(align) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(items: list[str]) -> str:
        return "  ".join(s.ljust(w) if i == 0 else s.rjust(w)
                         for i, (s, w) in enumerate(zip(items, widths)))

    return "\n".join([line(heads)] + [line(c) for c in cells])


def split(value: str, known, what: str, parser: argparse.ArgumentParser) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    for v in items:
        if v not in known:
            parser.error(f"unknown {what} {v!r}; choose from {', '.join(known)}")
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                   help=f"comma list of {', '.join(SIZES)} (default: {','.join(DEFAULT_SIZES)})")
    p.add_argument("--norms", default="rmsnorm,layernorm", help="comma list of norm kinds")
    p.add_argument("--schemes", default=",".join(all_specs()),
                   help="comma list of schemes or variants (pre is always included)")
    p.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--reference", action="store_true",
                   help="also measure the plain path (use_path('reference')), interleaved")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="also write the tables to FILE as Markdown")
    p.add_argument("--moe", default=None, metavar="E,K",
                   help="mixture-of-experts MLPs in every block: E experts, K per token")
    args = p.parse_args()
    if args.moe is not None:
        global MOE
        try:
            experts, k = (int(v) for v in args.moe.split(","))
            MoEConfig(every=1, n_experts=experts, top_k=k)
        except ValueError as error:     # a ConfigError is a ValueError too
            p.error(f"--moe takes E,K (experts, experts per token): {error}")
        MOE = (experts, k)
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be at least 1 and --warmup at least 0")
    sizes = split(args.sizes, list(SIZES), "size", p)
    norms = split(args.norms, list(NORM_KINDS), "norm", p)
    specs = split(args.schemes, all_specs(), "scheme", p)
    specs = ["pre", *dict.fromkeys(s for s in specs if s != "pre")]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)

    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = platform.processor() or platform.machine()
    header = (f"device {device} ({what}), torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, fp32, median of {args.rounds} interleaved "
              f"rounds after {args.warmup} warm-up; command: "
              f"python {shlex.join(sys.argv)}")
    print(header, flush=True)
    parts = [header]
    for size in sizes:
        dim, blocks, heads, batch, seq = SIZES[size]
        for norm in norms:
            title = (f"size {size}: dim {dim}, {blocks} blocks, {heads} heads, "
                     f"batch {batch} x {seq}, {norm}")
            if MOE:
                title += f", MoE {MOE[0]} experts, {MOE[1]} per token"
            rows = measure(size, norm, specs, args, device)
            print(f"\n{title}\n{table(rows, markdown=False)}", flush=True)
            parts.append(f"\n### {title}\n\n{table(rows, markdown=True)}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(parts) + "\n")
        print(f"\nwrote {args.markdown}")


if __name__ == "__main__":
    main()
