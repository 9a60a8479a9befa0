"""The three families: ``EncoderDecoder`` (the paper), ``DecoderOnly`` (GPT, Llama) and
``EncoderOnly`` (BERT), built from one ``TransformerConfig``.

Data flow of the encoder-decoder (the paper's Figure 1):
source ids → embedding ×√d + positions → N encoder layers → memory H (B, S, d);
target prefix (the gold target shifted right during training: *teacher forcing*) → embedding +
positions → N decoder layers (causal self-attention, cross-attention over H, FFN) → linear output
projection → logits over the target vocabulary (softmax is left to the loss / the sampler).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch import nn

from ..config import TransformerConfig
from .attention import KVCache, Segment, causal_mask, padding_mask
from .embedding import (LearnedPositionalEmbedding, PatchEmbedding, RelativePositionBias, RotaryEmbedding,
                        SinusoidalPositionalEncoding, TokenEmbedding, alibi_bias, alibi_slopes)
from .layers import DecoderLayer, Dropout, EncoderLayer, make_norm


class Embeddings(nn.Module):
    """Token embedding (×√d_model) + added positions (+ token types) → (norm) → dropout.

    RoPE, ALiBi and T5's relative positions add nothing here: they act inside attention.
    """

    def __init__(self, cfg: TransformerConfig, token: TokenEmbedding):
        super().__init__()
        self.token = token
        self.position: nn.Module | None = None
        if cfg.positions == "sinusoidal":
            self.position = SinusoidalPositionalEncoding(cfg.d_model, cfg.sinusoidal_layout)
        elif cfg.positions == "learned":
            self.position = LearnedPositionalEmbedding(cfg.max_len, cfg.d_model)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = make_norm(cfg) if cfg.embedding_norm else None
        self.dropout = Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.token(ids)  # (B, T, d)
        if self.position is not None:
            x = x + self.position(positions).to(x.dtype)  # added, not concatenated
        if self.token_type is not None:
            x = x + self.token_type(token_type_ids if token_type_ids is not None else torch.zeros_like(ids))
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def _relative_bias(cfg: TransformerConfig, bidirectional: bool) -> RelativePositionBias | None:
    if cfg.positions != "t5":
        return None
    return RelativePositionBias(cfg.n_heads, cfg.rel_buckets, cfg.rel_max_distance, bidirectional)


class Encoder(nn.Module):
    """A stack of N encoder layers (+ the final norm of Pre-Norm models) (+ T5's bidirectional
    relative-position table, shared by its layers)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.relative_bias = _relative_bias(cfg, bidirectional=True)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.norm = make_norm(cfg) if cfg.has_final_norm else None

    def forward(self, x, mask=None, *, rope=None, bias=None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask, rope=rope, bias=bias)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    """A stack of N decoder layers (with or without cross-attention) (+ final norm) (+ T5's causal
    relative-position table)."""

    def __init__(self, cfg: TransformerConfig, cross_attention: bool):
        super().__init__()
        self.relative_bias = _relative_bias(cfg, bidirectional=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross_attention) for _ in range(cfg.n_decoder_layers))
        self.norm = make_norm(cfg) if cfg.has_final_norm else None

    def forward(self, x, memory=None, *, mask=None, is_causal=False, memory_mask=None, rope=None,
                bias=None, cache: "DecoderCache | None" = None,
                segments: "list[tuple[Segment, DecoderCache]] | None" = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            at_layer = None if segments is None else [dataclasses.replace(s, cache=c.layers[i][0]) for s, c in segments]
            x = layer(x, memory, mask=mask, is_causal=is_causal, memory_mask=memory_mask, rope=rope,
                      bias=bias, cache=cache.layers[i] if cache is not None else None, segments=at_layer)
        return self.norm(x) if self.norm is not None else x


class DecoderCache:
    """The KV cache of a whole decoder: per layer, a self-attention cache and (encoder-decoder)
    a cross-attention cache holding the encoder's K/V, computed once."""

    def __init__(self, n_layers: int, cross_attention: bool, capacity: int = 0):
        self.layers = [(KVCache(capacity), KVCache() if cross_attention else None)
                       for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0][0].length

    def reorder(self, index: torch.Tensor, cross: bool = False, start: int = 0) -> None:
        """Select batch rows (and self-attention positions ``start:``). Beam search reorders within
        each source's beams, where the cross-attention K/V are identical, so by default they are left
        untouched (no copy)."""
        for self_cache, cross_cache in self.layers:
            self_cache.reorder(index, start)
            if cross and cross_cache is not None:
                cross_cache.reorder(index)


class TransformerBase(nn.Module):
    """What all families share: config, positions inside attention, init, counting."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.rotary = (RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
                       if cfg.positions == "rope" else None)
        if cfg.positions == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(cfg.n_heads), persistent=False)
        else:
            self.alibi_slopes = None

    def _attention_positions(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype,
                             stack: nn.Module):
        """RoPE (cos, sin) for the queries/keys and the ALiBi or T5 bias of ``stack``'s self-attention,
        once per forward for all its layers. The angles are computed in fp32 and cast once to the
        activations' dtype (not once per layer)."""
        rope = tuple(t.to(dtype) for t in self.rotary(q_pos)) if self.rotary is not None else None
        bias = None
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes, q_pos, k_pos)
        elif stack.relative_bias is not None:
            bias = stack.relative_bias(q_pos, k_pos)
        return rope, bias

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection."""
        return self.lm_head(self.head_input(h))

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """What ``lm_head`` multiplies: the last hidden states, which T5 first rescales by d_model^-0.5
        (its tied embedding has std 1). Training takes it to fuse the projection with the loss
        (``train.tasks.base.output_loss``)."""
        return h * self.config.d_model ** -0.5 if self.config.tied_output_scale else h

    def _make_output_projection(self, vocab_size: int, tied: TokenEmbedding | None) -> nn.Linear:
        cfg = self.config
        head = nn.Linear(cfg.d_model, vocab_size, bias=cfg.output_bias)
        if cfg.output_bias:
            nn.init.zeros_(head.bias)
        if tied is not None:
            head.weight = tied.weight  # weight tying: one (V × d) matrix for input and output
        return head

    def reset_parameters(self) -> None:
        """Initialise weights by ``config.init``:

        * ``xavier`` (the Annotated Transformer, fairseq): Xavier-uniform linear layers, token
          embeddings N(0, d^-1/2) so that ×√d gives unit scale;
        * ``normal`` (GPT-2, BERT): N(0, init_std) everywhere, residual output projections scaled
          by 1/√(2·layers) so the residual stream's variance does not grow with depth;
        * ``t5`` (Mesh TensorFlow): every linear N(0, fan_in^-1/2), except the queries, which get a
          further 1/√d_k — T5 does not divide the scores by √d_k, the init does it once; token
          embeddings N(0, 1);
        * ``torch``: PyTorch's defaults.
        """
        cfg = self.config
        if cfg.init == "torch":
            return
        n_layers = max(cfg.n_encoder_layers if cfg.has_encoder else 0,
                       cfg.n_decoder_layers if cfg.has_decoder else 0)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                if cfg.init == "t5":
                    fan_in = module.weight[0].numel()
                    nn.init.normal_(module.weight, std=fan_in ** -0.5)
                    is_query = name.endswith("self_attn.qkv_proj") or name.endswith("cross_attn.q_proj")
                    if is_query and not cfg.attention_scale:  # scaled scores: the 1/√d_k is in the forward
                        q = module.weight[: cfg.n_heads * cfg.head_dim]
                        with torch.no_grad():
                            q.mul_(cfg.head_dim ** -0.5)
                elif cfg.init == "xavier":
                    nn.init.xavier_uniform_(module.weight)
                else:
                    std = cfg.init_std
                    if name.endswith(("out_proj", "w_out")):
                        std /= math.sqrt(2 * n_layers)
                    nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Embedding, LearnedPositionalEmbedding)):
                nn.init.normal_(module.weight, std=cfg.init_std)
            elif isinstance(module, RelativePositionBias):
                nn.init.normal_(module.weight, std=cfg.d_model ** -0.5 if cfg.init == "t5" else cfg.init_std)
        # Token embeddings last: a tied output projection shares their Parameter, and the Linear
        # init above must not be the one that sticks.
        # T5's embedding has std 1 (its input is not scaled; its tied output is scaled by d^-0.5). With
        # embed_scale the same function is stored /√d: std d^-0.5, ×√d in, no rescale out.
        t5_std = cfg.d_model ** -0.5 if cfg.embed_scale else 1.0
        token_std = {"xavier": cfg.d_model ** -0.5, "t5": t5_std}.get(cfg.init, cfg.init_std)
        for module in self.modules():
            if isinstance(module, TokenEmbedding):
                nn.init.normal_(module.weight, std=token_std)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Shared (tied) parameters are counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Evaluation mode (no dropout) inside the block; the model's previous mode after it."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def _key_positions(attention_mask: torch.Tensor | None, length: int, device) -> torch.Tensor:
    """Positions of all keys: 0..T-1, or counted over real tokens only for left-padded rows."""
    if attention_mask is None:
        return torch.arange(length, device=device)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)


def decoder_self_mask(key_is_token: torch.Tensor | None, T: int, past: int, device):
    """(mask, is_causal) for decoder self-attention over ``past`` cached + ``T`` new positions.

    Without padding the causal mask is left to the fused kernel (``is_causal``) when there is no
    cache, and is not needed at all for a single new position; otherwise it is built explicitly
    (shifted right by ``past``) and combined with the padding of the keys. Several new positions over
    padded keys (a training batch, a prefill) give the padding with ``is_causal``, which
    ``scaled_dot_product_attention`` combines into the same mask, and which tells ShortAttention's kernel
    that it may skip the hidden keys."""
    if key_is_token is not None:
        if T > 1:
            return padding_mask(key_is_token), True
        return padding_mask(key_is_token) & causal_mask(T, past + T, device), False
    if past and T > 1:
        return causal_mask(T, past + T, device), False
    causal = T > 1 and past == 0
    return None, True if causal else False  # a plain bool also where torch.compile traces sizes as symbols


class EncoderDecoder(TransformerBase):
    """The Transformer of the paper: encoder + decoder with cross-attention + output projection."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg)
        if cfg.family != "encoder-decoder":
            raise ValueError(f"EncoderDecoder needs family='encoder-decoder', got {cfg.family!r}")
        src_token = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.embed_scale)
        tgt_token = src_token if cfg.share_embeddings else TokenEmbedding(cfg.target_vocab_size, cfg.d_model,
                                                                         cfg.embed_scale)
        self.src_embed = Embeddings(cfg, src_token)
        self.tgt_embed = Embeddings(cfg, tgt_token)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg, cross_attention=True)
        self.lm_head = self._make_output_projection(cfg.target_vocab_size, tgt_token if cfg.tie_output else None)
        self.reset_parameters()

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """src (B, S) ids; src_mask (B, S) bool, True for real tokens → memory (B, S, d)."""
        pos = torch.arange(src.shape[1], device=src.device)
        x = self.src_embed(src, pos)
        rope, bias = self._attention_positions(pos, pos, x.dtype, self.encoder)
        mask = padding_mask(src_mask) if src_mask is not None else None
        return self.encoder(x, mask, rope=rope, bias=bias)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor | None = None,
               tgt_mask: torch.Tensor | None = None, cache: DecoderCache | None = None,
               last_only: bool = False, hidden_only: bool = False) -> torch.Tensor:
        """tgt (B, T) target prefix → logits (B, T, V) (or (B, V) with last_only; with hidden_only, the
        decoder's last hidden states (B, T, d) before the output projection).

        With a cache, ``tgt`` holds only the new positions and ``tgt_mask`` (if any) covers all
        positions so far; there, as in ``DecoderOnly.forward``, positions count real tokens only, so a
        left-padded row (a request that joined a running batch in ``attnlab serve``) computes what it
        computes alone. Teacher forcing (no cache) pads on the right: positions are 0..T-1."""
        past = cache.length if cache is not None else 0
        T = tgt.shape[1]
        k_pos = _key_positions(tgt_mask if cache is not None else None, past + T, tgt.device)
        pos = k_pos[..., past:]
        x = self.tgt_embed(tgt, pos)
        rope, bias = self._attention_positions(pos, k_pos, x.dtype, self.decoder)
        mask, is_causal = decoder_self_mask(tgt_mask, T, past, tgt.device)
        memory_mask = padding_mask(src_mask) if src_mask is not None else None
        h = self.decoder(x, memory, mask=mask, is_causal=is_causal, memory_mask=memory_mask,
                         rope=rope, bias=bias, cache=cache)
        h = h[:, -1] if last_only else h
        return h if hidden_only else self._logits(h)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor | None = None,
                tgt_mask: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        """Teacher forcing: all target positions in one pass; the causal mask keeps each position
        from seeing its future."""
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask, hidden_only=hidden_only)

    def new_cache(self, capacity: int = 0) -> DecoderCache:
        return DecoderCache(self.config.n_decoder_layers, cross_attention=True, capacity=capacity)


