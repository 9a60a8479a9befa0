"""all-MiniLM-L6-v2 embedding throughput: attnlab vs sentence-transformers, same weights, batch 32,
2000 real sentences (the shipped Tatoeba dev + test English side), side by side in one run.

    python benchmarks/minilm_speed.py [--repeats 3] [--batch 32] [--sentences N]

``--sentences N`` takes the first N sentences only (the smoke test's).
"""

import argparse
import json
import time

import numpy as np
import torch

from attnlab.demo import corpus_dir
from attnlab.pretrained import embed, load_pretrained, minilm_path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--sentences", type=int, default=None, help="the first N sentences only (default: all 2000)")
    args = ap.parse_args()
    import sentence_transformers
    sentences = [l.split("\t")[0] for f in ("dev.tsv", "test.tsv") for l in (corpus_dir() / f).read_text().splitlines()]
    sentences = sentences[:args.sentences]
    ours = load_pretrained("minilm")
    st = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")
    a = embed(ours, sentences, args.batch)
    b = st.encode(sentences, batch_size=args.batch)
    t_ours = min(_time(lambda: embed(ours, sentences, args.batch)) for _ in range(args.repeats))
    t_st = min(_time(lambda: st.encode(sentences, batch_size=args.batch)) for _ in range(args.repeats))
    r = {"sentences": len(sentences), "batch": args.batch, "threads": torch.get_num_threads(),
         "attnlab_sent_per_s": round(len(sentences) / t_ours, 1),
         "sentence_transformers_sent_per_s": round(len(sentences) / t_st, 1), "speedup": round(t_st / t_ours, 2),
         "max_abs_diff": float(np.abs(a - b).max())}
    print(json.dumps(r))


def _time(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
