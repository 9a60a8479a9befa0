"""Attention maps as pictures: encoder self-, decoder self- and cross-attention, per layer and head;
for a ViT, where the [CLS] token looks over the image (each layer's own attention and its rollout)."""

from __future__ import annotations

import functools
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


# -- images (ViT): where the [CLS] token looks ----------------------------------------------------------


def attention_rollout(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Attention rollout (Abnar & Zuidema 2020): how much each input token flows into each position,
    layer after layer, for a stack of self-attention layers.

    One layer's raw weights say where a position looks *in that layer's input*, which after the first
    layer is already a mix of tokens. Rollout follows the mixing down to the inputs: each layer's
    weights are averaged over heads, the residual connection is accounted for by adding the identity
    (the token keeps itself half: Â = ½·A + ½·I), rows are renormalised to sum to 1, and the layers
    are multiplied, R_l = Â_l · R_{l−1} (R_0 = I).

    weights: per layer (h, T, T) or (B, h, T, T) (rows: queries, columns: keys). Returns R_l for
    every layer l (the rollout *up to* that layer), each (T, T) or (B, T, T), rows summing to 1.
    """
    rollouts = []
    r = None
    for w in weights:
        a = w.float().mean(dim=-3)  # average the heads: (…, T, T)
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = 0.5 * a + 0.5 * eye
        a = a / a.sum(dim=-1, keepdim=True)
        r = a if r is None else a @ r
        rollouts.append(r)
    return rollouts


def cls_patch_map(attention: torch.Tensor, grid: int, pooling: str = "cls") -> torch.Tensor:
    """Row 0 ([CLS], as the query) of a (T, T) attention or rollout matrix over the T − 1 = grid² patch
    keys, as the (grid, grid) picture of where the [CLS] token looks (patches in raster order).
    ``pooling="mean"``: the classifier reads the mean of the patches' outputs, so the row drawn is
    the mean of the patch rows — where the pooled representation looks."""
    rows = attention[..., 0, 1:] if pooling == "cls" else attention[..., 1:, 1:].mean(dim=-2)
    return rows.reshape(*attention.shape[:-2], grid, grid)


@torch.no_grad()
def image_attention_maps(model, image: torch.Tensor) -> dict:
    """For one normalised image (1, C, H, W) of a ViT: the logits, every layer's raw [CLS]→patch
    attention (heads averaged) and the rollout up to every layer, as (H/p, W/p) maps."""
    grid, pooling = model.config.image_size // model.config.patch_size, model.config.pooling
    with record_attention(model):
        logits = model.classify(image)
        weights = [l.self_attn.last_weights[0].float().cpu() for l in model.encoder.layers]  # (h, T, T) each
    return {"logits": logits[0].float().cpu(), "pooling": pooling,
            "layers": [cls_patch_map(w.mean(0), grid, pooling) for w in weights],
            "rollout": [cls_patch_map(r, grid, pooling) for r in attention_rollout(weights)]}


def plot_image_attention(maps: dict, pixels: torch.Tensor, out: str, title: str = "") -> str:
    """Where the [CLS] token looks, drawn over the image as one PNG at *out*: the top row is the
    image, then the rollout up to each layer; the bottom row each layer's own [CLS]→patch attention.
    ``pixels``: uint8 (C, H, W). Each map is scaled to its own maximum (the patterns, not the sizes,
    are what compare across layers). Returns *out*."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = pixels.permute(1, 2, 0).numpy()
    grey = img.shape[2] == 1
    img = img[:, :, 0] if grey else img
    h, w = img.shape[:2]
    n = len(maps["layers"])
    rows = (("rollout", "rollout to layer"), ("layers", "layer"))
    fig, axes = plt.subplots(2, n + 1, figsize=(1.9 * (n + 1), 4.9), squeeze=False)
    for r, (key, label) in enumerate(rows):
        ax = axes[r, 0]
        if r == 0:
            ax.imshow(img, cmap="gray" if grey else None, vmin=0, vmax=255)
            ax.set_title("image", fontsize=8)
        ax.axis("off")
        for i, m in enumerate(maps[key]):
            ax = axes[r, i + 1]
            ax.imshow(img, cmap="gray" if grey else None, vmin=0, vmax=255)
            ax.imshow((m / m.max().clamp(min=1e-12)).numpy(), cmap="inferno", alpha=0.6, vmin=0, vmax=1,
                      extent=(-0.5, w - 0.5, h - 0.5, -0.5), interpolation="nearest")
            ax.set_title(f"{label} {i}", fontsize=8)
            ax.axis("off")
    query = "[CLS]" if maps.get("pooling", "cls") == "cls" else "mean of patches"
    axes[1, 0].text(0.5, 0.5, f"each layer's own\n{query} → patches\n(heads averaged)", ha="center", va="center",
                    fontsize=8, transform=axes[1, 0].transAxes)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95 if title else 1), h_pad=1.5)
    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out



