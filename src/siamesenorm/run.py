"""One training run from a :class:`~siamesenorm.config.RunConfig`: data, model, engine, run directory.

The run directory holds ``config.yaml`` (the fully resolved config, with the vocabulary size the
data set), ``tokenizer/`` (so the run can be reloaded), ``metrics.jsonl``, ``summary.json`` (with
the corpus's name and fingerprint under ``data``) and ``checkpoints/``; with ``analysis.every > 0``
also ``probes.jsonl`` and, from ``analysis.at_end``, ``analysis.json`` with its plots in
``analysis/``.

The model's vocabulary is the tokenizer's, or for token files the largest id of the training and
validation files plus one; a ``model.vocab_size`` set to another value than its default stands when
it is at least that large, and is refused when smaller.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import RunConfig, dump_config, load_config
from .data import (
    BatchSampler,
    ByteTokenizer,
    Corpus,
    Tokenizer,
    build_tokenizer,
    evaluate_arithmetic,
    lm_answer_fn,
    load_corpus,
    train_text,
    train_val_tokens,
    validation_batches,
)
from .data.tokenizers import import_tokenizers, load_tokenizer
from .devices import resolve_device
from .errors import ConfigError
from .models import LanguageModel, LMConfig
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


def check_out_dir(path: str | Path, flag: str = "--out") -> None:
    """Refuse an output folder that is, or lies inside, an existing file (nothing is written)."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is" if candidate == path else f"lies inside {candidate}, which is"
                raise ConfigError(f"{flag} {path} {where} a file, not a folder; remove it or choose "
                                  f"another {flag}")
            return


# ---- data ---------------------------------------------------------------------------------------
_DEFAULT_VOCAB = next(f.default for f in dataclasses.fields(LMConfig) if f.name == "vocab_size")


@dataclass
class LMData:
    """What a language-model run trains on: the corpus, its tokenizer (``None`` for token files),
    the train/validation tokens, the training sampler, the fixed validation batches, and the
    model's vocabulary size."""

    corpus: Corpus
    tokenizer: Tokenizer | None
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    sampler: BatchSampler
    val: list
    vocab_size: int


def data_info(corpus: Corpus) -> dict:
    """The corpus's description for ``summary.json``: its name and, when it has one, its fingerprint
    (files, bytes, sha256 and, for pystdlib, the Python version), so that results from different
    data can be told apart."""
    info: dict = {"name": corpus.name}
    if corpus.meta.get("fingerprint") is not None:
        info["fingerprint"] = corpus.meta["fingerprint"]
    return info


def _model_vocab(cfg: RunConfig, needed: int, why: str) -> int:
    """The model's vocabulary: ``needed`` ids, or ``model.vocab_size`` when it was set (differs from
    the default) and is at least ``needed``; a smaller explicit value is refused."""
    given = cfg.model.vocab_size
    if given == _DEFAULT_VOCAB:
        return needed
    if given < needed:
        raise ConfigError(f"model.vocab_size={given} is too small: {why} needs {needed} ids; raise "
                          f"model.vocab_size to at least {needed} or leave it unset")
    return given


def _check_bpe_vocab(cfg: RunConfig) -> None:
    """With BPE and an explicit ``model.vocab_size``, refuse one below ``data.vocab_size`` up front
    (the trained tokenizer has at most that many ids)."""
    if cfg.data.tokenizer == "bpe":
        _model_vocab(cfg, cfg.data.vocab_size, f"the BPE tokenizer (data.vocab_size={cfg.data.vocab_size})")


def _load_lm_corpus(cfg: RunConfig) -> Corpus:
    """``cfg``'s corpus, after the checks that need no data."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds model.max_seq_len "
                          f"({cfg.model.max_seq_len}); raise model.max_seq_len or lower data.seq_len")
    corpus = load_corpus(cfg.data.corpus, **_corpus_options(cfg))
    if not corpus.is_tokenized:
        _check_bpe_vocab(cfg)
    return corpus


def _token_data(cfg: RunConfig, corpus: Corpus, tokenizer: Tokenizer | None) -> LMData:
    """Split and batch ``corpus`` (encoded with ``tokenizer``); the vocabulary covers both splits."""
    d = cfg.data
    train_tokens, val_tokens = train_val_tokens(corpus, tokenizer, d.val_fraction)
    if tokenizer is not None:
        vocab = _model_vocab(cfg, tokenizer.vocab_size, f"the {tokenizer.kind} tokenizer")
    else:
        needed = int(max(train_tokens.max(), val_tokens.max())) + 1
        vocab = _model_vocab(cfg, needed, f"{corpus.name} (largest token id {needed - 1}, over training "
                                          "and validation)")
    sampler = BatchSampler(train_tokens, d.batch_size, d.seq_len, seed=cfg.seed)
    val = validation_batches(val_tokens, d.batch_size, d.seq_len, d.val_batches)
    return LMData(corpus, tokenizer, train_tokens, val_tokens, sampler, val, vocab)


def load_lm_data(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False) -> LMData:
    """Everything ``cfg`` trains on, checked; writes nothing. A text corpus gets its tokenizer: the
    run's saved one when resuming, else a new one (BPE trained on the training split only)."""
    corpus = _load_lm_corpus(cfg)
    tokenizer = None
    if not corpus.is_tokenized:
        tok_dir = run_dir / "tokenizer" if run_dir is not None else None
        tokenizer = load_tokenizer(tok_dir) if resume and tok_dir is not None and tok_dir.is_dir() else \
            build_tokenizer(cfg.data.tokenizer, corpus, cfg.data.vocab_size, cfg.data.val_fraction)
    return _token_data(cfg, corpus, tokenizer)


