"""Decoder-only language modelling and encoder-only classification, end to end on small real data."""
import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.data import DataError, read_labeled
from attnlab.train import TrainArgs
from attnlab.train.tasks import LanguageModelTask

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TINY_LM = ["--set", "d_model=64", "--set", "n_heads=4", "--set", "d_ff=256", "--set", "n_decoder_layers=2"]


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """A real sample: Tiny Shakespeare if this machine has it, else English text from the package."""
    d = tmp_path_factory.mktemp("lm")
    src = SHARED / "tinyshakespeare" / "input.txt.gz"
    if src.exists():
        text = gzip.open(src, "rt", encoding="utf-8").read()[:120_000]
    else:
        from attnlab.demo import corpus_dir
        text = "\n".join(l.split("\t")[0] for l in (corpus_dir() / "dev.tsv").read_text().splitlines()) * 3
    (d / "input.txt").write_text(text, encoding="utf-8")
    return d / "input.txt"


def test_char_lm_learns_and_generates(shakespeare, tmp_path, capsys):
    out = tmp_path / "lm"
    assert main(["train", "--task", "lm", "--train", str(shakespeare), "--out", str(out), "--preset",
                 "shakespeare-char", "--tokenizer", "char", "--block-size", "64", "--batch-size", "16",
                 "--max-steps", "150", "--lr", "3e-3", "--warmup", "20", "--schedule", "cosine", "--min-lr", "3e-4",
                 "--eval-every", "150", "--no-progress", "--betas", "0.9", "0.99", *TINY_LM]) == 0
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val_loss" in r][-1]["val_loss"]
    assert val < 0.75 * math.log(vocab)  # well below the uniform guess (log V)
    capsys.readouterr()
    val_text = tmp_path / "val.txt"
    val_text.write_text(shakespeare.read_text()[-5000:])
    assert main(["evaluate", "--model", str(out), "--data", str(val_text), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-3) and r["loss"] < math.log(vocab)
    assert main(["generate", "--model", str(out), "--prompt", "ROMEO:", "--sample", "--top-k", "5", "--seed", "1",
                 "--max-len", "40"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text) > 30


def test_block_sampler_never_crosses_the_end():
    task = LanguageModelTask()
    task.args = TrainArgs(block_size=8)
    g = torch.Generator().manual_seed(0)
    n = 20
    offsets = torch.cat([task.block_offsets(n, 64, g) for _ in range(200)])
    assert offsets.min() >= 0 and offsets.max() + 8 + 1 <= n  # y = data[i+1 : i+1+T] stays inside
    assert offsets.max() == n - 8 - 1  # and the last valid block is reachable


def _classification_data(tmp_path):
    src = SHARED / "sst2" / "train.tsv.gz"
    if src.exists():
        lines = gzip.open(src, "rt", encoding="utf-8").read().splitlines()
        header, rows = lines[0], lines[1:5001]
    else:  # a tiny synthetic but non-trivial stand-in
        import random
        rng = random.Random(0)
        good, bad = ["great", "wonderful", "moving", "funny", "superb"], ["dull", "awful", "boring", "flat", "bad"]
        rows = [f"{'a ' + rng.choice(good) + ' film'}\t1" if i % 2 else f"{'a ' + rng.choice(bad) + ' film'}\t0"
                for i in range(2000)]
        header = "sentence\tlabel"
    (tmp_path / "train.tsv").write_text("\n".join([header] + rows[:-500]) + "\n")
    (tmp_path / "test.tsv").write_text("\n".join([header] + rows[-500:]) + "\n")
    return tmp_path / "train.tsv", tmp_path / "test.tsv", rows[-500:]


def test_classifier_from_scratch_beats_the_majority_class(tmp_path, capsys):
    train, test, test_rows = _classification_data(tmp_path)
    out = tmp_path / "clf"
    assert main(["train", "--task", "classify", "--train", str(train), "--out", str(out), "--preset", "bert-mini",
                 "--vocab-size", "2000", "--max-steps", "250", "--lr", "1e-3", "--warmup", "30", "--max-tokens", "2000",
                 "--batch-size", "64", "--eval-every", "250", "--no-progress", "--set", "d_model=64",
                 "--set", "n_heads=4", "--set", "d_ff=128", "--set", "n_encoder_layers=2", "--set", "pooling=mean"]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--model", str(out), "--data", str(test), "--json",
                 "--confusion-png", str(tmp_path / "cm.png")]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gold = [l.rsplit("\t", 1)[1] for l in test_rows]
    majority = max(gold.count(x) for x in set(gold)) / len(gold)
    assert r["accuracy"] > majority + 0.05 and r["n"] == 500
    assert (tmp_path / "cm.png").stat().st_size > 5000
    assert main(["classify", "--model", str(out), "--text", "a wonderful, moving film"]) == 0
    label, prob = capsys.readouterr().out.strip().split("\t")
    assert label in ("0", "1") and 0.5 <= float(prob) <= 1.0


def test_label_files_errors_name_the_line(tmp_path):
    f = tmp_path / "d.tsv"
    f.write_text("sentence\tlabel\ngood film\t1\nbroken row without a tab\n")
    with pytest.raises(DataError, match=r"d.tsv:3: expected a label in column 1 and text in column 0"):
        read_labeled(f)
    f.write_text("sentence\tlabel\ngood film\t1\nbad film\tmaybe\n")
    with pytest.raises(DataError, match=r"d.tsv:3: unknown label 'maybe'"):
        read_labeled(f, known_labels=["0", "1"])
    c = tmp_path / "d.csv"
    c.write_text('label,review\n1,"nice, clean room"\n0,dirty\n')
    data = read_labeled(c)
    assert data.labels == ["1", "0"] and data.texts[0] == "nice, clean room"
