"""Token embeddings and every kind of position information.

The Transformer has no recurrence and no convolution, so self-attention alone cannot tell order:
without positions it is *permutation-equivariant* (shuffle the tokens, the outputs shuffle the same
way). Positions are therefore injected in one of two ways:

* **added to the input** (the paper): sinusoidal (fixed) or learned (trainable table);
* **inside attention**: RoPE rotates queries and keys by an angle proportional to the position;
  ALiBi adds a distance penalty to the attention scores; T5 adds a *learned* bias per head and per
  bucket of relative distance. All three extrapolate to unseen lengths better.

Images become tokens the same way words do (ViT): a patch embedding cuts the image into p×p patches
and projects each to d_model; a learned [CLS] token is prepended and learned positions are added.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TokenEmbedding(nn.Module):
    """A (vocab × d_model) lookup table, scaled by √d_model as in section 3.4 of the paper.

    Why the scale: the table is initialised with small values (std ≈ d^-0.5 under Xavier), while the
    sinusoidal signal has entries in [-1, 1]; ×√d brings the token signal to the same order so the
    positions do not drown it. The same matrix doubles as the output projection when tied.
    """

    def __init__(self, vocab_size: int, d_model: int, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.scale = math.sqrt(d_model) if scale else 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.weight)  # (B, T, d)
        return x * self.scale if self.scale != 1.0 else x


def sinusoidal_table(positions: torch.Tensor, d_model: int, layout: str = "interleaved") -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).

    The frequencies are computed in log space, exp(-2i·ln(10000)/d), which is exact and avoids
    the overflow-prone power. ``layout='split'`` puts all sines first and all cosines second
    (tensor2tensor, fairseq, Marian); it is a fixed permutation of the same features.
    Works for any position: there is no maximum length.
    """
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=positions.device)
                         * (-math.log(10000.0) / d_model))  # (d/2,)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (..., T, d/2)
    if layout == "split":
        return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (..., T, d)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # (..., T, d) sin,cos,sin,…


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoids *added* to the embeddings. No parameters, no maximum length.

    PE(pos+k) is a linear (rotation) function of PE(pos) for each frequency pair, which the paper
    hoped lets attention learn relative offsets. A table is cached and grown on demand.
    """

    def __init__(self, d_model: int, layout: str = "interleaved"):
        super().__init__()
        self.d_model = d_model
        self.layout = layout
        self.register_buffer("table", sinusoidal_table(torch.arange(512), d_model, layout),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: (T,) or (B, T) integer positions → (…, T, d_model)."""
        if torch.compiler.is_compiling():
            # a compiled decoding step: the sinusoids of its few positions, computed in the graph (the
            # table's growth check reads a value back: a graph break at every step)
            return sinusoidal_table(positions, self.d_model, self.layout)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.table.shape[0]:
            size = max(needed, 2 * self.table.shape[0])
            self.table = sinusoidal_table(torch.arange(size, device=self.table.device), self.d_model,
                                          self.layout)
        return self.table[positions]