# Fonts with Chinese (Simplified and Traditional) glyphs, in order of preference, if the system has one.
_SYSTEM_CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK TC", "Noto Sans SC",
                     "WenQuanYi Zen Hei", "WenQuanYi Micro Hei", "SimHei", "Droid Sans Fallback",
                     "AR PL UMing CN", "PingFang SC", "Microsoft YaHei")


def _packaged_cjk_font_file() -> str | None:
    """WenQuanYi Micro Hei as shipped by the paperang-p2-fonts-cjk package (found, not imported)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("paperang_p2_fonts_cjk")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "fonts" / "wqy-microhei.ttc"
        if path.is_file():
            return str(path)
    return None


@functools.cache
def cjk_font() -> str | None:
    """The family name of a font that draws Chinese, for matplotlib: a system font matplotlib already
    knows, else the packaged WenQuanYi Micro Hei (registered with matplotlib on first use), else None."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    known = {f.name for f in font_manager.fontManager.ttflist}
    system = next((name for name in _SYSTEM_CJK_FONTS if name in known), None)
    if system:
        return system
    path = _packaged_cjk_font_file()
    if path is None:
        return None
    try:
        font_manager.fontManager.addfont(path)
        return FT2Font(path).family_name
    except (OSError, RuntimeError, ValueError):
        return None


def _font_rc() -> dict:
    """rcParams under which every label is drawable: the CJK font first, DejaVu Sans for the rest."""
    font = cjk_font()
    return {"font.family": [font, "DejaVu Sans"]} if font else {}


