"""Images (ViT): the readers and their errors, shift augmentation, --task image-classify end to end on
synthetic bars (and on MNIST where the shared data is here), evaluate, attnlab.load, the attention
rollout and its picture, params and shapes of vit-mnist."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import attnlab
from attnlab.cli import main
from attnlab.data.images import normalize, random_shift, read_image_files, read_images, sorted_labels
from attnlab.data.readers import DataError
from attnlab.inspect.attention import attention_rollout, cls_patch_map, image_attention_maps
from attnlab.train import TrainArgs
from attnlab.train.tasks import DataPosition
from attnlab.train.tasks.image_classify import ImageClassificationTask

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TINY = ["--set", "d_model=32", "--set", "n_heads=2", "--set", "d_ff=64", "--set", "n_encoder_layers=2"]
QUIET = ["--no-progress", "--threads", "1", "--save-every", "0"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bars(n: int, seed: int, size: int = 16):
    """4 classes of a bright 2-pixel bar on dim noise: vertical near the left (0) or right (1) edge,
    horizontal near the top (2) or bottom (3) — orientation *and* position, so positions must be learnt."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 60, (n, size, size), dtype=np.uint8)
    y = rng.integers(0, 4, n)
    for i, c in enumerate(y):
        at = rng.integers(1, 4) if c % 2 == 0 else rng.integers(size - 5, size - 2)
        start = rng.integers(0, size - 8)
        length = rng.integers(6, size - start + 1)
        if c < 2:
            x[i, start:start + length, at:at + 2] = 255
        else:
            x[i, at:at + 2, start:start + length] = 255
    return x, y.astype(np.uint8)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bars")
    for name, n, seed in (("train", 800, 0), ("dev", 200, 1)):
        x, y = bars(n, seed)
        np.savez(d / f"{name}.npz", images=x, labels=y)
    return d


@pytest.fixture(scope="module")
def vit(data, tmp_path_factory) -> Path:
    """A tiny ViT trained on the bars (a few seconds on one core)."""
    out = tmp_path_factory.mktemp("vit") / "m"
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--task", "image-classify", "--train", str(data / "train.npz"), "--dev",
                     str(data / "dev.npz"), "--out", str(out), *TINY, "--batch-size", "32", "--max-steps", "300",
                     "--lr", "3e-3", "--warmup", "20", "--schedule", "cosine", "--eval-every", "100", *QUIET]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


# -- readers ---------------------------------------------------------------------------------------------


def test_npz_reader_grey_rgb_and_string_labels(tmp_path):
    x = np.arange(3 * 4 * 4, dtype=np.uint8).reshape(3, 4, 4)
    np.savez(tmp_path / "g.npz", images=x, labels=np.array([2, 10, 1]))
    d = read_images(tmp_path / "g.npz")
    assert d.images.shape == (3, 1, 4, 4) and d.images.dtype == torch.uint8 and d.size == (4, 4)
    assert torch.equal(d.images[:, 0], torch.from_numpy(x)) and d.labels == ["2", "10", "1"]
    assert sorted_labels(d.labels) == ["1", "2", "10"]  # numeric order, not "1", "10", "2"
    rgb = np.random.default_rng(0).integers(0, 256, (2, 5, 5, 3), dtype=np.uint8)
    np.savez(tmp_path / "c.npz", images=rgb, labels=np.array(["cat", "dog"]))
    d = read_images(tmp_path / "c.npz")
    assert d.images.shape == (2, 3, 5, 5) and d.channels == 3 and d.labels == ["cat", "dog"]
    assert torch.equal(d.images[1].permute(1, 2, 0), torch.from_numpy(rgb[1]))


def _png(path: Path, array: np.ndarray, mode: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode=mode if mode != "L" else None).save(path)
    return path


