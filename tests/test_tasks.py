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


def test_mask_tokens_follows_bert_15_percent_80_10_10():
    from attnlab.data.encoding import mask_tokens
    g = torch.Generator().manual_seed(0)
    V, n_special, mask_id = 1000, 5, 4
    ids = torch.randint(n_special, V, (400, 250), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2  # BOS/EOS: never chosen
    is_token = torch.ones_like(ids, dtype=torch.bool)
    is_token[::2, 200:] = False  # padding: never chosen
    ids[~is_token] = 0
    inputs, labels = mask_tokens(ids, is_token, mask_id, V, n_special, g)
    chosen = labels != -100
    candidates = is_token & (ids >= n_special)
    assert not chosen[~candidates].any()
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    assert abs(chosen.sum().item() / candidates.sum().item() - 0.15) < 0.005
    masked = (inputs[chosen] == mask_id).float().mean().item()
    kept = (inputs[chosen] == ids[chosen]).float().mean().item()
    replaced = 1 - masked - kept
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(replaced - 0.1) < 0.01
    assert (inputs[chosen & (inputs != mask_id)] >= n_special).all()  # random tokens are never specials


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlm")
    src = SHARED / "sst2" / "train.tsv.gz"
    if src.exists():
        lines = [l.split("\t")[0] for l in gzip.open(src, "rt", encoding="utf-8").read().splitlines()[1:6001]]
    else:
        from attnlab.demo import corpus_dir
        lines = [l.split("\t")[0] for l in (corpus_dir() / "dev.tsv").read_text().splitlines()] * 4
    (d / "sentences.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d / "sentences.txt"


def test_mlm_pretraining_learns_and_initialises_a_classifier(sentences, tmp_path, capsys):
    from collections import Counter

    from attnlab.data.tokenizer import Tokenizer
    from attnlab.modeldir import load
    lines = sentences.read_text().splitlines()
    (tmp_path / "train.txt").write_text("\n".join(lines[:-500]) + "\n")
    (tmp_path / "dev.txt").write_text("\n".join(lines[-500:]) + "\n")
    out = tmp_path / "mlm"
    tiny = ["--set", "d_model=64", "--set", "n_heads=4", "--set", "d_ff=128", "--set", "n_encoder_layers=2"]
    assert main(["train", "--task", "mlm", "--train", str(tmp_path / "train.txt"), "--dev", str(tmp_path / "dev.txt"),
                 "--out", str(out), "--vocab-size", "1000", "--max-steps", "500", "--lr", "3e-3", "--warmup", "30",
                 "--schedule", "cosine", "--max-tokens", "3000", "--batch-size", "128", "--eval-every", "500",
                 "--no-progress", "--max-len", "64", *tiny]) == 0
    # The oracle: the best context-free guess, unigram frequencies of the training tokens. Beating it
    # means the encoder uses the context around each [MASK].
    tok = Tokenizer.load(out / "tokenizer.json")
    counts = Counter(t for ids in tok.encode_batch(lines[:-500]) for t in ids)
    total, V = sum(counts.values()), tok.vocab_size
    dev_ids = [t for ids in tok.encode_batch(lines[-500:]) for t in ids]
    unigram = sum(-math.log((counts[t] + 1) / (total + V)) for t in dev_ids) / len(dev_ids)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in rows if "dev_mlm_loss" in r][-1]
    assert dev["dev_mlm_loss"] < unigram - 0.25, (dev, unigram)
    capsys.readouterr()
    assert main(["evaluate", "--model", str(out), "--data", str(tmp_path / "dev.txt"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["mlm_loss"] == pytest.approx(dev["dev_mlm_loss"], abs=1e-3) and r["masked_tokens"] > 100
    # The pretrained directory initialises a classifier (same tokenizer, encoder weights copied).
    train, _, _ = _classification_data(tmp_path)
    clf = tmp_path / "clf"
    assert main(["train", "--task", "classify", "--init", str(out), "--train", str(train), "--out", str(clf),
                 "--max-steps", "1", "--lr", "1e-12", "--warmup", "1", "--eval-every", "0", "--no-progress"]) == 0
    mlm_model, _, _ = load(out)
    clf_model, _, _ = load(clf)
    assert clf_model.config.n_classes == 2
    for name, p in mlm_model.encoder.state_dict().items():
        torch.testing.assert_close(clf_model.encoder.state_dict()[name], p, atol=1e-6, rtol=0)
    assert (clf / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
