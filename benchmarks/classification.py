"""Encoder-only classification on real data, scored on held-out splits made from the given files.

    python benchmarks/classification.py sst2-minilm        # fine-tune all-MiniLM-L6-v2 (attnlab[pretrained])
    python benchmarks/classification.py sst2-scratch       # bert-mini from scratch
    python benchmarks/classification.py sst2-mlm           # bert-mini: masked-LM pretraining on the
                                                           # training sentences (labels unused), then sst2-scratch's recipe
    python benchmarks/classification.py chnsenticorp-scratch
    python benchmarks/classification.py sst2-mlm --smoke   # every stage for 2 updates, 1,000 items per file

Splits. SST-2: the GLUE training pool (train.tsv.gz, 67k items) holds the ~6.9k training *sentences*
and every sub-phrase of them; shared/data/sst2/dev.tsv is a random tenth of that pool, mostly short
phrases that are sub-phrases of training items, so accuracy on it flatters a model. What is reported
(and what recipes are chosen on) is therefore **full sentences only**: items with >= 8 words that are
not a substring of any training item ("test" from dev.tsv, never used for a choice; "dev" for model
selection from 5% of the pool, checked against the other 95%). The all-items accuracy on dev.tsv is
printed too, labelled as such. ChnSentiCorp_htl.csv.gz → a seeded 80/10/10 train/dev/test split.
"""

import argparse
import csv
import gzip
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from smoke import smoke_flags  # (benchmarks/smoke.py)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

COMMON = ["--task", "classify", "--schedule", "cosine", "--no-progress", "--save-every", "0"]
RECIPES = {
    "sst2-minilm": ["--init", "minilm", "--lr", "5e-5", "--warmup", "150", "--max-steps", "1500", "--batch-size", "32",
                    "--max-tokens", "4096", "--eval-every", "500", "--bf16", "--weight-decay", "0.01"],
    "sst2-scratch": ["--preset", "bert-mini", "--vocab-size", "8000", "--lr", "5e-4", "--warmup", "200",
                     "--max-steps", "1500", "--batch-size", "64", "--max-tokens", "4096", "--eval-every", "500",
                     "--bf16", "--set", "pooling=mean", "--set", "dropout=0.1"],
    "chnsenticorp-scratch": ["--preset", "bert-mini", "--vocab-size", "6000", "--lr", "5e-4", "--warmup", "100",
                             "--max-steps", "1500", "--batch-size", "32", "--max-tokens", "8192", "--max-len", "256",
                             "--eval-every", "500", "--bf16", "--set", "pooling=mean", "--set", "max_len=256"],
}


# Stage 1 of a recipe, if any: masked-LM pretraining on the training split's texts (no labels).
PRETRAIN = {
    "sst2-mlm": ["--task", "mlm", "--preset", "bert-mini", "--vocab-size", "8000", "--lr", "1e-3", "--warmup", "200",
                 "--max-steps", "3000", "--batch-size", "128", "--max-tokens", "4096", "--max-len", "64",
                 "--eval-every", "1000", "--bf16", "--schedule", "cosine", "--no-progress", "--save-every", "0",
                 "--set", "dropout=0.1"],
}
RECIPES["sst2-mlm"] = [f for f in RECIPES["sst2-scratch"] if f not in ("--preset", "bert-mini", "--vocab-size", "8000")]


