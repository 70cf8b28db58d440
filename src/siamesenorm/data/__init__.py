"""Data, in two halves that share nothing: text for the language models (:mod:`.text`: corpora,
tokenizers, splits, batches) and image sets for the vision models (:mod:`.images`).

Nothing here downloads. A typical run::

    corpus = load_corpus("pystdlib", max_bytes=8_000_000)     # or "arithmetic", "hf:NAME", a path
    tokenizer = build_tokenizer("bytes", corpus)              # or ("bpe", corpus, vocab_size=1024)
    train, val = train_val_tokens(corpus, tokenizer, val_fraction=0.1)  # BPE: same val_fraction
    sampler = BatchSampler(train, batch_size=16, seq_len=128, seed=0)
    x, y = sampler.next_batch()                               # int64 (16, 128); y is x shifted by one
    fixed_val = validation_batches(val, 16, 128, n_batches=8)

Corpora (``load_corpus(spec, **options)``; an option the spec does not take is refused):

* ``pystdlib`` (``max_bytes=8_000_000``): this interpreter's standard-library ``*.py`` source
  without tests and site-packages, in sorted path order; ``meta["fingerprint"]`` holds
  ``files``, ``bytes``, ``sha256`` and ``python``.
* ``arithmetic`` (``operations="+-*"``, ``min_digits=1``, ``max_digits=3``, ``n_train=20_000``,
  ``n_heldout=1_000``, ``seed=0``): lines such as ``12*34=408``; the held-out problems
  (``corpus.heldout``) are the validation text and never appear in training. Score a model with
  ``evaluate_arithmetic(lm_answer_fn(model, tokenizer, max_new_tokens), corpus.heldout)``.
* ``hf:NAME[:CONFIG]`` (``split="train"``, ``val_split=None``, ``text_field="text"``,
  ``max_bytes=None``): a dataset already in the local Hugging Face cache, through the optional
  ``datasets`` package, offline.
* a path (``max_bytes=None``, ``val=None``): a text file; a folder of text files (recursive,
  sorted, every UTF-8 file); a ``.bin`` token file (nanoGPT's headerless uint16 or a
  modded-nanogpt shard, told apart by the header magic); a folder of ``.bin`` shards; or a glob.
  ``val`` names separate validation data of the same kind (e.g. ``train.bin`` + ``val.bin``).

Images for the vision models (:mod:`.images`; ``load_images(spec, **options)``: ``digits``, an
ImageFolder directory or an ``.npz`` file; see :mod:`siamesenorm.data.images.sources`)::

    images = load_images("digits")                               # ImageSet, N x C x H x W
    train, val = split_images(images, val_fraction=0.1, seed=0)  # stratified, fixed
    sampler = ImageBatchSampler.from_set(train, batch_size=64, seed=0, augment=ImageAugment())
    x, y = sampler.next_batch()                                  # float32 in [-1, 1], int64 labels
    fixed_val = image_validation_batches(val, batch_size=64)

A :class:`Corpus` holds ``text`` or, for ``.bin`` files, ``tokens`` (no tokenizer then; the model's
vocabulary must exceed ``meta["max_token"]``). Saved tokenizers come back with
:func:`load_tokenizer`.
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
           "load_tokenizer", "make_problems", "read_token_file", "split_images", "split_text",
           "split_tokens", "stratified_split_indices", "to_model_range", "train_text", "train_val_tokens",
           "validation_batches", "write_shard"]
