"""Bytes moved per compiled training step of each scheme, as ratios to Pre-Norm, beside its floor.

A CPU measure of GPU traffic. Each case is one language model, compiled with ``torch.compile``
(Inductor), that takes one training step (forward under bf16 autocast, loss, backward). Inductor
counts, for every kernel it schedules, the bytes of the buffers the kernel reads and writes
(``GraphLowering.count_bytes``, logged when its metrics log is on); we add them up per step, apart
for the kernels it generates (element-wise work, norms, reductions: the scheme's part) and for the
library calls it makes (matrix products, attention: the same for every scheme). Inductor's CPU
backend fuses as its GPU backend does in the main (one kernel per fused group of nodes), so the
ratios are a proxy for GPU traffic; the byte counts are exact for the kernels it generates. Our own
fused ops (``siamesenorm.kernels``) count with the generated kernels, at the bytes of their inputs
and outputs (one pass each); ``--kernels`` runs them through Triton's interpreter so that the
compiled graphs call them (mHC's entry, Sinkhorn, and stream mix and write; AttnRes's depth mix;
SiameseNorm's entry op runs in eager mode only).

The floor: the reads and writes of residual-stream tensors that a scheme's equations cannot avoid
between two matrix products, forward and backward, with every element-wise step between them fused
(docs/performance.md derives them; AttnRes's in :func:`attn_res_floor`). Everything else a step
moves (attention's and the MLP's own element-wise work, the loss) is the same for every scheme and
taken from Pre-Norm's measured bytes, so ``floor`` = Pre-Norm's bytes - Pre-Norm's stream floor +
the scheme's stream floor, and ``bytes / floor`` says how far the compiled scheme is from the best
any kernel could do (if Pre-Norm's own stream traffic were at its floor); ``extra / floor's
extra`` compares what the scheme moves beyond Pre-Norm with what its equations add to Pre-Norm's
floor.

    python benchmarks/traffic.py                           # every case, dim 256, 4 blocks
    python benchmarks/traffic.py --cases pre,siamese,siamese-hybrid_pre --dim 768 --layers 2
    python benchmarks/traffic.py --precision fp32 --markdown traffic.md
    python benchmarks/traffic.py --cases mhc --kernels             # mHC with its kernels
    python benchmarks/traffic.py --cases attn_res,attn_res-block4 --kernels   # AttnRes's depth mix op
    python benchmarks/traffic.py --cases mhc --by-source   # where each case's bytes come from
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import shlex
import sys
import time

import torch

from siamesenorm.models import LanguageModel, LMConfig

# case: (scheme, scheme options, model options, the state's streams of width dim as (read by a norm
# at every sublayer, only accumulated until the exit) or None, whether attention normalises q, k and
# v per head: the QKV-norm the scheme requires)
CASES = {
    "pre": ("pre", {}, {}, (1, 0), False),
    "post": ("post", {}, {}, (1, 0), False),
    "siamese": ("siamese", {}, {}, (2, 0), False),
    "siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"}, {}, (2, 0), True),
    "hybridnorm": ("hybridnorm", {}, {}, (1, 0), True),
    "spannorm": ("spannorm", {}, {}, (1, 0), False),
    "resi_dual": ("resi_dual", {}, {}, (1, 1), False),
    "deepnorm": ("deepnorm", {}, {}, (1, 0), False),
    "mix_ln": ("mix_ln", {}, {}, (1, 0), False),
    "peri_ln": ("peri_ln", {}, {}, (1, 0), False),
    "lns": ("lns", {}, {}, (1, 0), False),
    "hyper": ("hyper", {}, {}, (2, 0), False),
    "hyper-fracs2": ("hyper", {"n_streams": 1, "fracs": 2}, {}, (1, 0), False),
    "mhc": ("mhc", {}, {}, (4, 0), False),
    "attn_res": ("attn_res", {}, {}, None, False),
    "attn_res-block4": ("attn_res", {"block_size": 4}, {}, None, False),
    "pre+value_residual": ("pre", {}, {"value_residual": True}, (1, 0), False),
    "siamese-dyt": ("siamese", {}, {"norm": "dyt"}, (2, 0), False),
    "pre-dyt": ("pre", {}, {"norm": "dyt"}, (1, 0), False),
}
DEFAULT_CASES = ("pre", "post", "siamese", "siamese-hybrid_pre", "resi_dual", "peri_ln", "hyper",
                 "hyper-fracs2", "mhc", "attn_res", "attn_res-block4")
MIB = 2**20


def stream_floor(streams: tuple[int, int] | None, qkv: bool, sublayers: int, elements: int, s: int,
                 a: int) -> int | None:
    """Bytes of stream traffic a step cannot avoid. Per sublayer, forward reads the state's stream
    tensors (``s`` bytes an element) and the branch output (``a``), and writes the new state and
    the branch input. Backward reads the branch input's gradient, and for each stream a norm reads
    its gradient and its value and writes the gradient it passes on; a stream that is only added to
    (ResiDual's) passes its gradient on unchanged, read once for the branch output's gradient,
    which is written. QKV-norm adds, per attention sublayer, v's norm (read and write forward;
    gradient read, value read, gradient write backward) and the reads of q and k that their
    norms' backward needs. ``streams``: (normalised, accumulated) stream counts."""
    if streams is None:
        return None
    normed, accumulated = streams
    forward = 2 * (normed + accumulated) * s + 2 * a
    backward = (3 * normed + accumulated) * s + 2 * a
    extra = (sublayers // 2) * 7 * a if qkv else 0
    return elements * (sublayers * (forward + backward) + extra)


def attn_res_floor(sublayers: int, block_size: int | None, elements: int, s: int, a: int) -> int:
    """Bytes of stream traffic AttnRes's step cannot avoid (docs/performance.md). Its state is the
    sources: the embedding (``s`` bytes an element) and the branch outputs or block sums (``a``).
    A mix of sources of ``b_1..b_n`` bytes, with its norm, reads them and writes the branch input
    forward (``sum b + a``); backward reads the branch input's gradient and the sources and writes a
    gradient for each (``a + 2 sum b``). Sublayer 0's input norm is a mix of one source. The block
    form's ``b + out`` reads both and writes the sum (its gradient passes to both unchanged). A
    source read by ``c`` mixes (or a sum that is also added to) gets ``c`` gradients: autograd's
    accumulation of them costs, at the floor, one read of the running sum for each after the first
    (an in-place add by the mix that writes the next). The exit's mix counts beyond Pre-Norm's final
    norm (a mix of the ``s``-byte stream alone), which the shared part holds."""
    sizes, grads = [s], [0]                   # the sources' bytes, and the gradients each receives
    total = 0

    def mix() -> int:
        for j in range(len(sizes)):
            grads[j] += 1
        return 3 * sum(sizes) + 2 * a

    for i in range(sublayers):
        total += mix()                                      # sublayer 0: the embedding's norm
        if block_size is None or i % block_size == 0:       # out opens a source of its own
            sizes.append(a)
            grads.append(0)
        else:                                               # b' = b + out
            total += sizes[-1] + a + max(sizes[-1], a)
            total += grads[-1] * sizes[-1]                  # b's gradients: its mixes' and b''s
            sizes[-1] = max(sizes[-1], a)
            grads[-1] = 0
    total += mix() - (3 * s + 2 * a)
    total += sum((g - 1) * b for g, b in zip(grads, sizes) if g > 1)
    return elements * total


def case_floor(case: str, sublayers: int, elements: int, s: int, a: int) -> int | None:
    """The stream floor of ``case`` (:func:`stream_floor`, or :func:`attn_res_floor`)."""
    scheme, options, _, streams, qkv = CASES[case]
    if scheme == "attn_res":
        return attn_res_floor(sublayers, options.get("block_size"), elements, s, a)
    return stream_floor(streams, qkv, sublayers, elements, s, a)


class _Counter:
    """Inductor's per-kernel byte counts, collected while the block runs."""

    def __enter__(self):
        import torch._inductor.compile_fx as compile_fx
        import torch._inductor.metrics as metrics
        self.metrics, self.log = metrics, compile_fx.inductor_metrics_log
        self.saved = (self.log.level, self.log.propagate, list(self.log.handlers))
        self.log.setLevel(logging.INFO)      # count_bytes runs when this log is on at INFO
        self.log.propagate, self.log.handlers = False, [logging.NullHandler()]
        # a graph found in Inductor's cache is not lowered again, so its bytes would not be counted
        self.no_cache = torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False)
        self.no_cache.__enter__()
        metrics.reset()
        return self

    def __exit__(self, *exc):
        self.no_cache.__exit__(*exc)
        self.log.setLevel(self.saved[0])
        self.log.propagate, self.log.handlers = self.saved[1], self.saved[2]

    def by_source(self) -> dict[str, tuple[int, int]]:
        """Generated kernels' (bytes, scheduled nodes) by the line of our code their ops come from
        (the innermost ``siamesenorm`` frame of the most of their ops' stack traces; backward ops
        carry their forward op's trace)."""
        from torch._inductor.scheduler import ExternKernelSchedulerNode
        found: dict[str, list[int]] = {}
        for node, words in self.metrics.nodes_num_elem:
            if isinstance(node, ExternKernelSchedulerNode):
                continue
            votes: dict[str, int] = {}
            for part in node.get_nodes():
                for origin in getattr(getattr(part, "node", None), "origins", None) or ():
                    frames = re.findall(r'File "[^"]*siamesenorm/([^"]+)", line \d+, in (\w+)',
                                        origin.meta.get("stack_trace") or "")
                    where = "{}:{}".format(*frames[-1]) if frames else "(no trace)"
                    votes[where] = votes.get(where, 0) + 1
            where = max(votes, key=votes.get) if votes else "(no trace)"
            entry = found.setdefault(where, [0, 0])
            entry[0], entry[1] = entry[0] + 4 * words, entry[1] + 1
        return {k: (v[0], v[1]) for k, v in sorted(found.items(), key=lambda kv: -kv[1][0])}

    def totals(self) -> tuple[int, int, int]:
        """(bytes of generated kernels and of our fused ops, bytes of library calls, kernels)."""
        from torch._inductor.scheduler import ExternKernelSchedulerNode
        generated = extern = ours = 0
        for node, words in self.metrics.nodes_num_elem:      # bytes // 4 per scheduled node
            if not isinstance(node, ExternKernelSchedulerNode):
                generated += 4 * words
            elif "siamesenorm" in str(getattr(node.node, "op_overload", "")):   # our fused kernels
                generated, ours = generated + 4 * words, ours + 1
            else:
                extern += 4 * words
        return generated, extern, self.metrics.generated_kernel_count + ours