def plot_attention(maps: dict, out: str, title: str = "") -> str:
    """Every attention map (per layer and head) as one PNG at *out*; returns *out*."""
    fig = _attention_figure(maps, title)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _attention_figure(maps: dict, title: str = ""):
    """The figure plot_attention saves: rows encoder / decoder / cross-attention per layer, a column
    per head, and the title above them all, clear of the top row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if cjk_font() is None:  # no font draws Chinese: label such tokens by their code points instead
        maps = {**maps, **{k: [_drawable(t) for t in maps[k]] for k in ("src_tokens", "tgt_in_tokens")}}
        title = _drawable(title)
    kinds = [("encoder", "encoder self-attention", "src_tokens", "src_tokens"),
             ("decoder", "decoder self-attention (causal)", "tgt_in_tokens", "tgt_in_tokens"),
             ("cross", "cross-attention (decoder → encoder)", "tgt_in_tokens", "src_tokens")]
    n_layers = len(maps["encoder"])
    n_heads = maps["encoder"][0].shape[0]
    with plt.rc_context(_font_rc()):
        fig, axes = plt.subplots(3 * n_layers, n_heads, figsize=(2.6 * n_heads, 2.6 * 3 * n_layers),
                                 squeeze=False)
        for k, (key, label, ylab, xlab) in enumerate(kinds):
            xs, ys = _labelled(maps[xlab]), _labelled(maps[ylab])  # (the same for every panel of a kind)
            xlabels, ylabels = [maps[xlab][i] for i in xs], [maps[ylab][i] for i in ys]
            for layer in range(n_layers):
                for h in range(n_heads):
                    ax = axes[k * n_layers + layer, h]
                    ax.imshow(maps[key][layer][h].float().numpy(), cmap="viridis", vmin=0, vmax=1,
                              aspect="auto")
                    ax.set_xticks(xs)
                    ax.set_xticklabels(xlabels, rotation=90, fontsize=6)
                    # the heads of a row share its query tokens: labelled once, in the first column
                    # (a label per head made a long translation's picture ~2x slower to lay out and draw)
                    ax.set_yticks(ys)
                    ax.set_yticklabels(ylabels if h == 0 else [], fontsize=6)
                    ax.set_title(f"{label}\nlayer {layer} head {h}", fontsize=7)
        top = 1.0
        if title:
            top = _suptitle_room(fig, title)
        fig.tight_layout(rect=(0, 0, 1, top))
    return fig


# Tick labels a panel holds at 6 pt without their boxes overlapping (its plot is ~1.5 inches tall once its title
# and the labels are laid out: 18 labels, a label every ~6 pt)
MAX_TOKEN_LABELS = 18


def _labelled(tokens: list[str]) -> range:
    """The positions whose tokens a panel labels: every one up to MAX_TOKEN_LABELS, else every k-th from the
    first, k the smallest step that keeps them at most MAX_TOKEN_LABELS. Past that, labels 6 pt tall sat on top
    of each other (57 tokens: one every ~2.6 pt, unreadable), and laying them out was most of the picture's time
    (an untrained model's 57-token output: 10-12 s for the figure on a 2-core AVX2 EPYC, ad hoc)."""
    return range(0, len(tokens), max(1, -(-len(tokens) // MAX_TOKEN_LABELS)))


def _suptitle_room(fig, title: str) -> float:
    """Put *title* above the subplots, fitted to the figure's width (broken before its '→', then
    made smaller if need be); returns the top of the rectangle left for the subplots (figure fraction)."""
    renderer = fig.canvas.get_renderer()
    # At a fixed distance from the top edge (the default y=0.98 is a fraction of the height, far down a
    # tall figure), and out of tight_layout's own accounting, which the rectangle returned here replaces.
    text = fig.suptitle(title, y=1 - 0.06 / fig.get_figheight(), va="top", in_layout=False)
    room = 0.96 * fig.bbox.width
    if text.get_window_extent(renderer).width > room and " → " in title:
        text.set_text(title.replace(" → ", "\n→ ", 1))
    width = text.get_window_extent(renderer).width
    if width > room:
        text.set_fontsize(max(6.0, text.get_fontsize() * room / width))
    bottom = text.get_window_extent(renderer).y0  # pixels from the figure's bottom
    gap = 0.2 * text.get_fontsize() * fig.dpi / 72  # tight_layout adds its own padding below it
    return max(0.5, (bottom - gap) / fig.bbox.height)


def _drawable(text: str) -> str:
    """Replace characters DejaVu Sans cannot draw (CJK) by U+XXXX codes."""
    return "".join(c if ord(c) < 0x2E80 else f"U+{ord(c):04X}" for c in text)


# metrics.jsonl keys, per task: losses on the left panel, dev scores (or perplexities) on the right.
_DEV_LOSSES = (("dev_loss", "dev"), ("val_loss", "validation"), ("dev_mlm_loss", "dev (masked tokens)"))
_DEV_SCORES = (("dev_bleu", "dev BLEU"), ("dev_chrf", "dev chrF"), ("dev_accuracy", "dev accuracy"),
               ("dev_macro_f1", "dev macro-F1"), ("dev_mlm_accuracy", "dev masked-token accuracy"))
_DEV_PERPLEXITIES = (("val_ppl", "validation perplexity"), ("dev_mlm_ppl", "dev masked-token perplexity"))


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the rows that have a finite number under *key*."""
    import math
    points = [(r["step"], r[key]) for r in rows
              if isinstance(r.get("step"), (int, float)) and isinstance(r.get(key), (int, float))
              and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def plot_curves(metrics_path: str, out: str) -> str:
    """Training curves from metrics.jsonl as one PNG at *out*: train and dev loss on the left, the dev
    scores on the right (BLEU and chrF for translation; accuracy, perplexity for the other tasks), each
    dev curve labelled with its last value. Works for a file with no dev rows, or no rows at all."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, right, right_title = _curve_series(_metric_rows(metrics_path))
    with plt.rc_context(_font_rc()):
        fig, axes = plt.subplots(1, 2 if right else 1, figsize=(11, 4.2) if right else (6.5, 4.2),
                                 squeeze=False, sharex=True)
        ax = axes[0, 0]
        for i, (key, label, steps, values) in enumerate(losses):
            if key == "train_loss":
                ax.plot(steps, values, "-", lw=1.4, color="C0", label=label)
            else:
                ax.plot(steps, values, "o-", ms=4, color=f"C{i}", label=label)
                _label_last(ax, steps, values, f"C{i}")
        ax.set_title("Loss")
        ax.set_ylabel("cross-entropy (nats)")
        if right:
            ax2 = axes[0, 1]
            for i, (key, label, steps, values) in enumerate(right):
                ax2.plot(steps, values, ("o-", "s--", "^-", "d--", "v-")[i % 5], ms=4, color=f"C{i + 2}",
                         label=label)
                _label_last(ax2, steps, values, f"C{i + 2}")
            ax2.set_title(right_title)
            ax2.set_ylabel("perplexity" if right_title == "Perplexity" else "score")
        for a in axes[0]:
            a.set_xlabel("updates")
            a.grid(True, color="0.85", lw=0.6)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
        last = max((max(s[2]) for s in losses + right if s[2]), default=0)
        if last > 0:  # from 0 to a little past the last update, room for the last values' labels
            ax.set_xlim(0, last * 1.1)
        if not losses:
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, "no training metrics yet", transform=ax.transAxes, ha="center", va="center",
                    color="0.4")
        fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _metric_rows(metrics_path: str) -> list[dict]:
    import json
    rows = []
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # blank, or a line cut short by a run that was stopped
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _curve_series(rows: list[dict]):
    """(loss series, right-panel series, right-panel title): each series (key, label, steps, values)."""
    losses = [("train_loss", "train (as optimised)", *_series(rows, "train_loss"))]
    losses = [s for s in losses + [(key, label, *_series(rows, key)) for key, label in _DEV_LOSSES] if s[2]]
    right = [s for s in ((key, label, *_series(rows, key)) for key, label in _DEV_SCORES) if s[2]]
    if right:
        return losses, right, "Dev scores"
    right = [s for s in ((key, label, *_series(rows, key)) for key, label in _DEV_PERPLEXITIES) if s[2]]
    return losses, right, "Perplexity"


def _label_last(ax, steps: list, values: list, color: str) -> None:
    """Write the last value beside the last point of a curve."""
    if steps:
        ax.annotate(f"{values[-1]:.4g}", (steps[-1], values[-1]), xytext=(5, 0), textcoords="offset points",
                    va="center", fontsize=8, color=color)
