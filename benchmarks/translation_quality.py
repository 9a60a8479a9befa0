"""Documented training recipes and their scores (docs/results.md). Each recipe trains with
`attnlab train`, then scores the test split with `attnlab evaluate` (sacreBLEU + chrF, beam 4).

    python benchmarks/translation_quality.py multi30k-deen [--data ../shared/data] [--out runs/]
    python benchmarks/translation_quality.py tatoeba-enzh-long
    python benchmarks/translation_quality.py multi30k-deen --smoke   # 2 updates on 200 lines, 40 test sentences

Recipes are chosen on the dev/validation split only; the test split is scored once at the end.
"""

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

from smoke import smoke_flags  # (benchmarks/smoke.py)

RECIPES = {
    # Multi30k de→en: one joint BPE vocabulary (German and English share most characters and many
    # subwords), shared embeddings; small data (29k pairs), so many epochs with dropout 0.2.
    "multi30k-deen": dict(
        train="{data}/multi30k/train.de.gz,{data}/multi30k/train.en.gz",
        dev="{data}/multi30k/val.de.gz,{data}/multi30k/val.en.gz",
        test_src="{data}/multi30k/test_2016_flickr.de.gz", test_ref="{data}/multi30k/test_2016_flickr.en.gz",
        flags=["--preset", "mt-small", "--joint-vocab", "--vocab-size", "8000", "--max-tokens", "2000",
               "--lr", "1.5e-3", "--schedule", "cosine", "--warmup", "400", "--max-steps", "6000", "--bf16",
               "--eval-every", "2000", "--eval-sentences", "300", "--save-every", "2000", "--set", "dropout=0.2"]),
    # Tatoeba en→zh, the demo's recipe run longer: 3600 updates, 2× the demo's 10 minutes.
    "tatoeba-enzh-long": dict(
        train="{data}/tatoeba_cmn_eng/train.tsv.gz", dev="{data}/tatoeba_cmn_eng/dev.tsv",
        test_tsv="{data}/tatoeba_cmn_eng/test.tsv",
        flags=["--preset", "mt-small", "--vocab-size", "4000", "--max-tokens", "2000", "--lr", "1.5e-3",
               "--schedule", "cosine", "--warmup", "300", "--max-steps", "3600", "--bf16", "--eval-every", "1800",
               "--eval-sentences", "300", "--save-every", "1800"]),
}


def smoke_data(r, data: str, to: Path, lines: int = 200, test_lines: int = 40) -> None:
    """The first ``lines`` lines of each of the recipe's training and dev files and the first ``test_lines`` of its
    test files under ``to``, at the same relative paths and compression (``{data}`` then stands for ``to``). (An
    untrained model's beam search runs to its length limit on every sentence: 200 would take most of the smoke.)"""
    for key in ("train", "dev", "test_src", "test_ref", "test_tsv"):
        n = test_lines if key.startswith("test") else lines
        for rel in r.get(key, "").split(","):
            if not rel:
                continue
            src, dst = Path(rel.format(data=data)), Path(rel.format(data=to))
            dst.parent.mkdir(parents=True, exist_ok=True)
            op = gzip.open if src.suffix == ".gz" else open
            with op(src, "rt", encoding="utf-8") as f:
                head = [line for _, line in zip(range(n), f)]
            with op(dst, "wt", encoding="utf-8") as f:
                f.writelines(head)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", choices=RECIPES)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    ap.add_argument("--out", default="runs")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--smoke", action="store_true",
                    help="check the recipe runs, not its score: 2 updates on the first 200 lines of each training and dev "
                         "file, the first 40 test sentences scored")
    args = ap.parse_args()
    r = RECIPES[args.recipe]
    out = Path(args.out) / args.recipe
    flags = r["flags"]
    if args.smoke:
        smoke_data(r, args.data, out / "smoke-data")
        args.data, flags = str(out / "smoke-data"), smoke_flags(flags)
    cmd = [sys.executable, "-m", "attnlab", "train", "--train", r["train"].format(data=args.data),
           "--dev", r["dev"].format(data=args.data), "--out", str(out), "--no-progress", *flags]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    train_s = time.time() - t0
    ev = [sys.executable, "-m", "attnlab", "evaluate", "--model", str(out), "--beam", str(args.beam), "--json"]
    if "test_tsv" in r:
        ev += ["--data", r["test_tsv"].format(data=args.data)]
    else:
        ev += ["--src", r["test_src"].format(data=args.data), "--ref", r["test_ref"].format(data=args.data)]
    print(" ".join(ev), flush=True)
    scores = json.loads(subprocess.run(ev, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    scores.update(recipe=args.recipe, smoke=args.smoke, train_wall_s=round(train_s), beam=args.beam)
    print(json.dumps(scores))
    (out / "test_scores.json").write_text(json.dumps(scores, indent=2) + "\n")


if __name__ == "__main__":
    main()
