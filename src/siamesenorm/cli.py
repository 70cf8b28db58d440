"""The ``siamesenorm`` command.

Every error a user can cause ends with one line on stderr and exit status 2, with no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from .compute import compute_path
from .errors import RankFailed, Terminated, UserError, environment_problem, one_line

DEFAULT_PRESET = "default"  # the default task's preset (tasks/lm.py), named in help texts


# What works with every scheme, for `schemes -v`: the norm kinds and the model's own options.


def _cmd_schemes(args: argparse.Namespace) -> int:
    from .schemes import get_scheme_class, list_schemes, scheme_options

    rows = []
    for name in list_schemes():
        cls = get_scheme_class(name)
        opts = ", ".join(f"{k}={v!r}" for k, v in scheme_options(name).items()) or "-"
        rows.append((name, cls.summary, cls.paper, opts))
    if args.verbose:
        for name, summary, paper, opts in rows:
            print(f"{name}\n  equation: {summary}\n  paper:    {paper}\n  options:  {opts}")
        from .models.lm_config import help_lines

        print(f"\nWith every scheme:\n{help_lines()}")
        return 0
    w = max(len(r[0]) for r in rows)
    s = max(len(r[1]) for r in rows)
    print(f"{'scheme':<{w}}  {'equation':<{s}}  paper")
    for name, summary, paper, _ in rows:
        print(f"{name:<{w}}  {summary:<{s}}  {paper}")
    return 0


_MEASURED = re.compile(r"Measured: (train|compare), ([\d.]+ (?:s|min)) on 2 CPU cores \(\d{4}-\d\d-\d\d")


def preset_header(path) -> tuple[str, str]:
    """A preset file's description (its first comment line: whole sentences) and measured time
    (``compare 5.8 min`` from its ``# Measured: compare, 5.8 min on ...`` line; else not measured)."""
    lines = [line[1:].strip() for line in path.read_text(encoding="utf-8").splitlines()
             if line.startswith("#")]
    measured = next((m for line in lines if (m := _MEASURED.match(line))), None)
    return (lines[0] if lines else ""), (f"{measured[1]} {measured[2]}" if measured else "time not measured")


def _cmd_presets(args: argparse.Namespace) -> int:
    from .config import PRESET_DIR, read_preset
    from .tasks.registry import DEFAULT_TASK

    rows = []
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        data = read_preset(path.stem)
        rows.append((path.stem, data.get("task", DEFAULT_TASK), *preset_header(path)))
    w = max(len(r[0]) for r in rows)
    t = max(len(r[3]) for r in rows)
    print(f"{'preset':<{w}}  task  {'time, 2 CPU cores':<{t}}  about")
    for name, task, head, took in rows:
        print(f"{name:<{w}}  {task:<4}  {took:<{t}}  {head}")
    print(f"\nEach file's header says more ({PRESET_DIR}/NAME.yaml): what the time was measured with, and "
          "when. `siamesenorm train PRESET` trains one run of it, `siamesenorm compare PRESET` its grid of "
          "schemes, learning rates and seeds.")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .config import check_seed
    from .demo import run_demo

    check_seed(args.seed, "--seed")
    run_demo(schemes=args.schemes.split(","), n_layers=args.layers, dim=args.dim,
             steps=args.steps, lr=args.lr, seed=args.seed, threads=args.threads)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2, as argparse does)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _cmd_train(args: argparse.Namespace) -> int:
    from .run import load_config, run_training
    from .streams import outlive_readers

    outlive_readers()       # a closed, full or broken log stops the log, never the run

    _path_arg(args.out, "--out")
    preset, overrides = _split_preset(args.args)
    if args.dry_run:
        if args.resume:
            raise UserError("--dry-run sizes a new run from a preset and overrides; drop --resume")
        from .tasks.dryrun import dry_run, format_dry_run

        preset = _preset_or_default(preset, overrides)
        print(format_dry_run(dry_run(load_config(preset, overrides), args.nproc), preset or ""))
        return 0
    changes = _resume_changes(preset, overrides) if args.resume else None
    if args.allow_data_change and not args.resume:
        raise UserError("--allow-data-change goes with --resume (a new run records its data)")
    finished = _finished_steps(args.out) if args.resume and changes is None else None
    cfg = None if args.resume else load_config(_preset_or_default(preset, overrides), overrides)
    with _run_threads(args, cfg):       # said as training starts
        if args.nproc is not None and args.nproc > 1:
            from .tasks import launch_task

            summary = launch_task(cfg, args.out, nproc=args.nproc, resume=args.resume,
                                  allow_data_change=args.allow_data_change, changes=changes)
        else:
            summary = run_training(cfg, args.out, resume=args.resume,
                                   allow_data_change=args.allow_data_change, changes=changes)
    if _other_rank():
        return 0        # one line per run: rank 0's
    state = f"diverged at step {summary['diverged_at']}" if summary["diverged"] else \
        f"stalled: zero gradient from step {summary['stalled_at']} on" if summary.get("stalled") \
        else f"{summary['steps']} steps"
    val = summary.get("final_val_loss")
    spread = f" ({args.nproc} processes)" if args.nproc is not None and args.nproc > 1 else ""
    if finished is not None and summary["steps"] == finished and not summary["diverged"]:
        state = f"already finished ({finished} steps)"
    loss = f"final val loss {val if val is None else f'{val:.4f}'}"
    further = f"; to train it further: siamesenorm train --resume --out {args.out} train.steps=N " \
              f"(N > {finished})" if state.startswith("already") else ""
    print(f"{args.out}: {state}{spread}, {loss}{further}")
    return 0


