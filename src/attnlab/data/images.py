"""Labelled images for ``--task image-classify``: a ``.npz`` file or a folder of class folders.

Two layouts are read:

* a **.npz** file (``numpy.savez``) with ``images``, uint8 of shape (N, H, W) (grey) or (N, H, W, C),
  and ``labels``, N integers or strings — MNIST as ``shared/data/mnist10k`` stores it;
* a **folder of class folders** (``root/cat/001.png``, ``root/dog/x.jpg``, as torchvision's
  ImageFolder): the folder name is the label; PNG, JPEG and BMP files are read with Pillow, other
  files (a README, ``.DS_Store``) are skipped. The images are grey (1 channel) when every one of
  them is, else RGB (3 channels; alpha and palettes are converted away).

All images must have one size: a different one is an error naming the file (the model's patch grid
is fixed, and a silent resize would change what the model sees without saying so).

Pixels stay uint8 in memory (N, C, H, W: a quarter of the float size) and become floats per batch
with :func:`normalize`, ``(x / 255 − mean) / std`` per channel, as ViT does (mean = std = 0.5: pixels
in [−1, 1]). The mean and std are saved in task.json, so inference normalises as training did.

Every problem is a :class:`DataError` naming the file and what is wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .readers import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")  # Pillow modes without colour
DEFAULT_MEAN, DEFAULT_STD = 0.5, 0.5


@dataclass
class LabeledImages:
    images: torch.Tensor  # uint8 (N, C, H, W)
    labels: list[str]     # one per image; integer labels of a .npz become "0", "1", …
    source: str           # the file or folder, for messages

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def channels(self) -> int:
        return self.images.shape[1]

    @property
    def size(self) -> tuple[int, int]:
        """(height, width)."""
        return tuple(self.images.shape[2:])

    def subset(self, idx: list[int]) -> "LabeledImages":
        return LabeledImages(self.images[idx], [self.labels[i] for i in idx], self.source)


def sorted_labels(labels: list[str]) -> list[str]:
    """The class order: numeric when every label is an integer (0, 1, …, 10, not 0, 1, 10, …)."""
    unique = set(labels)
    if all(l.lstrip("-").isdigit() for l in unique):
        return sorted(unique, key=int)
    return sorted(unique)


def read_images(path: str | Path, known_labels: list[str] | None = None) -> LabeledImages:
    """Labelled images from a ``.npz`` file or a folder of class folders (see the module docstring).
    With ``known_labels`` (a dev or test set), a label the model does not know is an error."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or folder (expected a .npz file or a folder of class folders)")
    data = _read_folder(p) if p.is_dir() else _read_npz(p)
    if known_labels is not None:
        unknown = sorted(set(data.labels) - set(known_labels))
        if unknown:
            raise DataError(f"{p}: label(s) {unknown[:5]} not among the model's labels {known_labels}")
    return data


def _read_npz(p: Path) -> LabeledImages:
    import zipfile
    if not zipfile.is_zipfile(p):  # numpy.savez writes a zip of .npy arrays
        raise DataError(f"{p}: not a .npz file (expected numpy.savez's zip of 'images' and 'labels' arrays, "
                        "or a folder of class folders)")
    try:
        with np.load(p, allow_pickle=False) as npz:
            keys = set(npz.files)
            missing = [k for k in ("images", "labels") if k not in keys]
            if missing:
                raise DataError(f"{p}: no {' and no '.join(repr(k) for k in missing)} array (found "
                                f"{sorted(keys) or 'none'}; expected 'images' uint8 (N, H, W[, C]) and 'labels' (N,))")
            images, labels = npz["images"], npz["labels"]
    except DataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:  # not an npz, truncated, or object arrays
        raise DataError(f"{p}: not a readable .npz file ({' '.join(str(e).split())[:160]})") from None
    if images.dtype != np.uint8:
        raise DataError(f"{p}: 'images' is {images.dtype}, expected uint8 pixels 0–255")
    if images.ndim not in (3, 4):
        raise DataError(f"{p}: 'images' has shape {images.shape}, expected (N, H, W) or (N, H, W, C)")
    if images.ndim == 4 and images.shape[3] not in (1, 3):
        raise DataError(f"{p}: 'images' has {images.shape[3]} channels (shape {images.shape}), expected 1 or 3 "
                        "as the last axis (N, H, W, C)")
    if labels.ndim != 1 or labels.dtype.kind not in "iuUS":
        raise DataError(f"{p}: 'labels' is {labels.dtype} of shape {labels.shape}, expected N integers or strings")
    if len(labels) != len(images):
        raise DataError(f"{p}: {len(images)} images but {len(labels)} labels")
    if len(images) == 0:
        raise DataError(f"{p}: no images (the arrays are empty)")
    if labels.dtype.kind == "S":
        labels = labels.astype(str)
    x = torch.from_numpy(np.ascontiguousarray(images))
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2).contiguous()  # (N, C, H, W)
    return LabeledImages(x, [str(l) for l in labels.tolist()], str(p))


