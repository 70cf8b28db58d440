"""One training run from a :class:`~siamesenorm.config.RunConfig`: data, model, engine, run directory.

The run directory holds ``config.yaml`` (the fully resolved config, with the vocabulary size the
data set), ``tokenizer/`` (so the run can be reloaded), ``metrics.jsonl``, ``summary.json`` and
``checkpoints/``; with ``analysis.every > 0`` also ``probes.jsonl`` and, from ``analysis.at_end``,
``analysis.json`` with its plots in ``analysis/``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from .config import RunConfig, dump_config, load_config
from .data import (
    BatchSampler,
    build_tokenizer,
    evaluate_arithmetic,
    lm_answer_fn,
    load_corpus,
    train_val_tokens,
    validation_batches,
)
from .data.tokenizers import load_tokenizer
from .devices import resolve_device
from .errors import ConfigError
from .models import LanguageModel
from .train import TrainSettings, train


def _corpus_options(cfg: RunConfig) -> dict:
    """``data.corpus_options``, plus ``data.max_bytes`` for pystdlib (which the options may override)."""
    base = {"max_bytes": cfg.data.max_bytes} if cfg.data.corpus == "pystdlib" else {}
    return {**base, **cfg.data.corpus_options}


def _saved_task(run_dir: Path) -> str:
    """The task of the run saved in ``run_dir`` (``lm`` when it has no readable config)."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"cannot resume {run_dir}: it holds no config.yaml")
    return load_config(str(run_dir / "config.yaml")).task


def run_training(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False,
                 progress: bool | None = None) -> dict:
    """Train ``cfg`` into ``run_dir`` (or continue it with ``resume``); returns the summary.

    Image tasks (``task: vit`` or ``dit``) run through :mod:`siamesenorm.tasks`."""
    run_dir = Path(run_dir)
    task = cfg.task if cfg is not None and not resume else _saved_task(run_dir)
    if task != "lm":
        from .tasks import run_dit, run_vit

        runner = {"vit": run_vit, "dit": run_dit}[task]
        return runner(cfg, run_dir, resume=resume, progress=progress)
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"cannot resume {run_dir}: it holds no config.yaml")
        cfg = load_config(str(run_dir / "config.yaml"))
    elif (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(f"{run_dir} already holds a run; resume it with --resume or choose another --out")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds model.max_seq_len "
                          f"({cfg.model.max_seq_len}); raise model.max_seq_len or lower data.seq_len")
    device = resolve_device(cfg.train.device)
    corpus = load_corpus(cfg.data.corpus, **_corpus_options(cfg))
    tokenizer = None
    if not corpus.is_tokenized:
        tok_dir = run_dir / "tokenizer"
        tokenizer = load_tokenizer(tok_dir) if resume and tok_dir.is_dir() else \
            build_tokenizer(cfg.data.tokenizer, corpus, cfg.data.vocab_size)
    train_tokens, val_tokens = train_val_tokens(corpus, tokenizer, cfg.data.val_fraction)
    vocab = tokenizer.vocab_size if tokenizer is not None else int(corpus.meta["max_token"]) + 1
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))

    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        if tokenizer is not None:
            tokenizer.save(run_dir / "tokenizer")

    torch.manual_seed(cfg.seed)
    model = LanguageModel(cfg.model, device=device)
    sampler = BatchSampler(train_tokens, cfg.data.batch_size, cfg.data.seq_len, seed=cfg.seed)
    val = validation_batches(val_tokens, cfg.data.batch_size, cfg.data.seq_len, cfg.data.val_batches)
    t = cfg.train
    settings = TrainSettings(steps=t.steps, lr=t.lr, warmup=t.warmup, min_lr_ratio=t.min_lr_ratio,
                             weight_decay=t.weight_decay, betas=t.betas, grad_clip=t.grad_clip,
                             grad_accum=t.grad_accum, eval_every=t.eval_every, eval_batches=val,
                             checkpoint_every=t.checkpoint_every,
                             divergence_factor=t.divergence_factor, compile=t.compile, seed=cfg.seed)
    extra_eval = None
    if corpus.heldout:
        problems = corpus.heldout[:cfg.data.eval_problems]
        longest = max(len(tokenizer.encode(p.answer)) for p in problems) + 1

        def extra_eval(m: torch.nn.Module) -> dict:
            score = evaluate_arithmetic(lm_answer_fn(m, tokenizer, longest), problems)
            return {"arith_acc": score["accuracy"]}

    probe = None
    if cfg.analysis.every > 0:
        from .analysis.training_probes import TrainingProbes

        x, y = val[0]
        probe = TrainingProbes(cfg.analysis.every, (x[:cfg.analysis.batch_size], y[:cfg.analysis.batch_size]))
    summary = train(model, sampler, settings, run_dir, resume=resume, device=device,
                    extra_eval=extra_eval, progress=progress, probe=probe)
    if probe is not None and cfg.analysis.at_end and not summary.get("diverged") \
            and not summary.get("interrupted"):
        from .analysis.run_analysis import analyze_model, write_analysis

        chosen = analysis_batches(val_tokens, cfg, cfg.analysis.batches)
        batches = [tuple(t.to(device) for t in b) for b in chosen]
        write_analysis(run_dir, analyze_model(model, batches), source="validation")
    return summary


