"""Accuracy, macro-F1 and the confusion matrix (as text and as a picture)."""

from __future__ import annotations


def classification_scores(gold: list[int], pred: list[int], n_classes: int) -> dict:
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold labels but {len(pred)} predictions")
    confusion = [[0] * n_classes for _ in range(n_classes)]  # rows: gold, columns: predicted
    for g, p in zip(gold, pred):
        confusion[g][p] += 1
    f1s = []
    for c in range(n_classes):
        tp = confusion[c][c]
        fp = sum(confusion[r][c] for r in range(n_classes)) - tp
        fn = sum(confusion[c]) - tp
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    acc = sum(confusion[c][c] for c in range(n_classes)) / max(len(gold), 1)
    return {"accuracy": round(acc, 4), "macro_f1": round(sum(f1s) / n_classes, 4), "n": len(gold),
            "confusion": confusion, "f1_per_class": [round(f, 4) for f in f1s]}


def confusion_text(confusion: list[list[int]], labels: list[str]) -> str:
    w = max(7, *(len(str(l)) for l in labels)) + 2
    lines = ["gold \\ predicted".ljust(w + 4) + "".join(str(l).rjust(w) for l in labels)]
    for l, row in zip(labels, confusion):
        lines.append(str(l).ljust(w + 4) + "".join(str(v).rjust(w) for v in row))
    return "\n".join(lines)


def plot_confusion(confusion: list[list[int]], labels: list[str], out: str, title: str = "") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.2 * len(labels) + 2.5, 1.2 * len(labels) + 2))
    ax.imshow(confusion, cmap="Blues")
    for i, row in enumerate(confusion):
        for j, v in enumerate(row):
            ax.text(j, i, str(v), ha="center", va="center", color="black")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
