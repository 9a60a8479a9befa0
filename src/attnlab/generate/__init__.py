"""Generation: greedy, sampling (temperature, top-k, top-p), beam search, on the KV cache."""

from .search import GenerationConfig, GenerationOutput, Hypothesis, beam_search, generate, stream_tokens

__all__ = ["GenerationConfig", "GenerationOutput", "Hypothesis", "generate", "beam_search", "stream_tokens"]
