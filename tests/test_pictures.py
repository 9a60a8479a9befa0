"""The pictures a person reads: Chinese drawn as Chinese, a title clear of the plots, curves that
draw whatever a task's metrics.jsonl holds."""

import json
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib import font_manager  # noqa: E402
from matplotlib.ft2font import FT2Font  # noqa: E402
from matplotlib.image import imread  # noqa: E402

from attnlab.inspect import attention  # noqa: E402
from attnlab.inspect.attention import _attention_figure, cjk_font, plot_attention, plot_curves  # noqa: E402

SRC = ["▁I", "▁love", "▁this", "▁building", ".", "</s>"]
TGT = ["<s>", "▁我", "愛", "這", "棟", "樓", "。", "我們"]
TITLE = "I love this building. → 我愛這棟樓。"


def tiny_maps(layers: int, heads: int, src=SRC, tgt=TGT) -> dict:
    s, t = len(src), len(tgt)
    causal = torch.full((t, t), float("-inf")).triu(1)
    return {"encoder": [torch.randn(heads, s, s).softmax(-1) for _ in range(layers)],
            "decoder": [(torch.randn(heads, t, t) + causal).softmax(-1) for _ in range(layers)],
            "cross": [torch.randn(heads, t, s).softmax(-1) for _ in range(layers)],
            "src_tokens": list(src), "tgt_in_tokens": list(tgt)}


def is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def glyph_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "missing from font" in str(w.message)]


def test_cjk_font_draws_simplified_and_traditional_chinese():
    name = cjk_font()
    assert name, "no CJK font: paperang-p2-fonts-cjk should be installed with attnlab"
    assert cjk_font() is name  # cached
    path = font_manager.findfont(font_manager.FontProperties(family=name), fallback_to_default=False)
    charmap = FT2Font(path).get_charmap()
    assert all(ord(c) in charmap for c in "我愛樓們"), (name, path)


def test_plot_attention_draws_chinese_tokens(tmp_path):
    out = tmp_path / "attention.png"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plot_attention(tiny_maps(1, 2), str(out), TITLE) == str(out)
    assert is_png(out)
    assert glyph_warnings(caught) == []

    fig = _attention_figure(tiny_maps(1, 2), TITLE)
    try:
        labels = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
        assert "我們" in labels and "愛" in labels and "▁我" in labels
        assert not any("U+" in label for label in labels)
        assert cjk_font() in fig.axes[0].get_yticklabels()[0].get_fontfamily()
    finally:
        plt.close(fig)


def test_without_a_cjk_font_tokens_are_code_points(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "cjk_font", lambda: None)
    fig = _attention_figure(tiny_maps(1, 1), TITLE)
    try:
        labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
        assert "U+611B" in labels and "U+6211U+5011" in labels
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig.savefig(tmp_path / "a.png")
        assert glyph_warnings(caught) == []
    finally:
        plt.close(fig)


@pytest.mark.parametrize("n", [18, 19, 57])
def test_a_long_token_row_is_labelled_without_overlapping_labels(n):
    """Up to attention.MAX_TOKEN_LABELS tokens every one is labelled; past that every k-th from the first, and
    the labels drawn (6 pt) never cover one another, on either axis."""
    tgt = [f"t{i}" for i in range(n)]
    fig = _attention_figure(tiny_maps(1, 1, tgt=tgt), TITLE)
    try:
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[1]  # decoder self-attention: the target's tokens on both axes
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            shown = [t.get_text() for t in labels]
            step = 1 if n <= attention.MAX_TOKEN_LABELS else -(-n // attention.MAX_TOKEN_LABELS)
            assert shown == tgt[::step] and len(shown) <= attention.MAX_TOKEN_LABELS
            boxes = [t.get_window_extent(renderer) for t in labels]
            assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])), n
    finally:
        plt.close(fig)


@pytest.mark.parametrize("layers, heads, title", [
    (3, 4, TITLE), (1, 2, TITLE),
    (1, 2, "The committee will meet again next Tuesday to discuss the new building. → 委員會將於下週二再次開會討論新大樓。"),
])
def test_title_clear_of_every_plot(layers, heads, title):
    fig = _attention_figure(tiny_maps(layers, heads), title)
    try:
        renderer = fig.canvas.get_renderer()
        (suptitle,) = [t for t in fig.texts if t.get_text()]
        box = suptitle.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height  # not cut off
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer))
            assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_title()  # titles, tick labels too
    finally:
        plt.close(fig)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


TRAIN = [{"step": 50 * i, "train_loss": 9.0 / i + 2, "lr": 1e-3, "tokens_per_s": 9000, "elapsed": 5.0 * i}
         for i in range(1, 11)]
DEV = {
    "translate": [{"step": 100 * i, "dev_loss": 8.0 / i + 1.8, "dev_bleu": 4.0 * i, "dev_chrf": 6.0 * i,
                   "score": 4.0 * i, "elapsed": 10.0 * i} for i in range(1, 6)],
    "lm": [{"step": 100 * i, "val_loss": 5.0 - i / 3, "val_ppl": 2.7 ** (5.0 - i / 3), "score": 0, "tokens": 99}
           for i in range(1, 6)],
    "classify": [{"step": 100 * i, "dev_accuracy": 0.5 + i / 20, "dev_macro_f1": 0.4 + i / 20, "score": 0}
                 for i in range(1, 6)],
    "mlm": [{"step": 100 * i, "dev_mlm_loss": 6.0 - i / 2, "dev_mlm_accuracy": i / 10, "dev_mlm_ppl": 50.0 / i,
             "score": 0, "tokens": 99} for i in range(1, 6)],
}


@pytest.mark.parametrize("task", sorted(DEV))
def test_plot_curves_with_dev_rows(tmp_path, task):
    rows = sorted(TRAIN + DEV[task], key=lambda r: r["step"])
    out = plot_curves(write_jsonl(tmp_path / "metrics.jsonl", rows), str(tmp_path / "curves.png"))
    assert is_png(out)
    assert imread(out).shape[1] > 1000  # two panels: losses, and the dev scores or perplexity


@pytest.mark.parametrize("rows", [TRAIN, [], TRAIN + ["not a row"]], ids=["train-only", "empty", "odd-line"])
def test_plot_curves_without_dev_rows(tmp_path, rows):
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write('\n{"step": 550, "train_lo')  # a blank line and a line cut short by a stopped run
    out = plot_curves(str(path), str(tmp_path / "curves.png"))
    assert is_png(out)
    assert imread(out).shape[1] < 1000  # one panel
