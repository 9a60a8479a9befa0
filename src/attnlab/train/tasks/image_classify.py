"""Image classification with a Vision Transformer: the encoder-only model reading pixels (ViT)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ...config import TransformerConfig, load_config
from ...data.images import DEFAULT_MEAN, DEFAULT_STD, as_pixels, normalize, random_shift, read_images, sorted_labels
from ...data.readers import DataError
from .base import DataPosition, ListBatches, Task

_SHIFT_SALT = 7  # keeps the augmentation's random numbers apart from other draws of the same step


class ShuffledBatches:
    """Batches of ``size`` indices in a new seeded order every epoch (the last one may be smaller):
    images all cost the same, so no token budget is needed. ``ListBatches`` walks them."""

    def __init__(self, n: int, size: int, seed: int):
        self.n, self.size, self.seed = n, size, seed

    def batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        return [perm[i: i + self.size] for i in range(0, self.n, self.size)]


class ImageClassificationTask(Task):
    """A ViT classifier on labelled images (a ``.npz`` or a folder of class folders, see
    ``data/images.py``). The preset gives the network; the image size, channels and number of classes
    come from the data. Pixels travel as uint8 and are normalised on the device (a quarter of the bytes)."""
    name = "image-classify"
    summary = "image classification with a ViT (a .npz of images/labels, or a folder of class folders)"
    family = "encoder-only"
    default_preset = "vit-mnist"
    default_label_smoothing = 0.0
    options = ("augment", "shift_pixels")

    def prepare(self, args, out: Path, log) -> None:
        self.args = args
        train = read_images(args.train)
        self.labels = sorted_labels(train.labels)
        if args.dev:
            dev = read_images(args.dev, known_labels=self.labels)
            if (dev.channels, dev.size) != (train.channels, train.size):
                raise DataError(f"{args.dev}: images are {_shape(dev)}, but {args.train}'s are {_shape(train)}")
        else:  # hold out a seeded share of the training images, as --task classify does
            g = torch.Generator().manual_seed(args.seed)
            perm = torch.randperm(len(train), generator=g).tolist()
            n_dev = max(1, int(len(perm) * args.val_fraction))
            if n_dev >= len(perm):
                raise DataError(f"{args.train}: {len(train)} image(s), too few to hold out a dev share; give --dev")
            dev, train = train.subset(sorted(perm[:n_dev])), train.subset(perm[n_dev:])
        h, w = train.size
        if h != w:
            raise DataError(f"{args.train}: images are {w}×{h} pixels; the ViT here reads square images")
        self.image_size, self.channels = h, train.channels
        self.mean, self.std = [DEFAULT_MEAN] * self.channels, [DEFAULT_STD] * self.channels
        index = {l: i for i, l in enumerate(self.labels)}
        self.train_x, self.train_y = train.images, torch.tensor([index[l] for l in train.labels])
        self.dev_x, self.dev_y = dev.images, [index[l] for l in dev.labels]
        self.batches = ListBatches(ShuffledBatches(len(train), args.batch_size, args.seed))
        aug = f", augment: shift by up to {args.shift_pixels} px" if args.augment == "shift" else ""
        log(f"image data: {len(train):,} train / {len(dev):,} dev images of {_shape(train)}, "
            f"{len(self.labels)} labels {self.labels[:12]}{' …' if len(self.labels) > 12 else ''}{aug}")

    @property
    def n_train(self) -> int:
        return len(self.train_y)

    def model_config(self, args) -> TransformerConfig:
        """The preset with the data's image size, channels and classes. The two sizes are also written
        into ``args.config_overrides``: training_args.json then describes the model that was built,
        and a resumed run's check of the preset sees a patch size that divides the image."""
        spec = args.preset or self.default_preset
        over = dict(args.config_overrides)
        base = load_config(spec)
        if base.family != self.family:
            raise DataError(f"--task {self.name} needs an encoder-only preset, {spec!r} is {base.family}")
        patch = over.get("patch_size", base.patch_size)
        s = self.image_size
        if not isinstance(patch, int) or patch < 1 or s % patch:
            fits = [p for p in range(2, s) if s % p == 0]
            raise DataError(f"{args.train}: images are {s}×{s} pixels, which patches of {patch}×{patch} "
                            f"(patch_size of {spec}) do not tile; use --set patch_size=P with P one of {fits or [1]}")
        args.config_overrides.update(image_size=s, n_channels=self.channels)
        cfg = load_config(spec, **{**over, "image_size": s, "n_channels": self.channels,
                                   "n_classes": len(self.labels), "max_len": 1 + (s // patch) ** 2})
        self.tokens_per_image = 1 + cfg.n_patches  # [CLS] + patches: what the log's tokens/s counts
        return cfg

    def artifacts(self) -> dict:
        return {"tokenizer": None, "task": {"task": "image-classify", "labels": self.labels,
                                            "image_size": self.image_size, "channels": self.channels,
                                            "normalize": {"mean": self.mean, "std": self.std},
                                            "augment": self.args.augment}}

    def batch(self, position: DataPosition):
        """(uint8 pixels (B, C, H, W), labels (B,)); shifted at random under ``--augment shift``, with
        random numbers drawn from the position (the same batch on resume and in every process)."""
        idx = self.batches.next(position)
        x = self.train_x[idx]
        if self.args.augment == "shift":
            x = random_shift(x, self.args.shift_pixels, position.generator(self.args.seed, _SHIFT_SALT))
        return x, self.train_y[idx]

    def training_forward(self, model, forward):
        """Normalise the pixels (on the device), encode, pool, classify."""
        mean, std = self.mean, self.std
        return lambda pixels: model.classifier(model.pool(forward(normalize(pixels, mean, std))))

    def loss(self, forward, batch, smoothing):
        x, y = batch
        logits = forward(x)
        return F.cross_entropy(logits.float(), y, label_smoothing=smoothing), len(y), len(y) * self.tokens_per_image

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        from ...evaluate.classification import classification_scores
        pred, _ = predict_images(model, self.dev_x, self.mean, self.std, device, bf16)
        s = classification_scores(self.dev_y, pred, len(self.labels))
        return {"dev_accuracy": s["accuracy"], "dev_macro_f1": s["macro_f1"], "score": s["accuracy"]}

    def describe(self, r: dict) -> str:
        return f"dev accuracy {r['dev_accuracy']:.4f}  macro-F1 {r['dev_macro_f1']:.4f}"


def _shape(data) -> str:
    h, w = data.size
    return f"{w}×{h}×{data.channels}"


# -- inference: what attnlab.load's image classifiers call ------------------------------------------------


@torch.no_grad()
def predict_images(model, pixels: torch.Tensor, mean: list[float], std: list[float], device, bf16: bool = False,
                   batch_size: int = 256) -> tuple[list[int], list[float]]:
    """(predicted class ids, probabilities of the predictions) for uint8 pixels (N, C, H, W)."""
    from ...model import eval_mode
    pred, prob = [], []
    device = torch.device(device)
    with eval_mode(model):
        for s in range(0, len(pixels), batch_size):
            x = normalize(pixels[s: s + batch_size].to(device), mean, std)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model.classify(x)
            top = logits.float().softmax(-1).max(-1)
            pred += top.indices.tolist()
            prob += top.values.tolist()
    return pred, prob


def model_pixels(model, images) -> torch.Tensor:
    """uint8 (N, C, H, W) for an image model from arrays, tensors or image files (``as_pixels``)."""
    return as_pixels(images, model.config.n_channels, model.config.image_size)


def normalisation(model, task: dict) -> tuple[list[float], list[float]]:
    """(mean, std) per channel the model was trained with (task.json), as ``normalize`` takes them."""
    norm, c = task.get("normalize") or {}, model.config.n_channels
    return norm.get("mean", [DEFAULT_MEAN] * c), norm.get("std", [DEFAULT_STD] * c)


def model_inputs(model, task: dict, images) -> torch.Tensor:
    """Normalised float (N, C, H, W), as the model was trained on."""
    return normalize(model_pixels(model, images), *normalisation(model, task))


def class_labels(model, task: dict) -> list[str]:
    """task.json's labels; the class numbers for a model without one (e.g. a converted HF ViT)."""
    return [str(l) for l in task.get("labels") or range(model.config.n_classes)]


def classify_images(model, task: dict, images, device) -> list[tuple[str, float]]:
    """(label, probability of that label) per image."""
    pred, prob = predict_images(model, model_pixels(model, images), *normalisation(model, task), device)
    labels = class_labels(model, task)
    return [(labels[p], q) for p, q in zip(pred, prob)]


def score_images(model, task: dict, images, references: list[str] | None, device) -> dict:
    """Accuracy, macro-F1 and the confusion matrix of the predictions against gold labels."""
    from ...evaluate.classification import classification_scores
    labels = class_labels(model, task)
    references = [str(r) for r in references] if references is not None else None
    pixels = model_pixels(model, images)
    unknown = sorted(set(references or []) - set(labels))
    if references is None or len(references) != len(pixels) or unknown:
        raise ValueError(f"scoring an image classifier needs one known label per image (labels: {labels}"
                         + (f"; unknown: {unknown[:5]}" if unknown else "") + ")")
    pred, _ = predict_images(model, pixels, *normalisation(model, task), device)
    return classification_scores([labels.index(r) for r in references], pred, len(labels))
