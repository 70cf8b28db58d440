"""Data, in two halves that share nothing: text for the language models (:mod:`.text`) and image sets
for the vision models (:mod:`.images`). Nothing here downloads; the sources: docs/tasks.md."""

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