def _read_folder(root: Path) -> LabeledImages:
    classes = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{root}: no class folders (expected {root}/LABEL/IMAGE.png, one folder per label)")
    files, labels = [], []
    for d in classes:
        found = sorted(f for f in d.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise DataError(f"{d}: no images in this class folder (looked for {', '.join(IMAGE_SUFFIXES)})")
        files += found
        labels += [d.name] * len(found)
    pictures = [_open(f) for f in files]
    channels = 1 if all(im.mode in GREY_MODES for im in pictures) else 3
    size = pictures[0].size  # (width, height)
    arrays = []
    for f, im in zip(files, pictures):
        if im.size != size:
            raise DataError(f"{f}: {im.size[0]}×{im.size[1]} pixels, but {files[0]} is {size[0]}×{size[1]} "
                            "(all images must have one size; resize them first)")
        arrays.append(_pixels(f, im, channels))
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # (N, H, W, C) → (N, C, H, W)
    return LabeledImages(x, labels, str(root))


def _open(path: Path):
    """A Pillow image, opened lazily (its size and mode are read, its pixels not yet)."""
    from PIL import Image, UnidentifiedImageError
    try:
        return Image.open(path)
    except UnidentifiedImageError:
        raise DataError(f"{path}: not a readable image (Pillow cannot identify it; a damaged or mislabelled "
                        "file?)") from None
    except OSError as e:
        raise DataError(f"{path}: not a readable image ({' '.join(str(e).split())[:160]})") from None


def _pixels(path: Path, im, channels: int) -> np.ndarray:
    """uint8 (H, W, C) pixels of an opened image, converted to grey (L) or RGB."""
    try:
        a = np.asarray(im.convert("L" if channels == 1 else "RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as e:  # a truncated or corrupt file fails when decoded
        raise DataError(f"{path}: not a readable image ({' '.join(str(e).split())[:160]})") from None
    return a[:, :, None] if a.ndim == 2 else a


def read_image_files(paths: list[str | Path], channels: int, size: int) -> torch.Tensor:
    """uint8 (N, C, H, W) pixels of image files for a model that reads ``size``×``size`` images of
    ``channels`` channels; a file of another size is an error naming it."""
    arrays = []
    for path in paths:
        f = Path(path)
        if not f.is_file():
            raise DataError(f"{f}: no such image file")
        im = _open(f)
        if im.size != (size, size):
            raise DataError(f"{f}: {im.size[0]}×{im.size[1]} pixels, but the model reads {size}×{size} images "
                            "(resize it first)")
        arrays.append(_pixels(f, im, channels))
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def as_pixels(images, channels: int, size: int) -> torch.Tensor:
    """uint8 (N, C, H, W) from what a caller may hold: a uint8 numpy array or tensor of shape
    (N, H, W) or (N, H, W, C) — as a .npz stores images and Pillow returns them — or image file
    paths (a list, or one path)."""
    if isinstance(images, (str, Path)):
        images = [images]
    if isinstance(images, (list, tuple)) and images and isinstance(images[0], (str, Path)):
        return read_image_files(images, channels, size)
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.dtype != torch.uint8:
        raise ValueError(f"images must be uint8 pixels 0–255, got {x.dtype}")
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    want = (size, size, channels)
    if x.dim() != 4 or tuple(x.shape[1:]) != want:
        raise ValueError(f"images of shape {tuple(x.shape)}: the model reads (N, {size}, {size}"
                         f"{', ' + str(channels) if channels > 1 else '[, 1]'}) uint8 pixels")
    return x.permute(0, 3, 1, 2).contiguous()


def normalize(pixels: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """uint8 (or float 0–255) pixels (N, C, H, W) → float ((x / 255 − mean) / std), per channel."""
    m = torch.tensor(mean, dtype=torch.float32, device=pixels.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=pixels.device).view(1, -1, 1, 1)
    return (pixels.float() / 255.0 - m) / s


def random_shift(pixels: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Each image of (N, C, H, W) moved by its own random (dy, dx) in [−max_shift, max_shift] pixels,
    the uncovered border filled with 0 (black: MNIST's background). One gather for the whole batch:
    out[n, :, y, x] = padded[n, :, y − dy + s, x − dx + s], with padded the batch framed by s zeros."""
    if max_shift <= 0:
        return pixels
    n, c, h, w = pixels.shape
    s = max_shift
    dy = torch.randint(-s, s + 1, (n,), generator=generator)
    dx = torch.randint(-s, s + 1, (n,), generator=generator)
    padded = torch.nn.functional.pad(pixels, (s, s, s, s))  # (N, C, H+2s, W+2s), zeros
    rows = (torch.arange(h).view(1, h) - dy.view(n, 1) + s).to(pixels.device)  # (N, H)
    cols = (torch.arange(w).view(1, w) - dx.view(n, 1) + s).to(pixels.device)  # (N, W)
    batch = torch.arange(n, device=pixels.device).view(n, 1, 1, 1)
    channel = torch.arange(c, device=pixels.device).view(1, c, 1, 1)
    # Four broadcast index tensors give (N, C, H, W) in the usual memory layout (a permuted result
    # would look channels-last to the patch convolution, whose backward is then far slower).
    return padded[batch, channel, rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]


__all__ = ["LabeledImages", "read_images", "read_image_files", "as_pixels", "normalize", "random_shift",
           "sorted_labels", "DEFAULT_MEAN", "DEFAULT_STD", "IMAGE_SUFFIXES"]
