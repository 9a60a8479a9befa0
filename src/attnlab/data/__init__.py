"""Data: readers for parallel and plain text, BPE tokenizers, token-budget batching."""

from .batching import TokenBatchSampler, collate_pairs
from .readers import DataError, read_labeled, read_pairs, read_parallel_files, read_text, read_tsv_pairs
from .tokenizer import Tokenizer, char_tokenizer, train_tokenizer

__all__ = ["DataError", "read_pairs", "read_tsv_pairs", "read_parallel_files", "read_text", "read_labeled",
           "Tokenizer", "train_tokenizer", "char_tokenizer", "TokenBatchSampler", "collate_pairs"]
