"""Attention maps as pictures: encoder self-, decoder self- and cross-attention, per layer and head."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..model.attention import MultiHeadAttention


@contextmanager
def record_attention(model):
    """Within the block, every attention module keeps its last weights (explicit path)."""
    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    for m in modules:
        m.record_weights = True
    try:
        yield modules
    finally:
        for m in modules:
            m.record_weights = False
            m.last_weights = None


@torch.no_grad()
def attention_maps(model, src_tok, tgt_tok, sentence: str, translation_ids: list[int]) -> dict:
    """Teacher-force the given translation and collect every attention map (batch of one)."""
    device = model.device
    src = torch.tensor([src_tok.encode(sentence, eos=True)], device=device)
    tgt = torch.tensor([[model.config.bos_id] + translation_ids], device=device)
    with record_attention(model):
        model(src, tgt)
        maps = {"encoder": [l.self_attn.last_weights[0].float().cpu() for l in model.encoder.layers],
                "decoder": [l.self_attn.last_weights[0].float().cpu() for l in model.decoder.layers],
                "cross": [l.cross_attn.last_weights[0].float().cpu() for l in model.decoder.layers]}
    maps["src_tokens"] = [src_tok.id_to_token(i) for i in src[0].tolist()]
    maps["tgt_in_tokens"] = [tgt_tok.id_to_token(i) for i in tgt[0].tolist()]
    return maps


def plot_attention(maps: dict, out: str, title: str = "") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import font_manager

    # A CJK-capable font if the system has one, so Chinese tokens are drawn, not boxes; without
    # one, such tokens are labelled by their code points (install e.g. fonts-noto-cjk).
    cjk_font = next((name for name in ("Noto Sans CJK SC", "Noto Sans CJK JP", "WenQuanYi Zen Hei", "SimHei",
                                       "Droid Sans Fallback", "AR PL UMing CN")
                     if any(f.name == name for f in font_manager.fontManager.ttflist)), None)
    if cjk_font:
        plt.rcParams["font.family"] = [cjk_font, "DejaVu Sans"]
    else:
        maps = {**maps, **{k: [_drawable(t) for t in maps[k]] for k in ("src_tokens", "tgt_in_tokens")}}
        title = _drawable(title)
    kinds = [("encoder", "encoder self-attention", "src_tokens", "src_tokens"),
             ("decoder", "decoder self-attention (causal)", "tgt_in_tokens", "tgt_in_tokens"),
             ("cross", "cross-attention (decoder → encoder)", "tgt_in_tokens", "src_tokens")]
    n_layers = len(maps["encoder"])
    n_heads = maps["encoder"][0].shape[0]
    fig, axes = plt.subplots(3 * n_layers, n_heads, figsize=(2.6 * n_heads, 2.6 * 3 * n_layers), squeeze=False)
    for k, (key, label, ylab, xlab) in enumerate(kinds):
        for layer in range(n_layers):
            for h in range(n_heads):
                ax = axes[k * n_layers + layer, h]
                ax.imshow(maps[key][layer][h].numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
                ax.set_xticks(range(len(maps[xlab])))
                ax.set_xticklabels(maps[xlab], rotation=90, fontsize=6)
                ax.set_yticks(range(len(maps[ylab])))
                ax.set_yticklabels(maps[ylab], fontsize=6)
                ax.set_title(f"{label}\nlayer {layer} head {h}", fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _drawable(text: str) -> str:
    """Replace characters DejaVu Sans cannot draw (CJK) by U+XXXX codes."""
    return "".join(c if ord(c) < 0x2E80 else f"U+{ord(c):04X}" for c in text)


def plot_curves(metrics_path: str, out: str) -> str:
    """Training loss and dev loss/BLEU against steps, from metrics.jsonl."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(l) for l in open(metrics_path, encoding="utf-8") if l.strip()]
    train = [r for r in rows if "train_loss" in r]
    dev = [r for r in rows if "dev_bleu" in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot([r["step"] for r in train], [r["train_loss"] for r in train], label="train (label-smoothed)")
    if dev:
        ax[0].plot([r["step"] for r in dev], [r["dev_loss"] for r in dev], "o-", label="dev")
        ax[1].plot([r["step"] for r in dev], [r["dev_bleu"] for r in dev], "o-", label="dev BLEU")
        ax[1].plot([r["step"] for r in dev], [r["dev_chrf"] for r in dev], "s--", label="dev chrF")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("cross-entropy"); ax[0].legend()
    ax[1].set_xlabel("step"); ax[1].set_ylabel("score"); ax[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