def test_folder_reader_grey_and_rgb(tmp_path):
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (6, 6), dtype=np.uint8)
    _png(tmp_path / "g" / "a" / "1.png", grey, "L")
    _png(tmp_path / "g" / "b" / "2.png", 255 - grey, "L")
    (tmp_path / "g" / "b" / "README.txt").write_text("not an image: skipped")
    d = read_images(tmp_path / "g")
    assert d.images.shape == (2, 1, 6, 6) and d.labels == ["a", "b"]
    assert torch.equal(d.images[0, 0], torch.from_numpy(grey))
    rgb = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    _png(tmp_path / "g" / "c" / "3.png", rgb, "RGB")  # one colour image: every image becomes RGB
    d = read_images(tmp_path / "g")
    assert d.images.shape == (3, 3, 6, 6) and d.labels == ["a", "b", "c"]
    assert torch.equal(d.images[2].permute(1, 2, 0), torch.from_numpy(rgb))
    assert torch.equal(d.images[0, 1], torch.from_numpy(grey))  # grey → RGB repeats the grey value
    x = read_image_files([tmp_path / "g" / "c" / "3.png"], channels=3, size=6)
    assert torch.equal(x[0], d.images[2])


def _bad_cases(t: Path):
    """(what to read, the file the message must name, words it must hold)."""
    x = np.zeros((4, 8, 8), np.uint8)
    y = np.zeros(4, np.uint8)
    np.savez(t / "nolabels.npz", images=x)
    np.savez(t / "float.npz", images=x.astype(np.float32), labels=y)
    np.savez(t / "flat.npz", images=x.reshape(4, 64), labels=y)
    np.savez(t / "count.npz", images=x, labels=y[:3])
    (t / "text.npz").write_text("images,labels\n")
    (t / "empty").mkdir()
    (t / "noimg" / "a").mkdir(parents=True)
    (t / "noimg" / "a" / "notes.txt").write_text("x")
    _png(t / "broken" / "a" / "ok.png", np.zeros((8, 8), np.uint8), "L")
    (t / "broken" / "b").mkdir()
    (t / "broken" / "b" / "bad.png").write_bytes(PNG_MAGIC + b"this is not a PNG body")
    _png(t / "sizes" / "a" / "1.png", np.zeros((8, 8), np.uint8), "L")
    _png(t / "sizes" / "b" / "2.png", np.zeros((9, 8), np.uint8), "L")
    return [
        (t / "nolabels.npz", "nolabels.npz", "'labels'"),
        (t / "float.npz", "float.npz", "float32"),
        (t / "flat.npz", "flat.npz", "(N, H, W)"),
        (t / "count.npz", "count.npz", "4 images but 3 labels"),
        (t / "text.npz", "text.npz", "not a .npz file"),
        (t / "missing.npz", "missing.npz", "no such file"),
        (t / "empty", "empty", "no class folders"),
        (t / "noimg", "noimg/a", "no images"),
        (t / "broken", "bad.png", "not a readable image"),
        (t / "sizes", "2.png", "8×9 pixels"),
    ]


def test_bad_image_data_is_one_line_naming_the_file(tmp_path):
    for path, names, words in _bad_cases(tmp_path):
        with pytest.raises(DataError) as e:
            read_images(path)
        msg = str(e.value)
        assert "\n" not in msg and names in msg and words in msg, (path, msg)


def test_unknown_dev_label_and_wrong_size_image_file(tmp_path):
    np.savez(tmp_path / "d.npz", images=np.zeros((2, 4, 4), np.uint8), labels=np.array([0, 7]))
    with pytest.raises(DataError, match=r"d\.npz: label\(s\) \['7'\] not among"):
        read_images(tmp_path / "d.npz", known_labels=["0", "1"])
    f = _png(tmp_path / "big.png", np.zeros((10, 10), np.uint8), "L")
    with pytest.raises(DataError, match=r"big\.png: 10×10 pixels, but the model reads 4×4"):
        read_image_files([f], channels=1, size=4)


# -- augmentation and batches ------------------------------------------------------------------------------


