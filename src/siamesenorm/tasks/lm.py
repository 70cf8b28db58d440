"""``task: lm``: a decoder-only language model learns a text corpus or token files.

The run directory also holds ``tokenizer/`` (a text corpus's tokenizer, so the run can be reloaded)
and ``summary.json`` records the corpus's name and fingerprint under ``data``. With
``data.corpus=arithmetic`` every evaluation also answers held-out problems (``arith_acc``).

The model's vocabulary is the tokenizer's, or for token files the largest id of the training and
validation files plus one; a ``model.vocab_size`` set to another value than its default stands when
it is at least that large, and is refused when smaller.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..analysis.adapters import lm_head
from ..config import AnalysisConfig, TrainConfig, check_seed, derive
from ..data import (
    BatchSampler,
    Corpus,
    Tokenizer,
    build_tokenizer,
    check_corpus_options,
    load_corpus,
    load_tokenizer,
    names_token_files,
    train_val_tokens,
    validation_batches,
)
from ..errors import UserError
from ..models import LanguageModel, LMConfig
from ..rundir import RunDir, inner_folder, read_json
from .lm_eval import LMEvaluation
from .spec import Task

# ---- configuration ------------------------------------------------------------------------------
# ``data.corpus: ""`` in a preset: the user must name the data. The configuration loads (so
# ``--dry-run`` and grids work); loading or checking the data refuses it in one line.
UNSET_CORPUS = ""


@dataclass(frozen=True)
class DataConfig:
    """What to train on: ``corpus`` is ``pystdlib``, ``arithmetic``, ``hf:NAME`` or a path; ``""``
    (a preset's way to say that the user names the data) is refused when the data is loaded."""

    corpus: str = "pystdlib"
    corpus_options: dict[str, Any] = field(default_factory=dict)  # keyword options of its loader
    tokenizer: str = "bytes"           # "bytes" or "bpe"; "ids" for .bin token files (set for them)
    vocab_size: int = 1024             # BPE only
    max_bytes: int = 8_000_000         # pystdlib only
    val_fraction: float = 0.1
    batch_size: int = 16
    seq_len: int = 128
    val_batches: int = 8
    eval_problems: int = 200           # arithmetic only: held-out problems answered at each evaluation

    def __post_init__(self) -> None:
        if self.tokenizer not in ("bytes", "bpe", "ids"):
            raise UserError(f"data.tokenizer: unknown value {self.tokenizer!r}; choose bytes or bpe")
        for name in ("vocab_size", "max_bytes", "batch_size", "seq_len", "val_batches", "eval_problems"):
            if getattr(self, name) <= 0:
                raise UserError(f"data.{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class LMRunConfig:
    """One language-model run (``task: lm``): the model, its data, its training, and the seed of
    everything random. The corpus's options are checked against its loader."""

    task: str = "lm"
    model: LMConfig = field(default_factory=LMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        if self.data.corpus != UNSET_CORPUS:  # unset: refused when the data is loaded (_load_corpus)
            check_corpus_options(self.data.corpus, self.data.corpus_options)
        # .bin token files are read as the ids they hold, whatever a preset says of tokenizers: the
        # configuration (and config.yaml) says so, rather than name a tokenizer the run never used
        tokens = names_token_files(self.data.corpus)
        if tokens and self.data.tokenizer != "ids":
            object.__setattr__(self, "data", dataclasses.replace(self.data, tokenizer="ids"))
        elif not tokens and self.data.tokenizer == "ids":
            raise UserError(f"data.tokenizer=ids is for a corpus of .bin token files, not "
                            f"data.corpus={self.data.corpus}; choose bytes or bpe")
        if self.model.family:
            from ..hf.families import check_family  # siamesenorm.hf for a family run only

            check_family(self.model.family, self.model.family_options)
            from ..hf.family_lm import check_family_config

            check_family_config(self.model)


# ---- data ---------------------------------------------------------------------------------------
_DEFAULT_VOCAB = next(f.default for f in dataclasses.fields(LMConfig) if f.name == "vocab_size")


@dataclass(frozen=True)
class LMData:
    """The data of one ``data`` setting of a language-model run (shared by the runs of a compare
    that have it): the corpus, its tokenizer (``None`` for token files), the train/validation
    tokens and the fixed validation batches."""

    corpus: Corpus
    tokenizer: Tokenizer | None
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    val_batches: list

    def vocab_needed(self) -> tuple[int, str]:
        """The ids the model must cover, and what needs them (for an error)."""
        if self.tokenizer is not None:
            return self.tokenizer.vocab_size, f"the {self.tokenizer.kind} tokenizer"
        needed = int(max(self.train_tokens.max(), self.val_tokens.max())) + 1
        return needed, f"{self.corpus.name} (largest token id {needed - 1}, over training and validation)"

    def batches(self, cfg: LMRunConfig) -> BatchSampler:
        return BatchSampler(self.train_tokens, cfg.data.batch_size, cfg.data.seq_len, seed=cfg.seed)

    def analysis_batches(self, cfg: LMRunConfig, n: int) -> list:
        return analysis_batches(self.val_tokens, cfg, n)

    def info(self, cfg: LMRunConfig) -> dict:
        return {"data": data_info(self.corpus),
                "unigram_val_loss": unigram_loss(self.train_tokens, self.val_batches, cfg.model.vocab_size)}

    def save(self, run_dir: Path) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save(inner_folder(RunDir(run_dir).tokenizer))


def corpus_options(cfg: LMRunConfig) -> dict:
    """``data.corpus_options``, plus ``data.max_bytes`` for pystdlib (which the options may override)."""
    base = {"max_bytes": cfg.data.max_bytes} if cfg.data.corpus == "pystdlib" else {}
    return {**base, **cfg.data.corpus_options}


def data_info(corpus: Corpus) -> dict:
    """The corpus's description for ``summary.json``: its name and, when it has one, its fingerprint
    (files, bytes, sha256 and, for pystdlib, the Python version), so that results from different
    data can be told apart."""
    info: dict = {"name": corpus.name}
    if corpus.meta.get("fingerprint") is not None:
        info["fingerprint"] = corpus.meta["fingerprint"]
    return info


def _model_vocab(cfg: LMRunConfig, needed: int, why: str) -> int:
    """The model's vocabulary: ``needed`` ids, or ``model.vocab_size`` when it was set (differs from
    the default) and is at least ``needed``; a smaller explicit value is refused."""
    given = cfg.model.vocab_size
    if given == _DEFAULT_VOCAB:
        return needed
    if given < needed:
        raise UserError(f"model.vocab_size={given} is too small: {why} needs {needed} ids; raise "
                          f"model.vocab_size to at least {needed} or leave it unset")
    return given


def _load_corpus(cfg: LMRunConfig) -> Corpus:
    if cfg.data.corpus == UNSET_CORPUS:
        raise UserError("data.corpus is not set: name the training data, e.g. "
                          "data.corpus=PATH/TO/train.bin (a .bin token file, a folder of .bin shards "
                          "or a glob) or data.corpus=hf:NAME")
    return load_corpus(cfg.data.corpus, **corpus_options(cfg))


def _imported_from(run_dir: str | Path) -> str | None:
    """The checkpoint an ``import-olmo-core`` run came from (its summary's ``imported_from``)."""
    try:
        found = read_json(RunDir(run_dir).summary).get("imported_from")
    except (UserError, AttributeError):
        return None
    return str(found.get("olmo_core_checkpoint", "?")) if isinstance(found, dict) else None


def load_lm_data(cfg: LMRunConfig, run_dir: Path | None = None, resume: bool = False) -> LMData:
    """Everything ``cfg.data`` names, checked; writes nothing. A text corpus gets its tokenizer: the
    run's saved one when resuming, else a new one (BPE trained on the training split only)."""
    d = cfg.data
    imported = _imported_from(run_dir) if resume and run_dir is not None else None
    if imported is not None or (resume and d.corpus == UNSET_CORPUS):   # before anything is written
        what = f"was imported from the OLMo-core checkpoint {imported}" if imported is not None else \
            "names no training data (data.corpus is unset)"
        raise UserError(f"{run_dir or 'the run'} {what}, so it cannot be resumed (--resume takes no "
                        "data.corpus): continue the OLMo-core run (siamesenorm olmo-core train "
                        "with its --save-folder), or train a new run with data.corpus=PATH")
    corpus = _load_corpus(cfg)
    tokenizer = None
    if not corpus.is_tokenized:
        tok_dir = RunDir(run_dir).tokenizer if run_dir is not None else None
        tokenizer = load_tokenizer(tok_dir) if resume and tok_dir is not None and tok_dir.is_dir() else \
            build_tokenizer(d.tokenizer, corpus, d.vocab_size, d.val_fraction)
    train_tokens, val_tokens = train_val_tokens(corpus, tokenizer, d.val_fraction)
    val = validation_batches(val_tokens, d.batch_size, d.seq_len, d.val_batches)
    return LMData(corpus, tokenizer, train_tokens, val_tokens, val)


# ---- a run --------------------------------------------------------------------------------------
def _fit(cfg: LMRunConfig, data: LMData) -> LMRunConfig:
    """The model's vocabulary from the data (:func:`_model_vocab`): the one value fitting sets;
    and the model's context must hold the data's sequences."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise UserError(f"data.seq_len ({cfg.data.seq_len}) exceeds model.max_seq_len "
                          f"({cfg.model.max_seq_len}); raise model.max_seq_len or lower data.seq_len")
    if data.tokenizer is not None and data.tokenizer.kind == "bpe":     # it may use all it was allowed
        _model_vocab(cfg, cfg.data.vocab_size, f"the BPE tokenizer (data.vocab_size={cfg.data.vocab_size})")
    return derive(cfg, {"model.vocab_size": _model_vocab(cfg, *data.vocab_needed())})


def _build_model(cfg: LMRunConfig, device=None) -> nn.Module:
    if cfg.model.family:
        from ..hf.family_lm import FamilyLM

        return FamilyLM(cfg.model, device=device)
    return LanguageModel(cfg.model, device=device)


UNIGRAM_SAMPLE = 1 << 24   # training tokens counted for the unigram loss (the first ones)


def unigram_loss(train_tokens, batches: list, vocab: int) -> float:
    """The validation loss of a model that knows only how often each token occurs in training: the
    cross-entropy, in nats per token, of the targets of ``batches`` under the frequencies of the
    first :data:`UNIGRAM_SAMPLE` training tokens, add-one smoothed over the ``vocab`` ids. A run
    whose loss stays near it has learned nothing beyond those frequencies (compare calls that the
    plateau)."""
    counts = np.bincount(np.asarray(train_tokens[:UNIGRAM_SAMPLE]).ravel().astype(np.int64),
                         minlength=vocab).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    targets = np.concatenate([np.asarray(y).ravel() for _, y in batches]).astype(np.int64)
    return float(-log_p[targets].mean())


# ---- analysis -----------------------------------------------------------------------------------
def analysis_batches(tokens, cfg: LMRunConfig, n: int) -> list:
    """``n`` validation batches of ``tokens`` for an analysis: the first ``n`` of the run's own
    evaluation batches (``data.val_batches`` of them, spread evenly over ``tokens``) when it has
    that many, else ``n`` batches spread evenly."""
    return validation_batches(tokens, cfg.data.batch_size, cfg.data.seq_len, max(n, cfg.data.val_batches))[:n]


def analysis_tokens(run_dir: str | Path, cfg: LMRunConfig, data: str | None = None):
    """Token array for ``siamesenorm analyze``: the run's validation split, or all of ``data``
    (a text file, folder or token file, read as the run's corpus was) encoded with its tokenizer."""
    run_dir = Path(run_dir)
    tok_dir = RunDir(run_dir).tokenizer
    tokenizer = load_tokenizer(tok_dir) if tok_dir.is_dir() else None
    if data is None:
        if cfg.data.corpus == UNSET_CORPUS:     # e.g. a run imported from OLMo-core without --data
            raise UserError(f"{run_dir} names no data to analyse (its data.corpus is unset); give --data "
                              "token files of its vocabulary")
        corpus = load_corpus(cfg.data.corpus, **corpus_options(cfg))
        if not corpus.is_tokenized and tokenizer is None:
            raise UserError(f"{run_dir} has no tokenizer/ to encode its corpus; give --data a token file")
        return train_val_tokens(corpus, tokenizer, cfg.data.val_fraction)[1]
    corpus = load_corpus(data)
    if corpus.is_tokenized:
        parts = [corpus.tokens] + ([corpus.val_tokens] if corpus.val_tokens is not None else [])
    else:
        if tokenizer is None:
            raise UserError(f"{run_dir} was trained on token files and has no tokenizer for the text "
                              f"in {data}; give a token file")
        texts = [corpus.text] + ([corpus.val_text] if corpus.val_text is not None else [])
        parts = [tokenizer.encode_array(t) for t in texts]
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    if len(tokens) and int(tokens.max()) >= cfg.model.vocab_size:
        raise UserError(f"{data} holds token id {int(tokens.max())}, beyond the model's vocabulary "
                          f"of {cfg.model.vocab_size}; give data tokenized for this run")
    return tokens


def _analyze_batches(cfg: LMRunConfig, run_dir: Path, data: str | None, n: int) -> list:
    tokens = analysis_tokens(run_dir, cfg, data)
    if data is None:
        return analysis_batches(tokens, cfg, n)
    return validation_batches(tokens, cfg.data.batch_size, cfg.data.seq_len, n)


# ---- generation ---------------------------------------------------------------------------------
def run_tokenizer(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a text run saved (a run on token files has none: a one-line error)."""
    tok_dir = RunDir(run_dir).tokenizer
    if not tok_dir.is_dir():
        raise UserError(f"{run_dir} was trained on token files and has no tokenizer to turn text "
                          "into tokens")
    return load_tokenizer(tok_dir)


def prompt_ids(tokenizer: Tokenizer, prompt: str | bytes) -> list[int]:
    """The token ids of ``prompt``: bytes, or text whose undecodable bytes are surrogate escapes
    (how Python hands over command-line bytes that are not UTF-8). A byte-level tokenizer takes
    any bytes; a tokenizer of text (BPE) refuses bytes that are not UTF-8 text in one line."""
    try:
        raw = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as err:          # a lone surrogate that stands for no byte
        raise UserError(f"the prompt holds {prompt[err.start]!r} at character {err.start}, which is "
                          "no character nor byte; give the prompt as UTF-8 text") from None
    if tokenizer.kind == "bytes":
        return list(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"the prompt is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset "
                          f"{err.start}); this run's {tokenizer.kind} tokenizer reads text: give the "
                          "prompt as UTF-8 (a byte-level run, data.tokenizer=bytes, takes any "
                          "bytes)") from None
    return tokenizer.encode(text)


# Generation past the model's context: how many tokens are timed before saying how long the rest
# takes, and from how many seconds on that is said.
SLIDE_TIMED_TOKENS = 8
SLIDE_NOTE_SECONDS = 5.0


def generate_text(run_dir: Path, model: LanguageModel, prompt: str | bytes, max_new_tokens: int = 200, *,
                  temperature: float = 0.8, top_k: int | None = None, greedy: bool = False,
                  seed: int = 0, note: Callable[[str], None] | None = None) -> str:
    """Continue ``prompt`` (text, or bytes: see :func:`prompt_ids`) with ``model``, the trained
    model of ``run_dir``; returns the prompt and its continuation (through the run's tokenizer).

    Within the model's context (``model.max_seq_len`` tokens, prompt included) a KV cache makes
    each token cheap. Past it the window slides: each new token re-reads the last
    ``max_seq_len`` tokens without a cache, so long continuations take long; when the rest would
    take more than :data:`SLIDE_NOTE_SECONDS` (timed on the first tokens) ``note`` is told so, in
    one line, before it runs."""
    tokenizer = run_tokenizer(run_dir)
    ids = prompt_ids(tokenizer, prompt)
    if not ids:
        raise UserError("the prompt is empty; give at least one character")
    x = torch.tensor([ids], device=model.embed.weight.device)
    context = model.config.max_seq_len
    gen = torch.Generator(x.device).manual_seed(seed)
    options = dict(temperature=temperature, top_k=top_k, greedy=greedy, generator=gen)
    if len(ids) + max_new_tokens <= context:
        return tokenizer.decode(model.generate(x, max_new_tokens, use_cache=True, **options)[0].tolist())
    timed = min(max_new_tokens, SLIDE_TIMED_TOKENS)
    start = time.perf_counter()
    out = model.generate(x, timed, use_cache=False, **options)      # the same draws as one call
    per_token = (time.perf_counter() - start) / max(timed, 1)
    rest = max_new_tokens - timed
    if note is not None and rest * per_token > SLIDE_NOTE_SECONDS:
        tokens = f"{len(ids)} token{'' if len(ids) == 1 else 's'}"
        note(f"the prompt ({tokens}) and {max_new_tokens:,} new tokens exceed the model's "
             f"context of {context} tokens: past it each new token re-reads the last {context} "
             f"(a sliding window, no cache), about {_duration(rest * per_token)} at "
             f"{1000 * per_token:.1f} ms a token; Ctrl-C stops it, a smaller --max-new-tokens "
             "shortens it")
    out = model.generate(out, rest, use_cache=False, **options)
    return tokenizer.decode(out[0].tolist())


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def _micro_batch(cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, on the meta device."""
    shape = (cfg.data.batch_size, cfg.data.seq_len)
    return (torch.empty(shape, dtype=torch.long, device="meta"),
            torch.empty(shape, dtype=torch.long, device="meta"))


def _head_memory(cfg: Any, tokens: int) -> tuple[int, int]:
    """The fp32 logits of ``tokens`` tokens, and the rotary tables (fp32, per layer)."""
    m = cfg.model
    return 4 * tokens * m.vocab_size, 4 * m.n_layers * m.max_seq_len * m.head_dim


TASK = Task(
    name="lm",
    config_class=LMRunConfig,
    load_data=load_lm_data,
    fit=_fit,
    build_model=_build_model,
    evaluation=LMEvaluation.for_run,
    analysis_batches=_analyze_batches,
    headline=("final_val_loss", "final validation loss"),
    columns=("final_arith_acc",),
    higher_is_better=("final_arith_acc",),
    head_fn=lm_head,
    kind="language-model",
    micro_batch=_micro_batch,
    tokens_per_sample=lambda cfg: cfg.data.seq_len,
    generate=generate_text,
    multi_process=True,
    exports_hf=True,
    head_memory=_head_memory,
    default_preset="default",     # configs/default.yaml: the README's main job
)