def write_tsv(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.write("label\ttext\n")
        for label, text in rows:
            f.write(f"{label}\t{text.replace(chr(9), ' ')}\n")


def full_sentences(rows, train_rows, min_words: int = 8):
    """Items with >= min_words words that are not a substring of any training item."""
    pool = "\n".join(t for _, t in train_rows)
    return [(l, t) for l, t in rows if len(t.split()) >= min_words and t not in pool]


def splits(name, out: Path, limit: int | None = None):
    """(train, dev, test, all test items or None); ``limit``: only that many items of each file (--smoke)."""
    rng = random.Random(0)
    if name.startswith("sst2"):
        lines = gzip.open(DATA / "sst2" / "train.tsv.gz", "rt", encoding="utf-8").read().splitlines()[1:]
        rows = [(l.rsplit("\t", 1)[1], l.rsplit("\t", 1)[0].strip()) for l in lines]
        rng.shuffle(rows)
        rows = rows[:limit]
        n_dev = len(rows) // 20
        test = [(l.rsplit("\t", 1)[1], l.rsplit("\t", 1)[0].strip())
                for l in (DATA / "sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]][:limit]
        train, dev = rows[n_dev:], rows[:n_dev]
        return train, full_sentences(dev, train), full_sentences(test, train), test
    with gzip.open(DATA / "chnsenticorp_htl" / "ChnSentiCorp_htl.csv.gz", "rt", encoding="utf-8") as f:
        rows = [(r[0], r[1]) for r in list(csv.reader(f))[1:]]
    rng.shuffle(rows)
    rows = rows[:limit]
    n = len(rows) // 10
    return rows[2 * n:], rows[:n], rows[n: 2 * n], None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", choices=RECIPES)
    ap.add_argument("--out", default="runs")
    ap.add_argument("--smoke", action="store_true",
                    help="check the recipe runs, not its score: every stage for 2 updates on 1,000 items of each file")
    args = ap.parse_args()
    out = Path(args.out) / args.recipe
    out.mkdir(parents=True, exist_ok=True)
    train, dev, test, all_items = splits(args.recipe, out, limit=1000 if args.smoke else None)
    print(f"train {len(train):,}  dev {len(dev):,}  test {len(test):,}"
          + (f" (full sentences of {len(all_items):,} dev.tsv items)" if all_items else ""), flush=True)
    for name, rows in (("train", train), ("dev", dev), ("test", test), ("test_all_items", all_items or [])):
        write_tsv(out / f"{name}.tsv", rows)
    model = out / "model"
    flags = smoke_flags if args.smoke else list  # a stage's flags as run
    recipe = flags(RECIPES[args.recipe])
    t0 = time.time()
    if args.recipe in PRETRAIN:
        (out / "train_text.txt").write_text("\n".join(t for _, t in train) + "\n", encoding="utf-8")
        (out / "dev_text.txt").write_text("\n".join(t for _, t in dev) + "\n", encoding="utf-8")
        cmd = [sys.executable, "-m", "attnlab", "train", "--train", str(out / "train_text.txt"), "--dev",
               str(out / "dev_text.txt"), "--out", str(out / "pretrained"),
               *flags(PRETRAIN[args.recipe])]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        recipe += ["--init", str(out / "pretrained")]
    pretrain_wall = time.time() - t0
    cmd = [sys.executable, "-m", "attnlab", "train", "--train", str(out / "train.tsv"), "--dev", str(out / "dev.tsv"),
           "--out", str(model), *COMMON, *recipe]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    wall = time.time() - t0 - pretrain_wall
    ev = subprocess.run([sys.executable, "-m", "attnlab", "evaluate", "--model", str(model), "--data",
                         str(out / "test.tsv"), "--json", "--confusion-png", str(out / "confusion.png")],
                        check=True, capture_output=True, text=True)
    r = json.loads(ev.stdout.strip().splitlines()[-1])
    if all_items:
        ev_all = subprocess.run([sys.executable, "-m", "attnlab", "evaluate", "--model", str(model), "--data",
                                 str(out / "test_all_items.tsv"), "--json"], check=True, capture_output=True, text=True)
        r["all_items_accuracy"] = json.loads(ev_all.stdout.strip().splitlines()[-1])["accuracy"]
        r["all_items_n"] = len(all_items)
    gold = [l for l, _ in test]
    r.update(recipe=args.recipe, smoke=args.smoke, train_wall_s=round(wall), pretrain_wall_s=round(pretrain_wall), n_train=len(train),
             majority_baseline=round(max(gold.count(x) for x in set(gold)) / len(gold), 4))
    print(json.dumps(r))
    (out / "test_scores.json").write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