def measure(case: str, args) -> dict:
    """Compile one training step of ``case`` and count what its kernels move."""
    scheme, options, model_options, _, _ = CASES[case]
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                   max_seq_len=args.seq, scheme=scheme, scheme_options=dict(options), **model_options)
    model = LanguageModel(cfg).train()
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    with _Counter() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = compiled(x[:, :-1], x[:, 1:]).loss
        loss.backward()
    generated, extern, kernels = counter.totals()
    return {"case": case, "generated": generated, "extern": extern, "kernels": kernels,
            "compile_s": time.perf_counter() - t0, "by_source": counter.by_source()}


def sources_table(rows: list[dict]) -> str:
    """Each case's generated bytes by the function of ours they come from."""
    out = ["| case | where (siamesenorm/) | generated MiB | share | scheduled nodes |",
           "|---|---|---|---|---|"]
    for r in rows:
        for where, (nbytes, nodes) in r["by_source"].items():
            share = nbytes / max(r["generated"], 1)
            out.append(f"| {r['case']} | {where} | {nbytes / MIB:.1f} | {share:.2f} | {nodes} |")
    return "\n".join(out)


def table(rows: list[dict], args) -> str:
    elements = args.batch * args.seq * args.dim
    s, a = 4, (2 if args.precision == "bf16" else 4)       # fp32 streams; branch tensors in bf16
    pre = next(r for r in rows if r["case"] == "pre")
    pre_floor = stream_floor((1, 0), False, 2 * args.layers, elements, s, a)
    out = ["| case | generated MiB | / pre | kernels | / pre | library MiB | floor / pre | bytes / floor "
           "| extra / floor's extra |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = case_floor(r["case"], 2 * args.layers, elements, s, a)
        floor_ratio = within = extra = "n.d."
        if floor is not None:
            total = pre["generated"] - pre_floor + floor
            floor_ratio, within = f"{total / pre['generated']:.3f}", f"{r['generated'] / total:.3f}"
            if floor > pre_floor:      # what the scheme moves beyond Pre-Norm, over what it must
                extra = f"{(r['generated'] - pre['generated']) / (floor - pre_floor):.2f}"
        out.append(f"| {r['case']} | {r['generated'] / MIB:.1f} | {r['generated'] / pre['generated']:.3f} "
                   f"| {r['kernels']} | {r['kernels'] / max(pre['kernels'], 1):.2f} "
                   f"| {r['extern'] / MIB:.1f} | {floor_ratio} | {within} | {extra} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"comma-separated, from: {', '.join(CASES)} (pre is always measured)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--kernels", action="store_true",
                   help="run our Triton kernels (siamesenorm.kernels) through Triton's interpreter on "
                        "the CPU, so that the graphs call them: needs triton; slow")
    p.add_argument("--by-source", action="store_true",
                   help="also break each case's generated bytes down by the function of ours they come from")
    p.add_argument("--markdown", help="also write the table to this file")
    args = p.parse_args(argv)
    if args.kernels and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton picks its interpreter when it is first imported: start again with it chosen
        os.execve(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"error: unknown case {unknown[0]!r}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    cases = ["pre", *[c for c in cases if c != "pre"]]
    rows = []
    for case in cases:
        rows.append(measure(case, args))
        print(f"{case}: {rows[-1]['generated'] / MIB:.1f} MiB generated, {rows[-1]['kernels']} kernels "
              f"({rows[-1]['compile_s']:.0f} s)", file=sys.stderr, flush=True)
    head = (f"Inductor bytes per training step (torch {torch.__version__}, {platform.machine()}, "
            f"{args.precision}; dim {args.dim}, {args.layers} blocks, {args.batch} x {args.seq} tokens)\n"
            f"`python benchmarks/traffic.py {shlex.join(sys.argv[1:] if argv is None else argv)}`\n")
    text = head + "\n" + table(rows, args)
    if args.by_source:
        text += "\n\n" + sources_table(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