def _run_threads(args: argparse.Namespace, cfg):
    """The threads of ``train``'s run (each of its processes): ``--threads``, OMP_NUM_THREADS, the
    run's ``train.threads`` (a resumed run's in its config.yaml), else the free cores."""
    import torch

    from .devices import check_threads, choose_threads, use_threads

    if cfg is not None:
        config = cfg.train.threads
    else:
        from .rundir import RunDir

        train = RunDir(args.out).read_config().get("train")
        try:
            config = check_threads(train.get("threads")) if isinstance(train, dict) else None
        except UserError:       # a damaged config: the resume says what is wrong
            config = None
    return use_threads(choose_threads(args.threads, config, processes=args.nproc or 1,
                                      ceiling=torch.get_num_threads()), announce=True)


def _resume_changes(preset: str | None, overrides: list[str]) -> list[str] | None:
    """What ``--resume`` takes beside the run's own ``config.yaml``: overrides of the settings that
    cannot change what the run has done (``RESUME_SETTINGS``: ``train.steps=N`` trains it further),
    or nothing (``None``)."""
    from .config import parse_override
    from .tasks.runner import RESUME_SETTINGS

    others = [o for o in overrides if parse_override(o)[0] not in RESUME_SETTINGS]
    if preset is not None or others:
        what = f"the preset {preset}" if preset is not None else others[0]
        raise UserError(f"--resume takes the run's own config.yaml, not {what}: it takes only "
                        f"{', '.join(RESUME_SETTINGS)} (train.steps=N trains the run further)")
    return list(overrides) or None


def _finished_steps(out: str) -> int | None:
    """The steps of the finished run in ``out`` (its summary says it ended, neither interrupted nor
    stopped), or ``None``: ``--resume`` of it trains nothing, and the line says so."""
    from .rundir import RunDir
    from .shapes import read_summary

    path = RunDir(out).summary
    try:
        summary = read_summary(path) if path.is_file() else None
    except UserError:           # a damaged summary: the resume itself says what is wrong
        return None
    if summary is None or summary.get("interrupted") or summary.get("stalled"):
        return None
    return summary["steps"]


def _other_rank() -> bool:
    """Whether this process is a rank other than 0 of a launcher's world (a ``RANK`` without a
    ``WORLD_SIZE`` above 1 is a stray variable: the run was a single process, and reports)."""
    from .parallel.env import launched_world_size

    return launched_world_size() > 1 and os.environ.get("RANK", "0") != "0"


