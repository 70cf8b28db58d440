"""Data, in two halves that share nothing: text for the language models (:mod:`.text`: corpora,
tokenizers, splits, batches) and image sets for the vision models (:mod:`.images`).

Nothing here downloads. A typical run::

    corpus = load_corpus("pystdlib", max_bytes=8_000_000)     # or "arithmetic", "hf:NAME", a path
    tokenizer = build_tokenizer("bytes", corpus)              # or ("bpe", corpus, vocab_size=1024)
    train, val = train_val_tokens(corpus, tokenizer, val_fraction=0.1)  # BPE: same val_fraction
    sampler = BatchSampler(train, batch_size=16, seq_len=128, seed=0)
    x, y = sampler.next_batch()                               # int64 (16, 128); y is x shifted by one
    fixed_val = validation_batches(val, 16, 128, n_batches=8)

A :class:`Corpus` holds ``text`` or, for ``.bin`` files, ``tokens`` (no tokenizer then; the model's
vocabulary must exceed ``meta["max_token"]``). The corpora, the image sets and their options:
docs/tasks.md, "The data a task reads".
"""

from .images import (
    ImageAugment,
    ImageBatchSampler,
    ImageSet,
    check_image_options,
    image_validation_batches,
    load_images,
    split_images,
    stratified_split_indices,
    to_model_range,
)
from .text import (
    TOKENIZER_KINDS,
    ArithmeticProblem,
    BatchSampler,
    BPETokenizer,
    ByteTokenizer,
    Corpus,
    Tokenizer,
    build_tokenizer,
    check_corpus_options,
    evaluate_arithmetic,
    import_tokenizers,
    lm_answer_fn,
    load_arithmetic,
    load_corpus,
    load_tokenizer,
    make_problems,
    names_token_files,
    read_token_file,
    split_text,
    split_tokens,
    train_text,
    train_val_tokens,
    validation_batches,
    write_shard,
)

__all__ = ["TOKENIZER_KINDS", "ArithmeticProblem", "BPETokenizer", "BatchSampler", "ByteTokenizer", "Corpus",
           "ImageAugment", "ImageBatchSampler", "ImageSet", "Tokenizer", "build_tokenizer",
           "check_corpus_options", "check_image_options", "evaluate_arithmetic", "image_validation_batches",
           "import_tokenizers", "lm_answer_fn", "load_arithmetic", "load_corpus", "load_images",
           "load_tokenizer", "make_problems", "names_token_files", "read_token_file", "split_images",
           "split_text", "split_tokens", "stratified_split_indices", "to_model_range", "train_text",
           "train_val_tokens", "validation_batches", "write_shard"]
