"""The model: embeddings and positions → attention and masks → layers → the three families.

Nothing in this package imports from the layers above it (train, generate, inspect, cli).
"""

from .attention import KVCache, MultiHeadAttention, causal_mask, combine_masks, padding_mask, scaled_dot_product_attention
from .embedding import (LearnedPositionalEmbedding, PatchEmbedding, RelativePositionBias, RotaryEmbedding,
                        SinusoidalPositionalEncoding, TokenEmbedding, alibi_slopes, relative_position_bucket,
                        sinusoidal_table)
from .layers import DecoderLayer, EncoderLayer, PositionwiseFeedForward, RMSNorm, SublayerConnection
from .transformer import (DecoderCache, DecoderOnly, EncoderDecoder, EncoderOnly, MODEL_CLASSES,
                          TransformerBase, build_model, eval_mode)

__all__ = [
    "KVCache", "MultiHeadAttention", "causal_mask", "combine_masks", "padding_mask",
    "scaled_dot_product_attention", "LearnedPositionalEmbedding", "RotaryEmbedding",
    "SinusoidalPositionalEncoding", "TokenEmbedding", "alibi_slopes", "sinusoidal_table",
    "PatchEmbedding", "RelativePositionBias", "relative_position_bucket",
    "DecoderLayer", "EncoderLayer", "PositionwiseFeedForward", "RMSNorm", "SublayerConnection",
    "DecoderCache", "DecoderOnly", "EncoderDecoder", "EncoderOnly", "MODEL_CLASSES",
    "TransformerBase", "build_model", "eval_mode",
]
