"""Metrics of the field: sacreBLEU, chrF, perplexity, accuracy."""

from .metrics import bleu_tokenizer_for, corpus_scores

__all__ = ["corpus_scores", "bleu_tokenizer_for"]