class LearnedPositionalEmbedding(nn.Module):
    """A trainable (max_len × d_model) table (BERT, GPT-2). It cannot go past max_len."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # (not while torch.compile traces: the check reads a value back, a graph break per call)
        if not torch.compiler.is_compiling() and positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the learned position table "
                             f"(max_len={self.max_len}); use a shorter input or a model with "
                             "sinusoidal/RoPE/ALiBi positions")
        return F.embedding(positions, self.weight)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021): rotate each (x_i, x_{i+d/2}) pair of q and k by pos·θ_i.

    The dot product of a rotated query at position m and key at position n depends only on m-n, so
    attention sees relative positions while nothing is added to the residual stream. This uses the
    "rotate half" pairing of GPT-NeoX / Hugging Face Llama (first half paired with second half).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) or (B, T) → cos, sin of shape (1|B, 1, T, head_dim), ready to broadcast
        over heads."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # (…, T, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (…, T, hd)
        if emb.dim() == 2:
            emb = emb.unsqueeze(0)
        emb = emb.unsqueeze(1)  # (1|B, 1, T, hd)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, h, T, hd). Rotation in the dtype of x (cos/sin are fp32 and cast down)."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al. 2022): a geometric sequence 2^(-8/n · k), k = 1..n; for a
    head count that is not a power of two, the paper's interleaving of the next power's slopes."""
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_2(closest) + power_of_2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """-slope·|i - j| for query position i and key position j → (1|B, h, Tq, Tk) float bias.

    With a causal mask only j ≤ i survive, so this equals the paper's -slope·(i - j); the absolute
    value makes the same bias serve bidirectional (encoder) attention.
    """
    if q_pos.dim() == 1:
        q_pos, k_pos = q_pos.unsqueeze(0), k_pos.unsqueeze(0)
    dist = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).abs().to(torch.float32)  # (B, Tq, Tk)
    return -slopes.view(1, -1, 1, 1) * dist.unsqueeze(1)  # (B, h, Tq, Tk)


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative distance (key position - query position).

    Bidirectional (encoder): half of the buckets for keys before the query, half for keys after.
    Causal (decoder): only keys at or before the query exist, so every bucket serves the past.
    Within a direction, the first half of the buckets are exact distances 0, 1, 2, …; the second
    half cover max_exact … max_distance in log-spaced steps, and every farther distance shares the
    last bucket: nearby order matters precisely, far-away order only roughly.
    """
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).long() * num_buckets  # keys after the query: upper half
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # a future key (masked anyway) counts as distance 0
    max_exact = num_buckets // 2
    # log-spaced buckets: max_exact + log(d / max_exact) / log(max_distance / max_exact) · (rest)
    far = max_exact + (torch.log(distance.float().clamp(min=1) / max_exact)
                       / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, far)


class RelativePositionBias(nn.Module):
    """T5's relative positions: a learned (num_buckets × heads) table; the bias of query i, key j is
    the row of bucket(j - i), one value per head, added to the attention scores.

    One table per stack, computed once per forward and shared by all of the stack's layers (T5
    stores it in the first layer); cross-attention gets no bias.
    """

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, n_heads))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos (Tq,) or (B, Tq), k_pos (Tk,) or (B, Tk) → bias (1|B, h, Tq, Tk), fp32."""
        if q_pos.dim() == 1:
            q_pos, k_pos = q_pos.unsqueeze(0), k_pos.unsqueeze(0)
        relative = k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)  # (B, Tq, Tk): key - query
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).permute(0, 3, 1, 2)  # (B, Tq, Tk, h) → (B, h, Tq, Tk)


class PatchEmbedding(nn.Module):
    """ViT's input (Dosovitskiy et al. 2021): image (B, C, H, W) → tokens (B, 1 + N, d).

    A convolution with kernel = stride = patch size is exactly "cut into p×p patches, flatten each,
    multiply by one (C·p·p × d) matrix". A learned [CLS] token is prepended (the classifier reads
    its final state) and learned positions — one per patch, in raster order — are added.
    """

    def __init__(self, image_size: int, patch_size: int, n_channels: int, d_model: int,
                 learned_positions: bool = True):
        super().__init__()
        self.image_size, self.patch_size, self.n_channels = image_size, patch_size, n_channels
        self.n_patches = (image_size // patch_size) ** 2
        self.proj = nn.Conv2d(n_channels, d_model, kernel_size=patch_size, stride=patch_size)
        self.cls = nn.Parameter(torch.empty(1, 1, d_model))
        nn.init.normal_(self.cls, std=0.02)
        self.position = LearnedPositionalEmbedding(self.n_patches + 1, d_model) if learned_positions else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        want = (self.n_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != want:
            raise ValueError(f"expected images of shape (batch, {', '.join(map(str, want))}), "
                             f"got {tuple(images.shape)}")
        x = self.proj(images.to(self.proj.weight.dtype))  # (B, d, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)  # (B, N, d): patches in raster order
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, 1+N, d)
        if self.position is not None:
            x = x + self.position(torch.arange(x.shape[1], device=x.device)).to(x.dtype)
        return x
