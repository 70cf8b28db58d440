"""Text for the language models: corpora, tokenizers, train/validation splits, resumable batches."""

from __future__ import annotations

from ...errors import UserError
from .arithmetic import ArithmeticProblem, load_arithmetic, make_problems
from .arithmetic_eval import evaluate_arithmetic, lm_answer_fn
from .batches import BatchSampler, validation_batches
from .corpora import check_corpus_options, load_corpus, names_token_files
from .corpus import Corpus
from .splits import split_text, split_tokens, train_text, train_val_tokens
from .tokenfiles import read_token_file, write_shard
from .tokenizers import BPETokenizer, ByteTokenizer, Tokenizer, import_tokenizers, load_tokenizer

__all__ = ["TOKENIZER_KINDS", "ArithmeticProblem", "BPETokenizer", "BatchSampler", "ByteTokenizer", "Corpus",
           "Tokenizer", "build_tokenizer", "check_corpus_options", "evaluate_arithmetic",
           "import_tokenizers", "lm_answer_fn", "load_arithmetic", "load_corpus", "load_tokenizer",
           "make_problems", "names_token_files", "read_token_file", "split_text", "split_tokens",
           "train_text", "train_val_tokens", "validation_batches", "write_shard"]

TOKENIZER_KINDS = ("bytes", "bpe")


def build_tokenizer(kind: str, corpus: Corpus, vocab_size: int = 1024,
                    val_fraction: float = 0.1) -> Tokenizer:
    """A ``bytes`` tokenizer, or a ``bpe`` one trained up to ``vocab_size`` ids on the training text only
    (:func:`~.splits.train_text` with the same ``val_fraction``)."""
    if kind not in TOKENIZER_KINDS:
        raise UserError(f"unknown tokenizer {kind!r}; choose {' or '.join(TOKENIZER_KINDS)}")
    if corpus.is_tokenized:
        raise UserError(f"corpus {corpus.name} is already tokens (.bin); it takes no tokenizer")
    if kind == "bytes":
        return ByteTokenizer()
    return BPETokenizer.train(train_text(corpus, val_fraction), vocab_size)