def _nproc(text: str) -> int:
    """``--nproc``: a whole number of processes, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (processes to train across), got {value}")
    return value


def _threads(text: str) -> int | None:
    """``--threads``: a whole number of intra-op threads per process, at least 1, or ``auto``."""
    from .devices import check_threads

    try:
        return check_threads(text, "--threads")
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--threads ")) from None


THREADS_HELP = ("intra-op threads per process (default: OMP_NUM_THREADS, else train.threads, else auto: "
                "the cores other processes leave free as it starts; one line says which)")


def _cmd_compare(args: argparse.Namespace) -> int:
    from .experiments import compare
    from .streams import outlive_readers

    outlive_readers()

    _path_arg(args.out, "--out")
    preset, overrides = _split_preset(args.args)
    compare(_preset_or_default(preset, overrides), overrides, args.out,
            schemes=_csv(args.schemes, str, "--schemes"), lrs=_csv(args.lrs, float, "--lrs"),
            seeds=_csv(args.seeds, int, "--seeds"), baseline=args.baseline, nproc=args.nproc,
            jobs=args.jobs, threads=args.threads)
    return 0


def _jobs(text: str) -> int | str:
    """``--jobs``: a whole number of runs at once, at least 1, or ``auto``."""
    from .experiments.jobs import check_jobs

    try:
        return check_jobs(text, "--jobs")
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--jobs ")) from None


def _csv(text: str | None, kind: type, flag: str) -> list | None:
    """The comma-separated values of ``flag`` read as ``kind`` (``None`` when not given); blank
    items are skipped, an empty list refused. Ranges and repeats are the grid's to check."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag}: cannot read {text!r} as a comma-separated list") from None
    if not values:
        raise UserError(f"{flag} is empty")
    return values


def _path_arg(value: str | None, name: str) -> None:
    """Refuse an empty (or blank) path given to ``name`` (``--out``, ``RUN_DIR``): it would mean
    the current folder. ``None`` (an optional path not given) passes."""
    if value is not None and not value.strip():
        raise UserError(f"{name} is empty ({value!r}); give a path")


def _cmd_generate(args: argparse.Namespace) -> int:
    from .run import generate_text

    _path_arg(args.run_dir, "RUN_DIR")

    def note(line: str) -> None:        # a long generation's notice, before it runs
        print(f"siamesenorm generate: {line}", file=sys.stderr, flush=True)

    print(generate_text(args.run_dir, args.prompt, args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, greedy=args.greedy, seed=args.seed, device=args.device,
                        note=note))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .tasks.finished import export_run

    _path_arg(args.run_dir, "RUN_DIR")
    _path_arg(args.out, "--out")
    if args.out is None:
        args.out = _beside_run(args.run_dir, ".safetensors" if args.format == "safetensors" else "-hf")
    if args.format == "hf":
        return _export_hf(args)
    if args.force:
        raise UserError("--force replaces a model folder of --format hf; a .safetensors export "
                          "never overwrites: remove the file or choose another --out")
    info = export_run(args.run_dir, args.out)
    print(f"{args.out}: {info['tensors']} tensors, {info['parameters']:,} parameters, step {info['step']}")
    return 0


def _beside_run(run_dir: str, suffix: str) -> str:
    """export's default ``--out``: the run folder's name plus ``suffix``, beside the folder
    (``runs/tiny`` -> ``runs/tiny.safetensors``, ``runs/tiny-hf``); a run named ``.`` or ``..``
    is named by its resolved path."""
    from pathlib import Path

    run = Path(run_dir)
    if run.name in ("", ".", ".."):
        run = run.resolve()
    if not run.name:
        raise UserError(f"RUN_DIR {run_dir} has no folder beside it to export to; give --out")
    return str(run.with_name(run.name + suffix))