def load_model(run_dir: str | Path, device: str = "cpu") -> tuple[LanguageModel, RunConfig]:
    """The trained model of ``run_dir`` (weights of its last checkpoint, eval mode) and its config."""
    from .train import load_checkpoint

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it holds no config.yaml")
    cfg = load_config(str(run_dir / "config.yaml"))
    if getattr(cfg, "task", "lm") != "lm":
        raise ConfigError(f"{run_dir} is a {cfg.task} run; this command reads language-model runs")
    model = LanguageModel(cfg.model, device=resolve_device(device, "--device"))
    load_checkpoint(run_dir / "checkpoints" / "last", model, None)
    return model.eval(), cfg


def load_run(run_dir: str | Path, device: str = "cpu") -> tuple[LanguageModel, object]:
    """The trained model of ``run_dir`` (weights of its last checkpoint) and its tokenizer."""
    run_dir = Path(run_dir)
    if (run_dir / "config.yaml").is_file() and not (run_dir / "tokenizer").is_dir():
        raise ConfigError(f"{run_dir} was trained on token files and has no tokenizer to turn text "
                          "into tokens")
    model, _ = load_model(run_dir, device)
    return model, load_tokenizer(run_dir / "tokenizer")


def analysis_batches(tokens, cfg: RunConfig, n: int) -> list:
    """``n`` validation batches of ``tokens`` for an analysis: the first ``n`` of the run's own
    evaluation batches (``data.val_batches`` of them, spread evenly over ``tokens``) when it has
    that many, else ``n`` batches spread evenly."""
    return validation_batches(tokens, cfg.data.batch_size, cfg.data.seq_len, max(n, cfg.data.val_batches))[:n]


def analysis_tokens(run_dir: str | Path, cfg: RunConfig, data: str | None = None):
    """Token array for ``siamesenorm analyze``: the run's validation split, or all of ``data``
    (a text file, folder or token file, read as the run's corpus was) encoded with its tokenizer."""
    run_dir = Path(run_dir)
    tok_dir = run_dir / "tokenizer"
    tokenizer = load_tokenizer(tok_dir) if tok_dir.is_dir() else None
    if data is None:
        corpus = load_corpus(cfg.data.corpus, **_corpus_options(cfg))
        if not corpus.is_tokenized and tokenizer is None:
            raise ConfigError(f"{run_dir} has no tokenizer/ to encode its corpus; give --data a token file")
        return train_val_tokens(corpus, tokenizer, cfg.data.val_fraction)[1]
    corpus = load_corpus(data)
    if corpus.is_tokenized:
        parts = [corpus.tokens] + ([corpus.val_tokens] if corpus.val_tokens is not None else [])
    else:
        if tokenizer is None:
            raise ConfigError(f"{run_dir} was trained on token files and has no tokenizer for the text "
                              f"in {data}; give a token file")
        texts = [corpus.text] + ([corpus.val_text] if corpus.val_text is not None else [])
        parts = [tokenizer.encode_array(t) for t in texts]
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    if len(tokens) and int(tokens.max()) >= cfg.model.vocab_size:
        raise ConfigError(f"{data} holds token id {int(tokens.max())}, beyond the model's vocabulary "
                          f"of {cfg.model.vocab_size}; give data tokenized for this run")
    return tokens


def generate_text(run_dir: str | Path, prompt: str, max_new_tokens: int = 200, *,
                  temperature: float = 0.8, top_k: int | None = None, greedy: bool = False,
                  seed: int = 0, device: str = "cpu") -> str:
    """Continue ``prompt`` with the model of ``run_dir``; returns the prompt and its continuation."""
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must not be negative, got {max_new_tokens}")
    model, tokenizer = load_run(run_dir, device)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ConfigError("the prompt is empty; give at least one character")
    x = torch.tensor([ids], device=model.embed.weight.device)
    fits = len(ids) + max_new_tokens <= model.config.max_seq_len
    out = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k, greedy=greedy,
                         use_cache=fits, generator=torch.Generator(x.device).manual_seed(seed))
    return tokenizer.decode(out[0].tolist())
