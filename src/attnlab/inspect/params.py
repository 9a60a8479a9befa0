"""A per-module parameter table, with the 12·L·d² rule of thumb beside the exact count."""

from __future__ import annotations

import re
from collections import OrderedDict

from torch import nn

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _group(name: str) -> tuple[str, int | None]:
    """'encoder.layers.3.self_attn.qkv_proj.weight' → ('encoder.layers.*.self_attn', 3)."""
    m = _LAYER.search(name)
    if m:
        stack = name[: m.start()]
        rest = name[m.end():].split(".")
        sub = rest[0] if not rest[0].endswith("_residual") else rest[0] + " (norm)"
        return f"{stack}.layers.*.{sub}", int(m.group(1))
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0], None


def parameter_rows(model: nn.Module) -> list[tuple[str, int, int]]:
    """(group, parameters per layer or in total, number of layers) in model order. Shared
    (tied) parameters are listed once, under the first module that owns them."""
    groups: "OrderedDict[str, dict]" = OrderedDict()
    for name, p in model.named_parameters():  # deduplicates tied parameters
        key, layer = _group(name)
        g = groups.setdefault(key, {"n": 0, "layers": set()})
        g["n"] += p.numel()
        if layer is not None:
            g["layers"].add(layer)
    rows = []
    for key, g in groups.items():
        n_layers = len(g["layers"]) or 1
        rows.append((key, g["n"] // n_layers, n_layers))
    return rows


def parameter_table(model: nn.Module) -> str:
    cfg = model.config
    rows = parameter_rows(model)
    total = sum(n * k for _, n, k in rows)
    width = max(len(r[0]) for r in rows) + 2
    out = [f"{'module':<{width}}{'per layer':>14}{'× layers':>10}{'params':>16}"]
    out.append("-" * len(out[0]))
    for key, n, k in rows:
        per = f"{n:,}" if k > 1 else ""
        out.append(f"{key:<{width}}{per:>14}{(str(k) if k > 1 else ''):>10}{n * k:>16,}")
    tied = []
    if cfg.tie_output:
        tied.append("output projection = decoder input embedding")
    if cfg.family == "encoder-decoder" and cfg.share_embeddings:
        tied.append("encoder embedding = decoder embedding")
    out.append("-" * len(out[0]))
    out.append(f"{'total':<{width}}{'':>24}{total:>16,}  ({total / 1e6:.2f}M)")
    thumb = cfg.rule_of_thumb_params()
    emb = sum(p.numel() for n, p in model.named_parameters() if "embed" in n)
    out.append(f"{'rule of thumb 12·L·d² (+4d² cross)':<{width}}{'':>24}{thumb:>16,}  "
               f"(+ embeddings {emb:,} = {(thumb + emb) / 1e6:.2f}M)")
    if tied:
        out.append("shared: " + "; ".join(tied) + " (counted once)")
    return "\n".join(out)