def _export_hf(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise UserError("--format hf needs transformers: pip install 'siamesenorm[hf]'")
    from .commands.hf_export import export_hf

    info = export_hf(args.run_dir, args.out, force=args.force)
    tokenizer = f"{info['tokenizer']} tokenizer" if info["tokenizer"] else "no tokenizer (token-file run)"
    print(f"{args.out}: Hugging Face model folder, {info['parameters']:,} parameters, step {info['step']}, "
          f"{tokenizer}")
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from .commands.analyze_sources import analyze_source, source_kind
    from .rundir import RunDir

    _path_arg(args.run_dir, "RUN_DIR")
    _path_arg(args.out, "--out")
    out = args.out or (args.run_dir if source_kind(args.run_dir) == "run" else None)
    result = analyze_source(args.run_dir, args.data, batches=args.batches, device=args.device, out=out,
                            seq_len=args.seq_len, batch_size=args.batch_size)
    pruning, lens = result["pruning"], result["lens"]
    lens_text = "no logit lens (the model has no logits)" if lens is None else "logit lens agrees: " + \
        ", ".join(f"{s} {100 * v:.1f}%" for s, v in lens["agreement"].items())
    print(f"{args.run_dir}: loss {result['loss']:.4f}; skipping one block adds "
          f"{max(pruning['per_block']):+.4f} at most (effective depth {pruning['effective_depth']:.1f} "
          f"of {result['n_layers']}); {lens_text}")
    print(f"wrote {RunDir(out).analysis} and plots in {RunDir(out).plots}")
    return 0


def _cmd_import_olmo_core(args: argparse.Namespace) -> int:
    import importlib.util

    _path_arg(args.checkpoint, "CKPT")
    _path_arg(args.out, "--out")
    if importlib.util.find_spec("olmo_core") is None:
        raise UserError("import-olmo-core reads the checkpoint's model config with OLMo-core: "
                          "pip install 'siamesenorm[olmo]'")
    from .commands.olmo_import import import_olmo_core

    info = import_olmo_core(args.checkpoint, args.out, data=args.data)
    data = info["data"] or "none (give analyze --data token files)"
    print(f"{args.out}: step {info['step']} of {info['checkpoint']}, {info['scheme']}, "
          f"{info['parameters']:,} parameters, {info['metrics']} metrics rows; analysis data: {data}")
    return 0


def _preset_or_default(preset: str | None, overrides: list[str]) -> str | None:
    """``preset``, else the default preset of the task (``task=`` or the default task), for
    ``train`` and ``compare`` alike; ``None``: the task's own defaults."""
    if preset is not None:
        return preset
    from .config import parse_override
    from .tasks.registry import DEFAULT_TASK, get_task

    task = next((parse_override(o)[1] for o in overrides if o.partition("=")[0].strip() == "task"),
                DEFAULT_TASK)
    return get_task(task).default_preset


def _split_preset(items: list[str]) -> tuple[str | None, list[str]]:
    """``[PRESET] key=value ...``: the first item without ``=`` is the preset."""
    if items and "=" not in items[0]:
        preset, rest = items[0], items[1:]
    else:
        preset, rest = None, items
    stray = [x for x in rest if "=" not in x]
    if stray:
        raise UserError(f"expected key=value, got {stray[0]!r} (only the first argument may be a preset)")
    return preset, rest


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="siamesenorm",
        description="SiameseNorm and its baselines: build, train and compare normalisation schemes.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"siamesenorm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("schemes", help="list the residual schemes with their equation and paper")
    p.add_argument("-v", "--verbose", action="store_true", help="also list each scheme's options")
    p.set_defaults(func=_cmd_schemes)

    p = sub.add_parser("presets", help="list the packaged presets (train or compare PRESET)")
    p.set_defaults(func=_cmd_presets)

    p = sub.add_parser("train", help="train one model into a run directory")
    p.add_argument("args", nargs="*", metavar="[PRESET] key=value",
                   help=f"a preset name or YAML file (default: {DEFAULT_PRESET}, as compare's; "
                        "`siamesenorm presets` lists them), then dotted overrides (model.n_layers=12)")
    p.add_argument("--out", default="runs/run", help="run directory (default runs/run)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: go on although the run's data (its corpus fingerprint) "
                        "changed since it started; summary.json keeps both records")
    p.add_argument("--nproc", type=_nproc, default=None, metavar="N",
                   help="train across N processes on this machine (torchrun's launcher; default 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the model's parameters, FLOPs, tokens per step and memory per rank "
                        "(DDP, FSDP2) at --nproc ranks; load no data, write nothing")
    p.add_argument("--threads", type=_threads, default=None, metavar="N|auto", help=THREADS_HELP)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("compare", help="train several schemes (x learning rates x seeds) side by "
                                       "side and write summary.csv, summary.json and report.md")
    p.add_argument("args", nargs="*", metavar="[PRESET] key=value",
                   help=f"a preset name or YAML file (default: {DEFAULT_PRESET}, pre/post/siamese "
                        "at 12 layers, two learning rates, three seeds, ~6 min on 2 CPU cores), then "
                        "overrides")
    p.add_argument("--schemes", default=None,
                   help="comma-separated schemes or preset variants (default: the preset's "
                        "compare.schemes, else pre,post,siamese)")
    p.add_argument("--lrs", default=None,
                   help="comma-separated learning rates (default: compare.lrs, else train.lr)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: compare.seeds, else seed)")
    p.add_argument("--baseline", default=None, metavar="SCHEME",
                   help="the compared scheme or variant the others are paired with, seed by seed, "
                        "in the report (default: compare.baseline, else pre when compared, else "
                        "the first)")
    p.add_argument("--out", default="experiments/compare",
                   help="experiment directory, one run folder per run (default %(default)s)")
    p.add_argument("--nproc", type=_nproc, default=None, metavar="N",
                   help="train each run across N processes on this machine (default 1)")
    p.add_argument("--jobs", type=_jobs, default=None, metavar="N|auto",
                   help="train up to N runs at once, each in its own process with its share of the "
                        "cores (one per GPU on CUDA); default: compare.jobs, else auto, which "
                        "picks what is fastest for the model size on this machine and says so")
    p.add_argument("--threads", type=_threads, default=None, metavar="N|auto", help=THREADS_HELP)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("generate", help="continue a prompt with a trained run's model")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a language-model run directory of train; its last checkpoint generates")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="tokens to add (default 200; prompt and continuation must fit the context)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="sampling temperature: lower is more conservative (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--greedy", action="store_true", help="take the most likely token every step")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or mps")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("analyze", help="the paper's diagnostics on a trained run, model folder or "
                                       "OLMo-core checkpoint: layer pruning, logit lens per stream, "
                                       "angular distances, probes")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory of train (its last checkpoint is analysed), a Hugging Face "
                        "model folder siamesenorm wrote, or an OLMo-core checkpoint (stepN/ or its "
                        "save folder)")
    p.add_argument("--data", default=None, help="a text file, folder or token file to analyse "
                                                "(default: the run's validation split; required for "
                                                "a model folder or checkpoint)")
    p.add_argument("--batches", type=int, default=None,
                   help="batches of batch_size x seq_len (default: analysis.batches, or 2)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="a model folder's or checkpoint's sequence length (default: the checkpoint's, "
                        "or 256 at most)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="a model folder's or checkpoint's sequences per batch (default: the "
                        "checkpoint's micro-batch, or 4)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or mps")
    p.add_argument("--out", default=None, help="where analysis.json and analysis/ go (default RUN_DIR; "
                                               "required for a model folder or checkpoint)")
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser("export", help="write a run's trained weights (its last checkpoint, "
                                      "single-process or sharded) as one .safetensors file, or a "
                                      "language-model run as a Hugging Face model folder")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory of train (or import-olmo-core); its last checkpoint is exported")
    p.add_argument("--out", default=None, metavar="FILE.safetensors|DIR",
                   help="the weights file (--format safetensors) or the model folder (--format hf); "
                        "default: beside the run, RUN_DIR.safetensors or RUN_DIR-hf")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors (default): one weights file; hf: a folder that transformers' "
                        "from_pretrained and pipeline load (config, weights, tokenizer, model card, "
                        "modelling code), without siamesenorm installed")
    p.add_argument("--force", action="store_true",
                   help="with --format hf, replace a non-empty --out folder (once the new one is written)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("import-olmo-core", help="an OLMo-core checkpoint of a scheme model (from "
                                                "olmo-core train) as a run directory that export and "
                                                "analyze take")
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint folder stepN/, or a save folder (its latest stepN/)")
    p.add_argument("--out", required=True, metavar="RUN", help="the new run directory (absent or empty)")
    p.add_argument("--data", default=None, metavar="TOKENS",
                   help="token files (.bin, a folder or glob of them) for analyze to read by default "
                        "(default: none; analyze then needs --data)")
    p.set_defaults(func=_cmd_import_olmo_core)

    from .commands import olmo_train

    olmo_train.add_parser(sub)

    p = sub.add_parser("demo", help="build language models with several schemes and train them "
                                    "side by side for a few steps on embedded text")
    p.add_argument("--schemes", default="pre,post,siamese",
                   help="comma-separated scheme names (default %(default)s; "
                        "`siamesenorm schemes` lists them)")
    p.add_argument("--layers", type=int, default=12, help="number of blocks (default 12)")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--steps", type=int, default=60, help="training steps per scheme (default 60)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the batches, the same for every scheme "
                        "(default %(default)s)")
    p.add_argument("--threads", type=_threads, default=None, metavar="N|auto",
                   help="intra-op threads (default: OMP_NUM_THREADS, else the cores other processes "
                        "leave free); the first line says which")
    p.set_defaults(func=_cmd_demo)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args``, but ``key=value`` overrides may also follow the options
    (``train tiny --out R train.steps=5``), as they may precede them."""
    args, extra = parser.parse_known_args(argv)
    overrides = [e for e in extra if "=" in e and not e.startswith("-")] \
        if hasattr(args, "args") else []
    unknown = [e for e in extra if e not in overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides:
        args.args = [*args.args, *overrides]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        compute_path()              # a wrong SIAMESENORM_PATH ends the command before any work
        return args.func(args)
    except UserError as err:
        print(f"siamesenorm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RankFailed as err:
        print(f"siamesenorm {args.command}: error: {one_line(str(err))}", file=sys.stderr)
        return 1
    except Terminated:
        print(f"siamesenorm {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"siamesenorm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except OSError as err:
        problem = environment_problem(err)
        if problem is None:
            raise
        print(f"siamesenorm {args.command}: error: {one_line(problem)}", file=sys.stderr)
        return 2


# The exit status of a command whose reader went away: a shell's for a process ended by SIGPIPE.
READER_GONE = 128 + 13


def _reader_gone() -> int:
    """Standard output's reader has gone (``siamesenorm schemes -v | head -1``): end quietly, as
    Unix tools do. What is still buffered for it is dropped: standard output becomes /dev/null,
    so that flushing it at exit fails no more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return READER_GONE


def entry() -> None:
    """The ``siamesenorm`` command: :func:`main`, then the process ends with its exit status
    (without the interpreter's teardown after a distributed run: see
    :func:`siamesenorm.parallel.exit_process`). Output is flushed here, so that a reader gone
    before the end is met as in :func:`main`."""
    from .parallel.env import exit_process

    try:
        try:
            code = main()
        except SystemExit as done:          # argparse's --help, --version and usage errors
            code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
            if not isinstance(done.code, (int, type(None))):
                print(done.code, file=sys.stderr)
        sys.stdout.flush()
    except BrokenPipeError:
        code = _reader_gone()
    exit_process(code)


if __name__ == "__main__":
    entry()