class DecoderOnly(TransformerBase):
    """A causal language model (GPT, Llama): decoder layers without cross-attention."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg)
        if cfg.family != "decoder-only":
            raise ValueError(f"DecoderOnly needs family='decoder-only', got {cfg.family!r}")
        token = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.embed_scale)
        self.embed = Embeddings(cfg, token)
        self.decoder = Decoder(cfg, cross_attention=False)
        self.lm_head = self._make_output_projection(cfg.vocab_size, token if cfg.tie_output else None)
        self.reset_parameters()

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache: DecoderCache | None = None,
                last_only: bool = False, hidden_only: bool = False) -> torch.Tensor:
        """ids (B, T) → logits (B, T, V) (with hidden_only: the last hidden states (B, T, d)).
        ``attention_mask`` (B, past+T) marks real tokens; with left padding, positions count real
        tokens only, so a padded row equals the prompt alone."""
        x, seg = self._embed_segment(ids, attention_mask, cache, positions)
        h = self.decoder(x, mask=seg.mask, is_causal=seg.is_causal, rope=seg.rope, bias=seg.bias, cache=cache)
        h = h[:, -1] if last_only else h
        return h if hidden_only else self._logits(h)

    def _embed_segment(self, ids, attention_mask, cache, positions=None) -> tuple[torch.Tensor, Segment]:
        """Embedded ids (B, T, d) and what their attention needs: mask, RoPE angles, bias. Positions
        follow the cache and, with left padding, count real tokens only."""
        past = cache.length if cache is not None else 0
        B, T = ids.shape
        k_pos = _key_positions(attention_mask, past + T, ids.device)
        if positions is None:
            positions = k_pos[..., past:]
        x = self.embed(ids, positions)
        rope, bias = self._attention_positions(positions, k_pos, x.dtype, self.decoder)
        mask, is_causal = decoder_self_mask(attention_mask, T, past, ids.device)
        return x, Segment(B, T, mask, is_causal, rope, bias)

    def forward_packed(self, groups: list[tuple[torch.Tensor, torch.Tensor | None, DecoderCache]]) -> list[torch.Tensor]:
        """Several ``forward(ids, attention_mask, cache=cache, last_only=True)`` in one pass → each
        group's last-position logits (B_g, V). Every linear layer runs once over the tokens of all
        groups, attention per group: the weights are streamed once for all of them, so a serving
        engine folds a newcomer's prompt into the running batch's step instead of stopping the batch
        for a prefill of its own (serve.engine)."""
        xs, segments = [], []
        for ids, attention_mask, cache in groups:
            x, seg = self._embed_segment(ids, attention_mask, cache)
            xs.append(x.reshape(seg.rows * seg.length, -1))
            segments.append((seg, cache))
        h = self.decoder(torch.cat(xs)[None], segments=segments)[0]  # (N, d)
        last, start = [], 0  # where each row's last token sits in the N packed tokens
        for s, _ in segments:
            last += range(start + s.length - 1, start + s.rows * s.length, s.length)
            start += s.rows * s.length
        logits = self._logits(h[torch.tensor(last, device=h.device)])  # (rows of all groups, V)
        return list(logits.split([s.rows for s, _ in segments]))

    def new_cache(self, capacity: int = 0) -> DecoderCache:
        return DecoderCache(self.config.n_decoder_layers, cross_attention=False, capacity=capacity)


class EncoderOnly(TransformerBase):
    """A bidirectional encoder (BERT): hidden states, a masked-LM head, pooling and an optional
    classification head. With ``config.image_size`` it reads images (ViT): the token embedding is
    replaced by a patch embedding, everything after it is the same encoder."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg)
        if cfg.family != "encoder-only":
            raise ValueError(f"EncoderOnly needs family='encoder-only', got {cfg.family!r}")
        if cfg.is_image_model:
            self.embed = PatchEmbedding(cfg.image_size, cfg.patch_size, cfg.n_channels, cfg.d_model,
                                        learned_positions=cfg.positions == "learned")
            self.embed_dropout = Dropout(cfg.dropout)
            self.lm_head = None  # nothing to predict per patch
        else:
            token = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.embed_scale)
            self.embed = Embeddings(cfg, token)
            self.lm_head = self._make_output_projection(cfg.vocab_size, token if cfg.tie_output else None)
        self.encoder = Encoder(cfg)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler_activation else None
        self.classifier = (nn.Sequential(Dropout(cfg.dropout), nn.Linear(cfg.d_model, cfg.n_classes))
                           if cfg.n_classes else None)
        self.reset_parameters()

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """ids (B, T) → hidden states (B, T, d); for an image model, images (B, C, H, W) → (B, 1+N, d)
        ([CLS] first, then the patches in raster order)."""
        if self.config.is_image_model:
            x = self.embed_dropout(self.embed(ids))
            pos = torch.arange(x.shape[1], device=x.device)
        else:
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.embed(ids, pos, token_type_ids)
        rope, bias = self._attention_positions(pos, pos, x.dtype, self.encoder)
        mask = padding_mask(attention_mask) if attention_mask is not None else None
        return self.encoder(x, mask, rope=rope, bias=bias)

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, d) → (B, d) by ``config.pooling``: the first ([CLS]) token, the mean over real
        tokens (padding excluded from the average), or the last real token."""
        how = self.config.pooling
        if how == "cls":
            pooled = hidden[:, 0]
        elif how == "mean" and self.config.is_image_model:
            pooled = hidden[:, 1:].mean(1)  # the patches, not the [CLS] token
        elif how == "mean":
            if attention_mask is None:
                pooled = hidden.mean(1)
            else:
                m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        else:
            last = (attention_mask.long().sum(1) - 1 if attention_mask is not None
                    else torch.full((hidden.shape[0],), hidden.shape[1] - 1, device=hidden.device))
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        return pooled

    def classify(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """→ class logits (B, n_classes)."""
        if self.classifier is None:
            raise ValueError("this model has no classification head (config.n_classes=0)")
        return self.classifier(self.pool(self(ids, attention_mask, token_type_ids), attention_mask))

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise ValueError("an image model has no masked-LM head")
        return self._logits(hidden)


MODEL_CLASSES = {"encoder-decoder": EncoderDecoder, "decoder-only": DecoderOnly, "encoder-only": EncoderOnly}


def build_model(cfg: TransformerConfig, init: bool = True) -> TransformerBase:
    """The model class for the config's family, freshly initialised. ``init=False`` skips the
    initialisation (the weights are uninitialised memory) for a caller that loads every weight next,
    as the loaders do: drawing 135M random numbers costs seconds and is thrown away."""
    if init:
        return MODEL_CLASSES[cfg.family](cfg)
    with _no_init():
        return MODEL_CLASSES[cfg.family](cfg)


@contextlib.contextmanager
def _no_init():
    names = ("uniform_", "normal_", "kaiming_uniform_", "xavier_uniform_", "zeros_", "ones_", "trunc_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)
