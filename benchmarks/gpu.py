"""One GPU benchmark: tokens/s, TFLOP/s, MFU and peak memory of each residual design beside Pre-Norm.

Our cases (``pre``, both SiameseNorm forms, hyper-connections, mHC, both Attention Residuals,
value residuals, and ``siamese-kernels`` and ``pre-kernels``: SiameseNorm and Pre-Norm with their
fused Triton kernels in the compiled graph (``use_path(..., compiled_graphs=True)``) against Inductor's own
fusion in ``siamese`` and ``pre``) run the training step of our trainer, from its own parts:
``ForwardBackward`` (the same forward under bf16 autocast through ``torch.compile``, and
``loss.backward``), ``clip_gradients`` at 1.0, ``build_optimizer``'s AdamW (fused on CUDA) over
float32 master weights, ``zero_grad``. The
OLMo-core cases build OLMo-1B as ``siamesenorm olmo-core train olmo-1b --compile`` does
(its parser, preset and ``train_module_config``) and step it as OLMo-core's ``train_batch`` and
``optim_step`` do, without a ``Trainer`` (no LR schedule; the clip is ours, the same two calls).
Every case sees the same random batch.

Our cases are held at once and measured round by round, the order rotated every round. OLMo-core's
1B cases (and ours after an out-of-memory error) are measured one at a time with Pre-Norm again at
the end; both Pre-Norm medians are printed. Warm-up steps, where compilation happens, are left out.
Reported: median step time and its interquartile range; tokens/s; TFLOP/s from our FLOPs per token
(the trainer's, ``LanguageModel.flops_per_token``); MFU against ``table_peak``; peak memory, the
step's ``max_memory_allocated`` above what was allocated before it plus the case's own parameters
and optimizer state (what it would peak at alone); the step ratio to Pre-Norm (OLMo-core's cases
to OLMo-core's Pre-Norm).

Time at gpt2-small (the default on CUDA): about 7-8 minutes on one H100 or H200, assuming ~30 s to
compile each of our 10 cases (12 layers), ~40 s to build and compile each of the 3 OLMo-core runs,
~1.4 s an OLMo-core step of 65,536 tokens and under 1 s a round of our cases (none of it measured
yet). ``--budget-s`` (480 s) is the wall-clock budget: measured rounds and steps stop early, never
under 3, keeping 200 s for OLMo-core, and a case whose turn comes too late to be built and warmed
up (the mean time the cases before it took) is left out with a note. Our cases are built in the
order ``--cases`` names them (Pre-Norm first); one that fails is left out with a note (its traceback
on stderr), and OLMo-core's failing leaves our table standing. Each case's build and warm-up time
goes to stderr as it ends.

``--smoke`` (meant for under 3 minutes on one H200, not yet timed there: ``--budget-s`` 170 s,
checked between cases) checks instead that everything the benchmark and the library run on a GPU
works there, each case caught on its own: every fused kernel op on the device against the PyTorch
path, in float32 and bfloat16 (``siamesenorm.kernels.self_check``); one compiled training step
(bf16 autocast) of every scheme of ``list_schemes()`` and every case above at 2 layers x 256
(``--size smoke``), its loss finite and equal to the eager forward's; and one step of each
OLMo-core case at OLMo-core's ``tiny``. It prints one table (part, case, ok/failed/skipped,
seconds, the one-line reason) and exits 0 when every row is ok, else 1; a failing case's traceback
goes to ``--tracebacks FILE`` alone, and ``--ok-cases FILE`` writes the benchmark's cases that did
not fail, for ``--cases``.

    python benchmarks/gpu.py --markdown gpu.md                  # everything, one GPU
    python benchmarks/gpu.py --smoke --markdown smoke.md        # does everything run here?
    python benchmarks/gpu.py --cases pre,siamese --steps 50
    python benchmarks/gpu.py --size tiny --device cpu --no-compile
    python benchmarks/gpu.py --smoke --size tiny --device cpu --no-compile
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import math
import platform
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

import siamesenorm
from siamesenorm.compute import use_path
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.parallel import autocast_for
from siamesenorm.train.forward import ForwardBackward
from siamesenorm.train.optim import build_optimizer, clip_gradients
from siamesenorm.train.throughput import Throughput, find_peak, model_flops_per_token, run_precision

# case: (scheme, scheme options, other LMConfig fields)
OURS: dict[str, tuple[str, dict, dict]] = {
    "pre": ("pre", {}, {}),
    "siamese": ("siamese", {"form": "post_pre"}, {}),
    "siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"}, {}),
    "hyper": ("hyper", {}, {}),
    "mhc": ("mhc", {}, {}),
    "attn_res": ("attn_res", {}, {}),
    "attn_res-block4": ("attn_res", {"block_size": 4}, {}),     # as the topologies-gpu preset
    "pre-value_residual": ("pre", {}, {"value_residual": True}),
    # SiameseNorm with its fused Triton kernel in the compiled graph (use_path(..., compiled_graphs=True)):
    # the kernel against Inductor's own fusion of the same work
    "siamese-kernels": ("siamese", {"form": "post_pre"}, {}),
    "pre-kernels": ("pre", {}, {}),          # Pre-Norm's fused add + norm, the same way
}
COMPILED_KERNELS = {"siamese-kernels", "pre-kernels"}
# OLMo-core's OLMo-1B by our integration: scheme and the entry's --scheme-options
OLMO: dict[str, tuple[str, str | None]] = {"olmo-core-pre": ("pre", None),
                                          "olmo-core-siamese": ("siamese", "form=hybrid_pre")}
CASES = list(OURS) + list(OLMO)
MIN_MEASURED = 3
GIB = 2**30


@dataclass(frozen=True)
class Size:
    dim: int
    layers: int
    heads: int
    vocab: int
    batch: int
    seq: int
    warmup: int
    steps: int
    olmo: str                   # the OLMo-core entry's config
    olmo_batch: int | None      # its global batch in sequences (None: the config's)
    olmo_warmup: int
    olmo_steps: int
    olmo_reserve_s: float       # the budget kept for the OLMo-core cases


SIZES = {
    "gpt2-small": Size(768, 12, 12, 50304, 32, 1024, 3, 30, "olmo-1b", 32, 2, 8, 200.0),
    "tiny": Size(64, 2, 4, 256, 2, 32, 1, 2, "tiny", None, 1, 2, 0.0),
    "smoke": Size(256, 2, 4, 1024, 4, 256, 1, 1, "tiny", None, 1, 1, 0.0),   # --smoke on CUDA: quick compiles
}
BUDGET_S = {"full": 480.0, "smoke": 170.0}


class UsageError(Exception):
    """A bad command line: one line on stderr, status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resident_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and optimizer state (gradients are freed between steps)."""
    tensors = list(params) + [v for s in optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class OurCase:
    """One of our models with the trainer's optimizer and forward/backward."""

    def __init__(self, name: str, size: Size, device: torch.device, args: argparse.Namespace,
                 spec: tuple[str, dict, dict] | None = None, fall_back: bool = True) -> None:
        scheme, options, extra = spec or OURS[name]
        torch.manual_seed(0)
        cfg = LMConfig(vocab_size=size.vocab, dim=size.dim, n_layers=size.layers, n_heads=size.heads,
                       max_seq_len=size.seq, scheme=scheme, scheme_options=dict(options), **extra)
        self.name, self.compile, self.backend = name, not args.no_compile, args.backend
        self.model = LanguageModel(cfg, device=device).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, lr=1e-4)
        if args.backend == "inductor":
            self.forward = ForwardBackward(self.model, self.compile)     # the trainer's own
        else:                                   # another backend: the trainer's path, compiled by it
            self.forward = ForwardBackward(self.model, False)
            if self.compile:
                self.forward.fn, self.forward.trial = torch.compile(self.model, backend=args.backend), True
        if not fall_back:           # a failing compile raises here instead of running eager
            self.forward.trial = False
        self.autocast = autocast_for("none", args.precision, device)
        self.flops_per_token = model_flops_per_token(self.model, size.seq)
        self.tokens = size.batch * size.seq
        self.n_params = self.model.num_parameters()
        gen = torch.Generator().manual_seed(1234)
        x = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=gen).to(device)
        self.x, self.y = x[:, :-1], x[:, 1:]

    def step(self) -> torch.Tensor:
        """One training step; returns its (detached) loss."""
        with use_path("kernels", compiled_graphs=self.name in COMPILED_KERNELS):     # read when traced
            loss = self.forward(self.x, self.y, 1, self.autocast)
        clip_gradients(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def eager_loss(self) -> float:
        """The loss of the eager forward, without a step (the smoke's reference)."""
        with torch.no_grad(), self.autocast():
            return float(self.model(self.x, self.y).loss)

    def compiled(self) -> str:
        """Read after the first step (compilation is lazy): ``failed`` where ForwardBackward fell
        back to eager (its warning says why)."""
        if not self.compile:
            return "no"
        if self.forward.fn is self.model:
            return "failed"
        return "yes" if self.backend == "inductor" else self.backend

    def resident(self) -> int:
        return _resident_bytes(self.params, self.optimizer)


class OlmoCase:
    """OLMo-core's train module of the entry's config, stepped as its ``train_batch`` does."""

    def __init__(self, name: str, size: Size, device: torch.device, args: argparse.Namespace) -> None:
        from siamesenorm.cli import build_parser
        from siamesenorm.commands.olmo_train import resolve
        from siamesenorm.olmo_core import train as entry

        scheme, options = OLMO[name]
        argv = ["olmo-core", "train", size.olmo, "--scheme", scheme,
                "--precision", run_precision(args.precision, device)]
        argv += ["--scheme-options", options] if options else []
        argv += ["--global-batch", str(size.olmo_batch)] if size.olmo_batch else []
        argv += [] if args.no_compile else ["--compile"]
        cli = build_parser().parse_args(argv)
        shape = resolve(cli)
        module = entry.train_module_config(cli, shape, 1, "none", cli.precision, device.type == "cuda")
        # no Trainer here: no LR schedule, and the clip is done in step()
        module = dataclasses.replace(module, scheduler=None, max_grad_norm=None)
        torch.manual_seed(0)
        self.tm = module.build(entry.model_config(shape).build(init_device="meta"), device=device)
        self.tm.model.train()
        self.name, self.compile, self.grad_clip = name, cli.compile, shape.grad_clip
        self.params = [p for p in self.tm.model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in self.tm.model.parameters())
        self.flops_per_token = LanguageModel(shape.model, device="meta").flops_per_token(shape.seq_len)
        self.tokens = shape.global_batch * shape.seq_len
        gen = torch.Generator().manual_seed(1234)
        x = torch.randint(0, shape.model.vocab_size, (shape.global_batch, shape.seq_len + 1),
                          generator=gen).to(device)
        self.micro = list(zip(x[:, :-1].split(shape.microbatch), x[:, 1:].split(shape.microbatch)))

    def step(self) -> torch.Tensor:
        """One training step; returns its (detached) loss."""
        tm, total = self.tm, 0.0
        for ids, labels in self.micro:
            out = tm.model_forward(ids, labels=labels, ignore_index=-100, loss_reduction="sum",
                                   loss_div_factor=float(self.tokens), return_logits=False)
            out.loss.backward()
            total = total + out.loss.detach()
        tm.model.post_batch(dry_run=False)
        if self.grad_clip:
            clip_gradients(self.params, self.grad_clip)
        tm.optim.step()
        tm.model.post_optim_step()
        tm.zero_grads()
        return total

    def compiled(self) -> str:
        if not self.compile:
            return "no"
        return "yes" if torch.cuda.is_available() else "skipped"   # as OLMo-core does without CUDA

    def resident(self) -> int:
        return _resident_bytes(self.params, self.tm.optim)


@dataclass
class Result:
    name: str
    params: int
    tokens: int                     # a step's
    flops_per_token: float | None
    compiled: str
    times: list[float]              # measured steps, seconds
    peak: int | None                # bytes; None off CUDA


class Clock:
    """Times and peaks of steps; measured steps stop at a deadline (``perf_counter``), never under
    :data:`MIN_MEASURED`, and ``cut`` records that one did."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cut = device, False
        self.recompiled: list[str] = []     # cases that compiled a graph in a measured step

    def step(self, case, resident: int) -> tuple[float, int | None]:
        """One step's seconds and peak bytes (the step's allocator peak over what was allocated
        before it, plus ``resident``: the case's own parameters and optimizer state)."""
        cuda = self.device.type == "cuda"
        _sync(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        case.step()
        _sync(self.device)
        elapsed = time.perf_counter() - t0
        if counters["stats"]["unique_graphs"] != graphs and case.name not in self.recompiled:
            self.recompiled.append(case.name)
        return elapsed, (torch.cuda.max_memory_allocated(self.device) - before + resident if cuda else None)

    def more(self, done: int, wanted: int, last: float, deadline: float) -> bool:
        if done >= wanted:
            return False
        if done >= MIN_MEASURED and time.perf_counter() + last > deadline:
            self.cut = True
            return False
        return True


def _result(case, times: list[float], peaks: list) -> Result:
    peak = None if None in peaks or not peaks else max(peaks)
    return Result(case.name, case.n_params, case.tokens, case.flops_per_token, case.compiled(), times, peak)


def _reason(error: BaseException) -> str:
    """An exception in one line: its type and the first line of its message (with the next one
    where the first only introduces it, as Inductor's ``backend='inductor' raised:``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def _progress(message: str) -> None:
    print(f"gpu.py: {message}", file=sys.stderr, flush=True)


def _left_out(name: str, error: BaseException, notes: list[str]) -> None:
    """A case that raised: its traceback on stderr, one note in the report."""
    traceback.print_exception(error, file=sys.stderr)
    notes.append(f"{name} failed and is left out: {_reason(error)}")
    _progress(f"{name} failed: {_reason(error)}")


def _no_time(k: int, spent: list[float], deadline: float) -> bool:
    """Whether the case at position ``k`` (never the first) would end its build and warm-up past
    ``deadline``, judged by the mean time the cases before it took."""
    return k > 0 and bool(spent) and time.perf_counter() + statistics.mean(spent) > deadline


def interleaved(build, names: list[str], clock: Clock, warmup: int, steps: int, deadline: float,
                notes: list[str]) -> list[Result]:
    """Every case built and warmed up in turn (one that fails, or whose turn comes too late, left
    out; the first, Pre-Norm, must run), then measured round by round, the order rotated each round."""
    cases, spent = [], []
    for k, name in enumerate(names):
        if _no_time(k, spent, deadline):
            notes.append(f"not measured, the budget was spent before their turn: {', '.join(names[k:])}")
            break
        start, case = time.perf_counter(), None
        try:
            case = build(name)
            for _ in range(warmup):
                case.step()
        except Exception as error:
            if k == 0 or _out_of_memory(error):
                raise
            _left_out(name, error, notes)
            case = None
        if case is None:
            _free()
            continue
        spent.append(time.perf_counter() - start)
        _progress(f"{name}: built and warmed up ({warmup} step(s), compiled: {case.compiled()}) "
                  f"in {spent[-1]:.1f} s")
        cases.append(case)
    resident = [c.resident() for c in cases]
    times: list[list[float]] = [[] for _ in cases]
    peaks: list[list] = [[] for _ in cases]
    r, last = 0, 0.0
    while clock.more(r, steps, last, deadline):
        t0 = time.perf_counter()
        for k in range(len(cases)):
            i = (k + r) % len(cases)
            t, peak = clock.step(cases[i], resident[i])
            times[i].append(t)
            peaks[i].append(peak)
        r, last = r + 1, time.perf_counter() - t0
    _progress(f"measured {r} round(s) of {len(cases)} case(s)")
    return [_result(c, t, p) for c, t, p in zip(cases, times, peaks)]


def in_turn(build, names: list[str], clock: Clock, warmup: int, steps: int, end: float,
            notes: list[str]) -> tuple[list[Result], Result | None]:
    """Each case built, warmed up and measured alone, then freed; the first (Pre-Norm) again at the
    end, returned apart (None where the budget left no time for it). Each gets an equal share of
    the time left before ``end``; a case whose turn comes too late is left out with a note."""
    order, results, spent = names + names[:1], [], []
    for k, name in enumerate(order):
        if _no_time(k, spent, end):
            rest = order[k:len(names)]
            notes.append(f"not measured, the budget was spent before their turn: {', '.join(rest)}"
                         if rest else f"{names[0]} was not measured again at the end: the budget was spent")
            break
        share = (end - time.perf_counter()) / (len(order) - k)
        start = time.perf_counter()
        case = build(name)
        for _ in range(warmup):
            case.step()
        spent.append(time.perf_counter() - start)
        _progress(f"{name}: built and warmed up ({warmup} step(s), compiled: {case.compiled()}) "
                  f"in {spent[-1]:.1f} s")
        resident, times, peaks, last = case.resident(), [], [], 0.0
        while clock.more(len(times), steps, last, start + share):
            last, peak = clock.step(case, resident)
            times.append(last)
            peaks.append(peak)
        results.append(_result(case, times, peaks))
        _progress(f"{name}: measured {len(times)} step(s)")
        del case
        torch._dynamo.reset()           # drop its compiled graphs, which may hold on to it
        _free()
    again = results.pop() if len(results) == len(order) else None
    return results, again


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


def measure_ours(names: list[str], size: Size, device: torch.device, args, clock: Clock,
                 end: float, notes: list[str]) -> list[Result]:
    build = lambda name: OurCase(name, size, device, args)  # noqa: E731
    try:
        return interleaved(build, names, clock, args.warmup, args.steps, end, notes)
    except RuntimeError as error:
        if not _out_of_memory(error):
            raise
    _free()
    notes.append("our cases did not fit in GPU memory together: each was measured in turn, Pre-Norm "
                 "again at the end")
    results, again = in_turn(build, names, clock, args.warmup, args.steps, end, notes)
    return _merge_pre(results, again, notes, "pre")


def _merge_pre(results: list[Result], again: Result | None, notes: list[str], label: str) -> list[Result]:
    """Pre-Norm's two runs (the first result and ``again``) pooled into its row; their medians in a
    note."""
    if again is None:
        return results
    first = results[0]
    a, b = statistics.median(first.times), statistics.median(again.times)
    notes.append(f"{label} measured before and after the others: {1e3 * a:.1f} and {1e3 * b:.1f} ms a step "
                 f"(drift {100 * (b - a) / a:+.1f}%); its row pools both.")
    peaks = [p for p in (first.peak, again.peak) if p is not None]
    merged = dataclasses.replace(first, times=first.times + again.times, peak=max(peaks) if peaks else None)
    return [merged] + results[1:]


def measure_olmo(names: list[str], size: Size, device: torch.device, args, clock: Clock,
                 end: float, notes: list[str]) -> list[Result]:
    build = lambda name: OlmoCase(name, size, device, args)  # noqa: E731
    steps = args.steps if args.steps_given else size.olmo_steps
    warmup = args.warmup if args.warmup_given else size.olmo_warmup
    results, again = in_turn(build, names, clock, warmup, steps, end, notes)
    return _merge_pre(results, again, notes, "olmo-core-pre")


# ---- report --------------------------------------------------------------------------------------
COLUMNS = ("case", "params M", "compiled", "step ms", "IQR %", "tokens/s", "TFLOP/s", "MFU %", "peak GiB",
           "step / pre")


def rows(results: list[Result], base: Result, peak) -> list[list[str]]:
    """The table's cells for ``results``, ratios to ``base``'s median step."""
    out, base_s = [], statistics.median(base.times)
    for r in results:
        med = statistics.median(r.times)
        q = statistics.quantiles(r.times, n=4) if len(r.times) > 1 else [med, med, med]
        tokens_s = r.tokens / med
        meter = Throughput(peak)
        meter.flops_per_token = r.flops_per_token
        tflops, mfu = meter.tflops(tokens_s), meter.mfu(tokens_s)
        out.append([r.name, f"{r.params / 1e6:.2f}", r.compiled, f"{1e3 * med:.2f}",
                    f"{100 * (q[2] - q[0]) / med:.1f}", f"{tokens_s:,.0f}",
                    "n/a" if tflops is None else f"{tflops:.4g}",
                    "n/a" if mfu is None else f"{100 * mfu:.1f}",
                    "n/a" if r.peak is None else f"{r.peak / GIB:.2f}", f"{med / base_s:.3f}"])
    return out


def markdown(cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU {platform.machine()}, {torch.get_num_threads()} threads"


def header(size_name: str, size: Size, device: torch.device, args, peak, olmo: bool, argv: list[str]) -> str:
    now, name = _now(), _device_name(device)
    precision = run_precision(args.precision, device)
    compiled = "eager" if args.no_compile else f"torch.compile ({args.backend})"
    lm = LMConfig(vocab_size=size.vocab, dim=size.dim, n_layers=size.layers, n_heads=size.heads,
                  max_seq_len=size.seq)
    lines = [f"## Step cost beside Pre-Norm, {now}", "",
             f"- device: {name}; torch {torch.__version__}; MFU against "
             + (f"{peak.tflops:g} TFLOP/s ({peak.source})" if peak else "no known peak (n/a)"),
             f"- {size_name}: {size.layers} layers x {size.dim}, {size.heads} heads, SwiGLU {lm.hidden_dim}, "
             f"vocab {size.vocab}, tied embeddings; {size.batch} x {size.seq} = {size.batch * size.seq:,} "
             f"tokens a step; {'bf16 autocast' if precision == 'bf16' else 'fp32'}, {compiled}, the "
             "trainer's AdamW on float32 weights, clip 1.0",
             f"- measured: medians over up to {args.steps} rounds after {args.warmup} warm-up step(s) a case "
             "(compilation happens there), cases interleaved round by round"]
    if olmo:
        from siamesenorm.commands.olmo_train import config_shape
        shape = config_shape(size.olmo)
        m, batch = shape.model, size.olmo_batch or shape.global_batch
        lines.append(f"- OLMo-core `{size.olmo}` through siamesenorm.olmo_core: {m.n_layers} layers x "
                     f"{m.dim}, {m.n_heads} heads, SwiGLU {m.hidden_dim}, vocab {m.vocab_size}, QK-norm, "
                     f"{'tied' if m.tie_embeddings else 'untied'}; {batch} x {shape.seq_len} = "
                     f"{batch * shape.seq_len:,} tokens a step in micro-batches of {shape.microbatch}; "
                     "each case in turn, Pre-Norm again at the end; ratios to OLMo-core's Pre-Norm")
    lines.append(f"- command: `{shlex.join(['python', 'benchmarks/gpu.py', *argv])}`")
    return "\n".join(lines)


# ---- smoke ---------------------------------------------------------------------------------------
SMOKE_COLUMNS = ("part", "case", "result", "seconds", "detail")


@dataclass
class Check:
    """One row of the smoke's table."""
    part: str                       # kernel, scheme or olmo-core
    case: str
    result: str                     # ok, failed or skipped
    seconds: float | None
    detail: str                     # what it did, or the one-line reason it failed or was skipped


class Mismatch(Exception):
    """A step that ran but gave a wrong loss (no traceback worth keeping)."""


def smoke_schemes() -> dict[str, tuple[str, dict, dict]]:
    """The smoke's compiled steps: every case of :data:`OURS`, then every registered scheme not
    among them, with its default options."""
    out = dict(OURS)
    for scheme in siamesenorm.list_schemes():
        out.setdefault(scheme, (scheme, {}, {}))
    return out


def smoke_names() -> list[str]:
    """The smoke's cases in the order it runs them (the benchmark's own first)."""
    return ["kernels", *OURS, *OLMO, *(n for n in smoke_schemes() if n not in OURS)]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _checked(part: str, name: str, run, deadline: float, tracebacks: list[str]) -> Check:
    """``run()`` (which returns the row's detail) timed and caught: an exception is a failed row
    with its one-line reason, its traceback kept in ``tracebacks``."""
    if time.perf_counter() > deadline:
        return Check(part, name, "skipped", None, "not run: --budget-s was spent")
    start = time.perf_counter()
    try:
        detail = run()
        check = Check(part, name, "ok", time.perf_counter() - start, detail)
    except Exception as error:
        if not isinstance(error, Mismatch):
            tracebacks.append(f"== {part} {name}\n" + "".join(traceback.format_exception(error)))
        check = Check(part, name, "failed", time.perf_counter() - start, _reason(error))
    torch._dynamo.reset()
    if torch.cuda.is_available():
        _free()
    _progress(f"smoke {part} {name}: {check.result} in {check.seconds:.1f} s")
    return check


def _loss_check(loss: float, eager: float | None, precision: str) -> str:
    if not math.isfinite(loss):
        raise Mismatch(f"the loss is {loss}")
    if eager is None:
        return f"loss {loss:.4f}"
    tol = (2e-2 if precision == "bf16" else 1e-4) * max(1.0, abs(eager))
    if not abs(loss - eager) <= tol:
        raise Mismatch(f"loss {loss:.5g}, eager forward {eager:.5g} (tolerance {tol:.2g})")
    return f"loss {loss:.4f}, eager {eager:.4f}"


def smoke_kernels(device: torch.device, tracebacks: list[str]) -> list[Check]:
    """Every fused kernel op once on ``device`` against the PyTorch path, in float32 and bfloat16."""
    import siamesenorm.kernels as kernels

    check = getattr(kernels, "self_check", None)
    if check is None:
        return [Check("kernel", "self_check", "skipped", None, "self_check not available")]
    start = time.perf_counter()
    try:
        found = check(device, dtypes=(torch.float32, torch.bfloat16))
        rows = []
        for c in found:
            error = f"max error {c.max_error:.2g}" if math.isfinite(c.max_error) else ""
            detail = error if c.ok else "; ".join(t for t in (c.reason, error) if t)
            rows.append(Check("kernel", f"{c.op} {_dtype_name(c.dtype)}", "ok" if c.ok else "failed",
                              c.seconds, detail))
    except Exception as error:
        tracebacks.append("== kernel self_check\n" + "".join(traceback.format_exception(error)))
        rows = [Check("kernel", "self_check", "failed", time.perf_counter() - start, _reason(error))]
    _progress(f"smoke kernels: {sum(r.result == 'ok' for r in rows)} of {len(rows)} ok "
              f"in {time.perf_counter() - start:.1f} s")
    return rows or [Check("kernel", "self_check", "failed", time.perf_counter() - start,
                          "self_check returned no op")]


def smoke(args, names: list[str], device: torch.device, size: Size, deadline: float,
          tracebacks: list[str]) -> list[Check]:
    """Every case of ``names`` (:func:`smoke_names`) once, each caught on its own."""
    precision = run_precision(args.precision, device)
    schemes = smoke_schemes()
    checks: list[Check] = []

    def scheme_step(name: str):
        def run() -> str:
            case = OurCase(name, size, device, args, schemes[name], fall_back=False)
            eager = case.eager_loss()
            loss = float(case.step())
            return f"compiled: {case.compiled()}; " + _loss_check(loss, eager, precision)
        return run

    def olmo_step(name: str):
        def run() -> str:
            case = OlmoCase(name, size, device, args)
            loss = float(case.step())
            return f"compiled: {case.compiled()}; " + _loss_check(loss, None, precision)
        return run

    olmo_missing = importlib.util.find_spec("olmo_core") is None
    for name in names:
        if name == "kernels":
            checks += smoke_kernels(device, tracebacks)
        elif name in OLMO:
            if olmo_missing:
                checks.append(Check("olmo-core", name, "skipped", None,
                                    "OLMo-core is missing: olmo_core is not installed"))
            else:
                checks.append(_checked("olmo-core", name, olmo_step(name), deadline, tracebacks))
        else:
            checks.append(_checked("scheme", name, scheme_step(name), deadline, tracebacks))
    return checks


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def smoke_report(checks: list[Check], size_name: str, size: Size, device: torch.device, args,
                 argv: list[str], wall: float) -> str:
    precision = run_precision(args.precision, device)
    compiled = "eager" if args.no_compile else f"torch.compile ({args.backend})"
    try:
        import triton
        triton_version = f"Triton {triton.__version__}"
    except Exception:
        triton_version = "no Triton"
    lines = [f"## Smoke test, {_now()}", "",
             f"- device: {_device_name(device)}; torch {torch.__version__}; {triton_version}",
             f"- kernels: each op once forward and backward against the PyTorch path, fp32 and bf16; "
             f"schemes: one training step at `{size_name}` ({size.layers} layers x {size.dim}, "
             f"{size.batch} x {size.seq} tokens), {'bf16 autocast' if precision == 'bf16' else 'fp32'}, "
             f"{compiled}, its loss beside the eager forward's; OLMo-core: one step at `{size.olmo}`",
             f"- command: `{shlex.join(['python', 'benchmarks/gpu.py', *argv])}`", "",
             "| " + " | ".join(SMOKE_COLUMNS) + " |", "|---|---|---|---:|---|"]
    for c in checks:
        seconds = "" if c.seconds is None else f"{c.seconds:.1f}"
        lines.append(f"| {c.part} | {c.case} | {c.result} | {seconds} | {_cell(c.detail)} |")
    count = {r: sum(c.result == r for c in checks) for r in ("ok", "failed", "skipped")}
    lines += ["", f"- {count['ok']} ok, {count['failed']} failed, {count['skipped']} skipped; "
              f"wall time {wall:.0f} s"]
    failed = [f"{c.part} {c.case}" for c in checks if c.result == "failed"]
    if failed:
        lines.append(f"- failed: {', '.join(failed)}")
    return "\n".join(lines)


def ok_cases(checks: list[Check]) -> list[str]:
    """The benchmark's cases that the smoke did not see fail (OLMo-core's both, where its Pre-Norm
    failed: the other's ratio needs it)."""
    failed = {c.case for c in checks if c.result == "failed"}
    if "olmo-core-pre" in failed:
        failed |= set(OLMO)
    return [n for n in CASES if n not in failed]


def run_smoke(args, names: list[str], device: torch.device, size: Size, argv: list[str]) -> int:
    start = time.perf_counter()
    tracebacks: list[str] = []
    checks = smoke(args, names, device, size, start + args.budget_s, tracebacks)
    report = smoke_report(checks, args.size, size, device, args, argv, time.perf_counter() - start)
    print(report, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report + "\n")
    if args.ok_cases:
        with open(args.ok_cases, "w") as f:
            f.write(",".join(ok_cases(checks)) + "\n")
    if args.tracebacks:
        with open(args.tracebacks, "w") as f:
            f.write("\n".join(tracebacks))
    return 0 if all(c.result == "ok" for c in checks) else 1


# ---- command line --------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="benchmarks/gpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help="check instead that every kernel, scheme and case runs here (one step each); "
                        "exit 0 when all did, 1 otherwise")
    p.add_argument("--cases", help=f"comma list of {', '.join(CASES)} (default: all), in the order to build "
                                    "them; with --smoke, of kernels, those and every registered scheme")
    p.add_argument("--size", choices=sorted(SIZES),
                   help="gpt2-small (default on CUDA; smoke with --smoke) or tiny (on CPU)")
    p.add_argument("--device", help="cuda (default where there is one) or cpu")
    p.add_argument("--no-compile", action="store_true", help="eager: no torch.compile")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of our cases: inductor (the trainer's) or e.g. aot_eager "
                        "(quick to compile on CPU, for tests)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on CPU (the trainer's rule)")
    p.add_argument("--steps", type=int,
                   help="measured rounds of our cases and steps of each OLMo-core run (default: the size's, "
                        "30 and 8 at gpt2-small)")
    p.add_argument("--warmup", type=int, help="unmeasured steps per case (default: 3 and 2 at gpt2-small)")
    p.add_argument("--budget-s", type=float,
                   help="wall-clock budget: measured steps stop early, and cases whose turn comes too late "
                        f"are left out, to keep within it (default {BUDGET_S['full']:g}; "
                        f"{BUDGET_S['smoke']:g} with --smoke)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak, where the table has none")
    p.add_argument("--markdown", metavar="FILE", help="also write the report to FILE")
    p.add_argument("--ok-cases", metavar="FILE",
                   help="with --smoke: write the benchmark's cases that did not fail to FILE, for --cases")
    p.add_argument("--tracebacks", metavar="FILE",
                   help="with --smoke: write failing cases' tracebacks to FILE")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], torch.device, Size]:
    args = parser().parse_args(argv)
    known = smoke_names() if args.smoke else CASES
    names = list(dict.fromkeys(n for n in args.cases.split(",") if n)) if args.cases else list(known)
    for n in names:
        if n not in known:
            raise UsageError(f"--cases: unknown case {n!r}; choose from {', '.join(known)}")
    if (args.ok_cases or args.tracebacks) and not args.smoke:
        raise UsageError("--ok-cases and --tracebacks go with --smoke")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise UsageError(f"--device {args.device!r}: not a device; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: there is no CUDA device here; use --device cpu --size tiny")
    if device.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {args.device}: only cuda and cpu are measured")
    size_name = args.size or ("tiny" if device.type == "cpu" else "smoke" if args.smoke else "gpt2-small")
    size = SIZES[size_name]
    args.size, args.steps_given = size_name, args.steps is not None
    args.warmup_given = args.warmup is not None
    args.steps = size.steps if args.steps is None else args.steps
    args.warmup = size.warmup if args.warmup is None else args.warmup
    if args.steps < 1 or args.warmup < 1:
        raise UsageError("--steps and --warmup must be at least 1 (compilation happens in the warm-up)")
    if args.budget_s is None:
        args.budget_s = BUDGET_S["smoke" if args.smoke else "full"]
    if args.budget_s <= 0:
        raise UsageError(f"--budget-s must be positive, got {args.budget_s:g}")
    return args, names, device, size


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, names, device, size = parse(argv)
    except UsageError as error:
        print(f"benchmarks/gpu.py: error: {error}", file=sys.stderr)
        return 2
    # one process compiles every case: let dynamo keep a compiled graph of each
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 8 * len(CASES))
    if args.smoke:
        return run_smoke(args, names, device, size, argv)
    start = time.perf_counter()
    end = start + args.budget_s
    ours = list(dict.fromkeys(["pre"] + [n for n in names if n in OURS]))
    olmo = [n for n in OLMO if n in names or (n == "olmo-core-pre" and any(m in names for m in OLMO))]
    notes: list[str] = []
    if olmo and importlib.util.find_spec("olmo_core") is None:
        notes.append(f"skipped {', '.join(olmo)}: OLMo-core is not installed "
                     "(pip install 'siamesenorm[olmo]')")
        olmo = []
    peak = find_peak(device, args.precision, args.peak_tflops)
    clock = Clock(device)
    results = measure_ours(ours, size, device, args, clock, end - (size.olmo_reserve_s if olmo else 0.0),
                           notes)
    cells = rows(results, results[0], peak)
    if olmo:
        torch._dynamo.reset()
        _free()
        try:
            olmo_results = measure_olmo(olmo, size, device, args, clock, end, notes)
            cells += rows(olmo_results, olmo_results[0], peak)
        except Exception as error:          # our table stands
            _left_out(", ".join(olmo), error, notes)
            olmo = []
    if clock.recompiled:
        notes.append(f"compiled again in a measured step (that step's time includes it): "
                     f"{', '.join(clock.recompiled)}")
    if clock.cut:
        notes.append(f"--budget-s {args.budget_s:g} cut some measured steps short "
                     f"(never under {MIN_MEASURED}).")
    notes.append(f"wall time {time.perf_counter() - start:.0f} s; IQR: the interquartile range of the steps.")
    report = "\n\n".join([header(args.size, size, device, args, peak, bool(olmo), argv), markdown(cells),
                           "\n".join(f"- {n}" for n in notes)])
    print(report, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