def test_random_shift_moves_content_keeps_shape_and_is_seeded():
    x = torch.zeros(64, 2, 9, 9, dtype=torch.uint8)
    x[:, :, 4, 4] = 200  # one dot in the middle of every image, both channels
    out = random_shift(x, 2, torch.Generator().manual_seed(3))
    assert out.shape == x.shape and out.dtype == torch.uint8 and out.is_contiguous()
    again = random_shift(x, 2, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)  # the same seed, the same shifts
    assert not torch.equal(out, random_shift(x, 2, torch.Generator().manual_seed(4)))
    moves = set()
    for img in out:
        (y, xx), = (img[0] == 200).nonzero().tolist()  # the dot survives once, moved by at most 2
        assert abs(y - 4) <= 2 and abs(xx - 4) <= 2 and torch.equal(img[0], img[1])
        moves.add((y - 4, xx - 4))
    assert len(moves) > 10  # offsets differ between images
    # Against a plain reference: draw the same offsets, copy the overlapping window, zeros elsewhere.
    x = torch.randint(1, 256, (16, 3, 7, 6), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    out = random_shift(x, 3, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    dys, dxs = torch.randint(-3, 4, (16,), generator=g), torch.randint(-3, 4, (16,), generator=g)
    for img, moved, dy, dx in zip(x, out, dys.tolist(), dxs.tolist()):
        want = torch.zeros_like(img)
        want[:, max(dy, 0): 7 + min(dy, 0), max(dx, 0): 6 + min(dx, 0)] = \
            img[:, max(-dy, 0): 7 - max(dy, 0), max(-dx, 0): 6 - max(dx, 0)]
        assert torch.equal(moved, want), (dy, dx)


def _task(data: Path, **kw) -> ImageClassificationTask:
    args = TrainArgs(task="image-classify", train=str(data / "train.npz"), dev=str(data / "dev.npz"), **kw)
    task = ImageClassificationTask()
    task.prepare(args, Path("."), lambda *a: None)
    task.model_config(args)
    return task


def test_batches_cover_an_epoch_resume_exactly_and_count_tokens(data):
    task = _task(data, batch_size=32, augment="shift")
    pos = DataPosition()
    seen = []
    for step in range(25):  # 800 images / 32 = one epoch
        pos.step = step
        seen += task.batch(pos)[1].tolist()
    assert pos.epoch == 0 and pos.batch_in_epoch == 25 and len(seen) == 800
    assert sorted(seen) == sorted(task.train_y.tolist())  # every image once
    a, b = DataPosition(epoch=1, batch_in_epoch=3, step=28), DataPosition(epoch=1, batch_in_epoch=3, step=28)
    xa, ya = task.batch(a)
    xb, yb = _task(data, batch_size=32, augment="shift").batch(b)  # a fresh task, as after --resume
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.dtype == torch.uint8
    assert task.tokens_per_image == 1 + (16 // 4) ** 2  # [CLS] + 16 patches: tokens/s counts these
    from attnlab.model import build_model
    model = build_model(task.model_config(task.args))
    loss, n, n_in = task.loss(task.training_forward(model, model), (xa, ya), 0.0)
    assert n == 32 and n_in == 32 * 17 and loss.item() > 0


def test_resume_is_exact_with_augmentation_and_a_patch_size_of_its_own(data, tmp_path):
    """patch_size=8 does not divide vit-mnist's own 28 pixels, only the data's 16: --resume's check of the
    preset must see the data's size (training_args.json records it)."""
    from safetensors.torch import load_file
    threads = torch.get_num_threads()
    run = ["--task", "image-classify", "--train", str(data / "train.npz"), "--dev", str(data / "dev.npz"), *TINY,
           "--set", "patch_size=8", "--batch-size", "16", "--lr", "3e-3", "--warmup", "2", "--eval-every", "0",
           "--augment", "shift", "--no-progress", "--threads", "1", "--save-every", "2"]
    try:
        assert main(["train", *run, "--out", str(tmp_path / "a"), "--max-steps", "4"]) == 0
        assert main(["train", *run, "--out", str(tmp_path / "b"), "--max-steps", "2"]) == 0
        assert main(["train", "--resume", str(tmp_path / "b"), "--max-steps", "4"]) == 0
    finally:
        torch.set_num_threads(threads)
    a, b = (load_file(str(tmp_path / d / "checkpoints" / "step_00000004.safetensors")) for d in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_patch_size_that_does_not_tile_the_image_is_an_error(data, tmp_path, capsys):
    code = main(["train", "--task", "image-classify", "--train", str(data / "train.npz"), "--out", str(tmp_path / "m"),
                 "--set", "patch_size=5", "--max-steps", "1", *QUIET])
    err = capsys.readouterr().err
    assert code == 1 and "train.npz: images are 16×16 pixels" in err and "[2, 4, 8]" in err
    assert main(["train", "--task", "classify", "--augment", "shift", "--train", "x.tsv", "--out",
                 str(tmp_path / "c")]) == 2  # an option of another task
    assert "--task image-classify only" in capsys.readouterr().err


# -- train, evaluate, load, attention ---------------------------------------------------------------------


def test_tiny_vit_learns_the_bars_and_evaluates(vit, data, capsys):
    rows = [json.loads(l) for l in (vit / "metrics.jsonl").read_text().splitlines()]
    best = max(r["dev_accuracy"] for r in rows if "dev_accuracy" in r)
    assert best >= 0.8, rows  # chance is 0.25
    assert any(r.get("tokens_per_s", 0) > 0 for r in rows)
    task = json.loads((vit / "task.json").read_text())
    assert task["task"] == "image-classify" and task["labels"] == ["0", "1", "2", "3"]
    assert task["image_size"] == 16 and task["channels"] == 1 and task["normalize"] == {"mean": [0.5], "std": [0.5]}
    assert not (vit / "tokenizer.json").exists()
    capsys.readouterr()
    assert main(["evaluate", "--task", "image-classify", "--model", str(vit), "--test", str(data / "dev.npz"),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["n"] == 200 and r["accuracy"] == pytest.approx(best) and 0 < r["macro_f1"] <= 1
    assert main(["evaluate", "--model", str(vit), "--data", str(data / "dev.npz")]) == 0
    assert "accuracy" in capsys.readouterr().out


def test_load_classifies_arrays_and_files(vit, data, tmp_path, capsys):
    m = attnlab.load(vit, device="cpu")
    assert m.kind == "image-classify" and m.tokenizer is None
    dev = np.load(data / "dev.npz")
    out = m.classify(dev["images"][:8])
    assert len(out) == 8 and all(l in ("0", "1", "2", "3") and 0 < p <= 1 for l, p in out)
    files = [_png(tmp_path / f"{i}.png", dev["images"][i], "L") for i in range(3)]
    assert m.classify(files) == out[:3] and m.classify(torch.from_numpy(dev["images"][:3])) == out[:3]
    s = m.score(dev["images"], [str(l) for l in dev["labels"]])
    assert s["n"] == 200 and s["accuracy"] >= 0.8
    with pytest.raises(ValueError, match="uint8"):
        m.classify(dev["images"][:2].astype(np.float32))
    capsys.readouterr()
    assert main(["classify", "--model", str(vit), "--image", *map(str, files)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [l.split("\t")[1] for l in lines] == [l for l, _ in out[:3]]


def test_attention_png_for_an_index_and_a_file(vit, data, tmp_path, capsys):
    png = tmp_path / "attn.png"
    assert main(["attention", "--model", str(vit), "--image", "5", "--data", str(data / "dev.npz"),
                 "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC and "dev.npz[5]: predicted" in capsys.readouterr().out
    f = _png(tmp_path / "one.png", np.load(data / "dev.npz")["images"][0], "L")
    assert main(["attention", "--model", str(vit), "--image", str(f), "--out", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC
    assert main(["attention", "--model", str(vit), "--image", "5", "--out", str(png)]) == 2  # an index needs --data
    assert "needs --data" in capsys.readouterr().err


def test_rollout_one_layer_rows_and_shapes(vit, data):
    torch.manual_seed(0)
    a = torch.rand(3, 5, 5).softmax(-1)  # (heads, T, T), rows sum to 1
    (r,) = attention_rollout([a])
    expected = 0.5 * a.mean(0) + 0.5 * torch.eye(5)
    assert torch.allclose(r, expected / expected.sum(-1, keepdim=True))
    layers = [torch.rand(2, 4, 17, 17).softmax(-1) for _ in range(3)]  # batched, 3 layers
    rolled = attention_rollout(layers)
    assert len(rolled) == 3 and rolled[-1].shape == (2, 17, 17)
    assert torch.allclose(rolled[-1].sum(-1), torch.ones(2, 17))
    hat = [0.5 * w.mean(1) + 0.5 * torch.eye(17) for w in layers]
    assert torch.allclose(rolled[1], hat[1] @ hat[0], atol=1e-6)  # later layers multiply on the left
    assert cls_patch_map(rolled[-1], 4).shape == (2, 4, 4)
    # mean pooling: the picture is the mean of the patch rows (what the pooled output mixes)
    r = rolled[-1][0]
    assert torch.allclose(cls_patch_map(r, 4, "mean"), r[1:, 1:].mean(0).reshape(4, 4))
    assert torch.allclose(cls_patch_map(r, 4, "cls"), r[0, 1:].reshape(4, 4))
    m = attnlab.load(vit, device="cpu")
    image = torch.from_numpy(np.load(data / "dev.npz")["images"][:1])[:, None]  # (1, 1, 16, 16) uint8
    maps = image_attention_maps(m.module, normalize(image, [0.5], [0.5]))
    assert len(maps["rollout"]) == len(maps["layers"]) == 2
    assert all(t.shape == (4, 4) for t in maps["rollout"] + maps["layers"])
    assert all(float(t.sum()) <= 1 + 1e-5 for t in maps["rollout"])  # [CLS]'s share over the patches


def test_params_and_shapes_of_vit_mnist(capsys):
    from attnlab.config import get_preset
    from attnlab.model import build_model
    cfg = get_preset("vit-mnist")
    assert main(["params", "vit-mnist"]) == 0
    assert f"{build_model(cfg).num_parameters():,}" in capsys.readouterr().out  # the table's total is the model's
    assert main(["shapes", "vit-mnist"]) == 0
    out, d = capsys.readouterr().out, cfg.d_model
    assert "images (2, 1, 28, 28)" in out and f"(2, {d}, 7, 7)" in out and f"(2, 50, {d})" in out
    assert out.rstrip().endswith("(2, 10)")  # the classifier's logits


@pytest.mark.skipif(not (SHARED / "mnist10k" / "train.npz").exists(), reason="shared MNIST data not on this machine")
def test_tiny_vit_on_a_subset_of_mnist(tmp_path):
    for name, n in (("train", 2000), ("dev", 300)):
        d = np.load(SHARED / "mnist10k" / f"{name}.npz")
        np.savez(tmp_path / f"{name}.npz", images=d["images"][:n], labels=d["labels"][:n])
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--task", "image-classify", "--train", str(tmp_path / "train.npz"), "--dev",
                     str(tmp_path / "dev.npz"), "--out", str(tmp_path / "m"), "--set", "patch_size=7", "--set",
                     "d_model=64", "--set", "d_ff=128", "--set", "n_heads=2", "--set", "n_encoder_layers=2",
                     "--batch-size", "32", "--max-steps", "300", "--lr", "2e-3", "--warmup", "30", "--schedule",
                     "cosine", "--eval-every", "300", *QUIET]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(l) for l in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if "dev_accuracy" in r][-1]["dev_accuracy"] > 0.5  # chance is 0.1
