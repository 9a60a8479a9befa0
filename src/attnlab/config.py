"""One validated configuration for every Transformer attnlab can build.

A ``TransformerConfig`` describes all three families of the architecture:

* ``encoder-decoder`` — the model of *Attention Is All You Need* (translation, BART, Marian);
* ``decoder-only``   — GPT / Llama style causal language models;
* ``encoder-only``   — BERT style bidirectional encoders (classification, embeddings).

Every variant the literature added since 2017 is an *option* of the same blocks (norm type, norm
placement, position type, number of KV heads, activation), never a copy of a block. Invalid
combinations are rejected when the config is built, with the field and the rule in the message.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("encoder-decoder", "decoder-only", "encoder-only")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("post", "pre")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "t5", "none")
SINUSOIDAL_LAYOUTS = ("interleaved", "split")
INITS = ("xavier", "normal", "t5", "torch")
POOLINGS = ("cls", "mean", "last")


class ConfigError(ValueError):
    """A configuration value (or combination of values) that cannot describe a model."""


@dataclass
class TransformerConfig:
    """All hyper-parameters of a Transformer. Defaults are the paper's base model."""

    family: str = "encoder-decoder"
    vocab_size: int = 37000
    # Target vocabulary of an encoder-decoder; None means one joint vocabulary for both sides.
    tgt_vocab_size: int | None = None

    d_model: int = 512
    n_heads: int = 8
    # Number of key/value heads: n_heads = multi-head, 1 = multi-query, in between = grouped-query.
    n_kv_heads: int | None = None
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048

    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0

    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "post"
    # A norm after the last layer of each stack. None = only with Pre-Norm (where it is required,
    # since the residual stream is never normalised otherwise).
    final_norm: bool | None = None
    # A norm right after embedding + positions (BERT, BART).
    embedding_norm: bool = False

    activation: str = "relu"

    positions: str = "sinusoidal"
    sinusoidal_layout: str = "interleaved"  # paper: sin/cos interleaved; "split": fairseq/Marian halves
    max_len: int = 1024  # learned positions only: the size of the table
    rope_theta: float = 10000.0
    type_vocab_size: int = 0  # BERT's token-type (segment) embeddings; 0 = none
    # positions="t5": a learned bias per head for each bucket of relative distance (key - query);
    # exact buckets for near distances, log-spaced ones up to rel_max_distance, one bucket beyond.
    rel_buckets: int = 32
    rel_max_distance: int = 128
    # Scores divided by √d_k (the paper). T5 does not scale: it folds the factor into the init.
    attention_scale: bool = True
    # T5: the decoder output is multiplied by d_model^-0.5 before a *tied* output projection, since
    # the shared embedding is initialised with std 1 (no √d input scale to undo).
    tied_output_scale: bool = False

    # Images as tokens (ViT, encoder-only): image_size > 0 replaces the token embedding by a patch
    # embedding of (image_size / patch_size)² patches of n_channels, plus a [CLS] token.
    image_size: int = 0
    patch_size: int = 16
    n_channels: int = 3

    embed_scale: bool = True  # multiply token embeddings by sqrt(d_model)
    tie_output: bool = True  # decoder input embedding == output projection
    share_embeddings: bool = True  # encoder embedding == decoder embedding (needs a joint vocabulary)
    bias: bool = True
    output_bias: bool = False  # bias on the output projection (BART/Marian final_logits_bias)
    init: str = "xavier"
    init_std: float = 0.02

    # Encoder-only heads.
    n_classes: int = 0  # > 0 adds a classification head
    pooling: str = "cls"
    pooler_activation: bool = False  # BERT's dense + tanh pooler before the classifier

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 3

    name: str = ""  # free-form label, e.g. the preset it came from

    def __post_init__(self) -> None:
        self.validate()

    # -- derived quantities -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size if self.tgt_vocab_size is not None else self.vocab_size

    @property
    def has_final_norm(self) -> bool:
        return self.norm_placement == "pre" if self.final_norm is None else self.final_norm

    @property
    def is_image_model(self) -> bool:
        return self.image_size > 0

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.image_size else 0

    @property
    def has_encoder(self) -> bool:
        return self.family in ("encoder-decoder", "encoder-only")

    @property
    def has_decoder(self) -> bool:
        return self.family in ("encoder-decoder", "decoder-only")

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(f"invalid TransformerConfig: {msg}")

        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                fail(f"{name}={value!r} is not one of {', '.join(allowed)}")

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(f"{name}={value!r} must be a positive integer")

        choice("family", FAMILIES)
        choice("norm", NORMS)
        choice("norm_placement", NORM_PLACEMENTS)
        choice("activation", ACTIVATIONS)
        choice("positions", POSITIONS)
        choice("sinusoidal_layout", SINUSOIDAL_LAYOUTS)
        choice("init", INITS)
        choice("pooling", POOLINGS)
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            positive(name)
        if self.tgt_vocab_size is not None:
            positive("tgt_vocab_size")
        if self.n_kv_heads is not None:
            positive("n_kv_heads")
        if self.has_encoder:
            positive("n_encoder_layers")
        if self.has_decoder:
            positive("n_decoder_layers")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                fail(f"{name}={p} must be in [0, 1)")
        if self.norm_eps <= 0:
            fail(f"norm_eps={self.norm_eps} must be > 0")
        if self.d_model % self.n_heads:
            fail(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            fail(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads} "
                 "(each key/value head must serve the same number of query heads)")
        if self.positions == "rope" and self.head_dim % 2:
            fail(f"positions='rope' needs an even head dimension, got d_model/n_heads={self.head_dim}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            fail(f"positions='sinusoidal' needs an even d_model, got {self.d_model}")
        if self.tgt_vocab_size is not None and self.family != "encoder-decoder":
            fail(f"tgt_vocab_size is only meaningful for family='encoder-decoder', not {self.family!r}")
        if (self.family == "encoder-decoder" and self.share_embeddings
                and self.tgt_vocab_size not in (None, self.vocab_size)):
            fail(f"share_embeddings=True needs a joint vocabulary, but vocab_size={self.vocab_size} "
                 f"!= tgt_vocab_size={self.tgt_vocab_size}; set share_embeddings=False")
        if self.positions == "t5":
            positive("rel_buckets")
            positive("rel_max_distance")
            if self.rel_buckets < 4:
                fail(f"rel_buckets={self.rel_buckets} must be >= 4 (half per direction, half of that exact)")
        if self.tied_output_scale and not self.tie_output:
            fail("tied_output_scale=True rescales a tied output projection; it needs tie_output=True")
        if self.image_size:
            positive("image_size")
            positive("patch_size")
            positive("n_channels")
            if self.family != "encoder-only":
                fail(f"image_size (a ViT patch embedding) needs family='encoder-only', not {self.family!r}")
            if self.image_size % self.patch_size:
                fail(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
            if self.pooling == "last":
                fail("pooling='last' is for text; an image model pools 'cls' or 'mean'")
        elif self.image_size < 0:
            fail(f"image_size={self.image_size} must be >= 0 (0: a text model)")
        if self.n_classes < 0:
            fail(f"n_classes={self.n_classes} must be >= 0")
        if self.n_classes and self.family != "encoder-only":
            fail(f"n_classes (a classification head) needs family='encoder-only', not {self.family!r}")
        if self.type_vocab_size < 0:
            fail(f"type_vocab_size={self.type_vocab_size} must be >= 0")
        for name in ("pad_id", "bos_id", "eos_id", "unk_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                fail(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")
            if self.family == "encoder-decoder" and not value < self.target_vocab_size:
                fail(f"{name}={value} is outside the target vocabulary [0, {self.target_vocab_size})")

    # -- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> "TransformerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}; "
                              f"known fields are {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> "TransformerConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object of config fields")
        return cls.from_dict(data, source=str(path))

    def replace(self, **changes: Any) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)

    def rule_of_thumb_params(self) -> int:
        """12·L·d² per layer (4d² attention + 8d² FFN with d_ff=4d); decoder layers get 4d² more
        for cross-attention. Embeddings are not included."""
        d2 = self.d_model ** 2
        n = 0
        if self.has_encoder:
            n += self.n_encoder_layers * 12 * d2
        if self.has_decoder:
            n += self.n_decoder_layers * (16 if self.family == "encoder-decoder" else 12) * d2
        return n


# Named presets. Small ones are CPU friendly; "paper-*" are Table 3 of the paper.
PRESETS: dict[str, dict[str, Any]] = {
    "paper-base": dict(family="encoder-decoder", vocab_size=37000, d_model=512, n_heads=8,
                       n_encoder_layers=6, n_decoder_layers=6, d_ff=2048, dropout=0.1),
    "paper-big": dict(family="encoder-decoder", vocab_size=37000, d_model=1024, n_heads=16,
                      n_encoder_layers=6, n_decoder_layers=6, d_ff=4096, dropout=0.3),
    # CPU-sized encoder-decoder for translation (the demo's shape).
    "mt-small": dict(family="encoder-decoder", vocab_size=8000, d_model=256, n_heads=4,
                     n_encoder_layers=3, n_decoder_layers=3, d_ff=1024, dropout=0.1,
                     norm_placement="pre"),
    "mt-tiny": dict(family="encoder-decoder", vocab_size=1000, d_model=64, n_heads=4,
                    n_encoder_layers=2, n_decoder_layers=2, d_ff=256, dropout=0.1),
    # GPT-2 style decoder-only.
    "gpt-mini": dict(family="decoder-only", vocab_size=8000, d_model=256, n_heads=4,
                     n_decoder_layers=4, d_ff=1024, dropout=0.1, norm_placement="pre",
                     activation="gelu", positions="learned", max_len=512, embed_scale=False,
                     init="normal"),
    # nanoGPT's Tiny Shakespeare character model (vocab set from the data at train time).
    "shakespeare-char": dict(family="decoder-only", vocab_size=65, d_model=128, n_heads=4,
                             n_decoder_layers=4, d_ff=512, dropout=0.0, norm_placement="pre",
                             activation="gelu", positions="learned", max_len=64,
                             embed_scale=False, init="normal", bias=False, pad_id=0, bos_id=0,
                             eos_id=0, unk_id=0),
    # Llama style: RoPE + RMSNorm + SwiGLU + grouped-query attention, no biases.
    "llama-mini": dict(family="decoder-only", vocab_size=8000, d_model=256, n_heads=8,
                       n_kv_heads=2, n_decoder_layers=4, d_ff=688, dropout=0.0,
                       norm="rmsnorm", norm_placement="pre", activation="swiglu",
                       positions="rope", embed_scale=False, bias=False, init="normal"),
    # T5 (v1.1 layout) at the demo's size: relative position buckets, RMS norm without bias,
    # gated-GELU FFN (d_ff = 2/3 · 1024 keeps mt-small's parameter count), T5 init. Two of T5's
    # factors are *stored* the paper's way, the same function: the embedding /√d with ×√d on the
    # way in and no output rescale (T5: std 1, d^-0.5 before the tied output), and W_q ×√d_k with
    # scores /√d_k (T5: 1/√d_k folded into W_q's init). AdamW takes steps of one size for every
    # weight, so T5's std-1 embedding and tiny W_q learn ~16× too slowly and ~8× too fast; T5's
    # Adafactor scaled each step by the weight's size instead. Dev BLEU after 400 updates: 14.1
    # this way, 5.9 with only the embedding rescaled, 4.0 stored as T5 (mt-small: 12.4;
    # docs/results.md). to_hf writes T5's own storage.
    "t5-mini": dict(family="encoder-decoder", vocab_size=8000, d_model=256, n_heads=4,
                    n_encoder_layers=3, n_decoder_layers=3, d_ff=672, dropout=0.1, norm="rmsnorm",
                    norm_eps=1e-6, norm_placement="pre", activation="geglu_tanh", positions="t5",
                    attention_scale=True, embed_scale=True, tie_output=True, tied_output_scale=False,
                    bias=False, init="t5"),
    # ViT at MNIST size (28×28 grey, 4×4 patches = 49 tokens + [CLS]), 206k parameters. Narrow and
    # deep enough: on 2 CPU cores d_model 64 makes ~50 epochs of 8,000 digits in 9 minutes, where
    # d_model 128 (805k) makes ~20 and ends lower (dev split, docs/results.md). Mean pooling over
    # the patches (the [CLS] token is kept, as ViT; pooling="cls" reads it instead).
    "vit-mnist": dict(family="encoder-only", vocab_size=1, image_size=28, patch_size=4, n_channels=1,
                      d_model=64, n_heads=4, n_encoder_layers=6, d_ff=128, dropout=0.0,
                      activation="gelu", norm_placement="pre", norm_eps=1e-6, positions="learned",
                      max_len=50, embed_scale=False, tie_output=False, init="normal", n_classes=10,
                      pooling="mean", pad_id=0, bos_id=0, eos_id=0, unk_id=0),
    # BERT style encoder.
    "bert-mini": dict(family="encoder-only", vocab_size=8000, d_model=256, n_heads=4,
                      n_encoder_layers=4, d_ff=1024, dropout=0.1, activation="gelu",
                      positions="learned", max_len=512, embed_scale=False, embedding_norm=True,
                      norm_eps=1e-12, type_vocab_size=2, init="normal"),
}


def get_preset(name: str, **overrides: Any) -> TransformerConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return TransformerConfig(**{**PRESETS[name], "name": name, **overrides})


def load_config(spec: str | Path, **overrides: Any) -> TransformerConfig:
    """A preset name, a config.json, or a model directory holding a config.json."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ConfigError(f"{path}: no such config file")
        cfg = TransformerConfig.from_json(path)
        return cfg.replace(**overrides) if overrides else cfg
    return get_preset(str(spec), **overrides)


__all__ = ["TransformerConfig", "ConfigError", "PRESETS", "get_preset", "load_config"]