def check_data(cfg: RunConfig) -> None:
    """Refuse what is wrong with ``cfg``'s data before anything is written (``compare`` checks every
    run with it before it claims its folder): the corpus and its options, the split, the batches
    and the vocabulary. A BPE tokenizer is not trained here: its package and vocabulary bound are
    checked, and the text split. An image task's data set is loaded and checked as its run will
    load it (:func:`~siamesenorm.tasks.common.load_image_data`)."""
    if getattr(cfg, "task", "lm") != "lm":
        from .tasks.common import load_image_data

        load_image_data(cfg)
        return
    corpus = _load_lm_corpus(cfg)
    if corpus.is_tokenized or cfg.data.tokenizer == "bytes":
        _token_data(cfg, corpus, None if corpus.is_tokenized else ByteTokenizer())
        return
    import_tokenizers()
    train_text(corpus, cfg.data.val_fraction)


# ---- training -----------------------------------------------------------------------------------
def _settings(cfg: RunConfig, val: list) -> TrainSettings:
    t = cfg.train
    return TrainSettings(steps=t.steps, lr=t.lr, warmup=t.warmup, min_lr_ratio=t.min_lr_ratio,
                         weight_decay=t.weight_decay, betas=t.betas, grad_clip=t.grad_clip,
                         grad_accum=t.grad_accum, eval_every=t.eval_every, eval_batches=val,
                         checkpoint_every=t.checkpoint_every,
                         divergence_factor=t.divergence_factor, compile=t.compile, seed=cfg.seed)


def _arithmetic_eval(cfg: RunConfig, data: LMData):
    """For arithmetic: ``model -> {"arith_acc": ...}`` on ``data.eval_problems`` held-out problems."""
    if not data.corpus.heldout:
        return None
    problems = data.corpus.heldout[:cfg.data.eval_problems]
    tokenizer = data.tokenizer
    longest = max(len(tokenizer.encode(p.answer)) for p in problems) + 1

    def extra_eval(m: torch.nn.Module) -> dict:
        score = evaluate_arithmetic(lm_answer_fn(m, tokenizer, longest), problems)
        return {"arith_acc": score["accuracy"]}

    return extra_eval


def run_training(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False,
                 progress: bool | None = None) -> dict:
    """Train ``cfg`` into ``run_dir`` (or continue it with ``resume``); returns the summary.

    Every check (the run directory, the data, the vocabulary) happens before anything is written.
    ``summary.json`` also records the data under ``data`` (:func:`data_info`). Image tasks
    (``task: vit`` or ``dit``) run through :mod:`siamesenorm.tasks`."""
    run_dir = Path(run_dir)
    check_out_dir(run_dir)
    task = cfg.task if cfg is not None and not resume else _saved_task(run_dir)
    if task != "lm":
        from .tasks import run_dit, run_vit

        runner = {"vit": run_vit, "dit": run_dit}[task]
        return runner(cfg, run_dir, resume=resume, progress=progress)
    if resume:
        cfg = load_config(str(run_dir / "config.yaml"))
    elif (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(f"{run_dir} already holds a run; resume it with --resume or choose another --out")
    device = resolve_device(cfg.train.device)
    data = load_lm_data(cfg, run_dir, resume)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data.vocab_size))

    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        if data.tokenizer is not None:
            data.tokenizer.save(run_dir / "tokenizer")

    torch.manual_seed(cfg.seed)
    model = LanguageModel(cfg.model, device=device)
    probe = None
    if cfg.analysis.every > 0:
        from .analysis.training_probes import TrainingProbes

        x, y = data.val[0]
        probe = TrainingProbes(cfg.analysis.every, (x[:cfg.analysis.batch_size], y[:cfg.analysis.batch_size]))
    summary = train(model, data.sampler, _settings(cfg, data.val), run_dir, resume=resume, device=device,
                    extra_eval=_arithmetic_eval(cfg, data), progress=progress, probe=probe,
                    info={"data": data_info(data.corpus)})
    if probe is not None and cfg.analysis.at_end and not summary.get("diverged") \
            and not summary.get("interrupted"):
        from .analysis.run_analysis import analyze_model, write_analysis

        chosen = analysis_batches(data.val_tokens, cfg, cfg.analysis.batches)
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
