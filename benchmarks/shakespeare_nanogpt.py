"""nanoGPT's published CPU run on Tiny Shakespeare (character level) vs attnlab, side by side.

nanoGPT README: `python train.py config/train_shakespeare_char.py --device=cpu --compile=False
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0` — "val loss 1.88". attnlab runs the same
model and recipe (`--preset shakespeare-char`): 4 layers, 4 heads, d 128, block 64, batch 12, 2000
iterations, lr 1e-3 cosine to 1e-4 after 100 warmup, dropout 0, AdamW(0.9, 0.99), weight decay 0.1,
clip 1.0, the first 90% of the characters for training and the last 10% for validation. A third
attnlab run keeps everything but trains 2500 iterations (`--time-matched-steps`): what attnlab's faster
steps buy within nanoGPT's wall time.

    python benchmarks/shakespeare_nanogpt.py --nanogpt /path/to/nanoGPT [--data ../shared/data/tinyshakespeare]
    python benchmarks/shakespeare_nanogpt.py --skip-nanogpt --smoke   # every run for 2 updates, 20k characters

nanoGPT is not part of attnlab: point --nanogpt at your own checkout of karpathy/nanoGPT. Its side writes the
text into the checkout's data/shakespeare_char and runs its prepare.py there (with --smoke: the first 20,000
characters, until the next full run writes them again).
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tinyshakespeare  # (benchmarks/tinyshakespeare.py)
from smoke import SMOKE_STEPS, smoke_flags  # (benchmarks/smoke.py)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanogpt", help="a local checkout of karpathy/nanoGPT (not needed with --skip-nanogpt)")
    ap.add_argument("--data", default=str(tinyshakespeare.DEFAULT), help=tinyshakespeare.HELP)
    ap.add_argument("--out", default="runs/shakespeare-char")
    ap.add_argument("--skip-nanogpt", action="store_true")
    ap.add_argument("--time-matched-steps", type=int, default=2500,
                    help="the same model, batch and schedule shape with more iterations: as many as attnlab's "
                         "faster steps fit in less wall time than nanoGPT's 2000 (bf16: ~1.3x faster per step)")
    ap.add_argument("--smoke", action="store_true",
                    help="check the runs work, not their losses: 2 updates each on the first 20,000 characters")
    args = ap.parse_args()
    if not args.skip_nanogpt and not args.nanogpt:
        ap.error("--nanogpt DIR is required (or --skip-nanogpt)")
    text = tinyshakespeare.required(args.data)
    iters = SMOKE_STEPS if args.smoke else 2000
    if args.smoke:
        text, args.time_matched_steps = text[:20_000], iters + 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "input.txt").write_text(text, encoding="utf-8")
    results = {}

    if not args.skip_nanogpt:
        ng = Path(args.nanogpt)
        data_dir = ng / "data" / "shakespeare_char"
        shutil.copy(out / "input.txt", data_dir / "input.txt")  # prepare.py downloads only if absent
        subprocess.run([sys.executable, "prepare.py"], cwd=data_dir, check=True, capture_output=True)
        cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
               "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
               "--n_head=4", "--n_embd=128", f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--dropout=0.0",
               f"--out_dir={(out / 'nanogpt').resolve()}"]
        if args.smoke:  # an evaluation and a checkpoint at the last iteration
            cmd += [f"--eval_interval={iters}", "--warmup_iters=1", "--always_save_checkpoint=True"]
        t0 = time.time()
        res = subprocess.run(cmd, cwd=ng, check=True, capture_output=True, text=True)
        wall = time.time() - t0
        vals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", res.stdout)
        results["nanogpt"] = {"wall_s": round(wall, 1), "final_step": int(vals[-1][0]),
                              "val_loss_estimate": float(vals[-1][2]), "best_val_loss_estimate": min(float(v[2]) for v in vals)}
        # nanoGPT's own estimate is 20 random batches; score its saved (best) checkpoint on the whole
        # validation split, exactly as attnlab's is scored below, with nanoGPT's own model code.
        ev = subprocess.run([sys.executable, "-c", _EVAL_NANOGPT, str(ng), str(out / "nanogpt" / "ckpt.pt"),
                             str(data_dir / "val.bin")], check=True, capture_output=True, text=True)
        results["nanogpt"].update(json.loads(ev.stdout.strip().splitlines()[-1]))
        print("nanoGPT", json.dumps(results["nanogpt"]), flush=True)

    runs = {"attnlab_fp32": (False, iters), "attnlab_bf16": (True, iters),
            f"attnlab_bf16_{args.time_matched_steps}_steps": (True, args.time_matched_steps)}
    for name, (bf16, steps) in runs.items():
        results[name] = run_attnlab(out, out / name, bf16, steps, args.smoke)
        print(name, json.dumps(results[name]), flush=True)
    if "nanogpt" in results:
        for name in runs:
            results[name]["wall_time_ratio_nanogpt_over_attnlab"] = round(results["nanogpt"]["wall_s"] / results[name]["wall_s"], 2)
    print(json.dumps({**results, "smoke": args.smoke}))


def run_attnlab(out, model_dir, bf16, steps=2000, smoke=False):
    cmd = [sys.executable, "-m", "attnlab", "train", "--task", "lm", "--train", str(out / "input.txt"),
           "--out", str(model_dir), "--preset", "shakespeare-char", "--tokenizer", "char", "--block-size", "64",
           "--batch-size", "12", "--max-steps", str(steps), "--lr", "1e-3", "--min-lr", "1e-4", "--schedule", "cosine",
           "--warmup", "100", "--betas", "0.9", "0.99", "--eps", "1e-8", "--weight-decay", "0.1", "--clip-norm", "1.0",
           "--eval-every", "250", "--eval-batches", "240", "--save-every", "0", "--no-progress"] + (["--bf16"] if bf16 else [])
    if smoke:
        cmd = smoke_flags(cmd, steps)
    t0 = time.time()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.time() - t0
    # the whole validation split (111,540 characters), not a sample
    ev = subprocess.run([sys.executable, "-c", _EVAL, str(model_dir), str(out / "input.txt")],
                        check=True, capture_output=True, text=True)
    return {"wall_s": round(wall, 1), **json.loads(ev.stdout.strip().splitlines()[-1])}


# The validation split exactly as in training: the last 10% of the character ids.
_EVAL = """
import json, sys, torch
from attnlab.modeldir import load
from attnlab.evaluate.scoring import lm_loss
model, tok, _ = load(sys.argv[1])
ids = torch.tensor(tok.encode(open(sys.argv[2], encoding='utf-8').read()))
val = ids[int(len(ids) * 0.9):]
r = lm_loss(model, val, 64, model.device)
print(json.dumps({"val_loss_full_split": r["val_loss"], "val_tokens": r["tokens"]}))
"""

_EVAL_NANOGPT = """
import json, sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig
ck = torch.load(sys.argv[2], map_location='cpu', weights_only=False)
m = GPT(GPTConfig(**ck['model_args']))
m.load_state_dict({k.removeprefix('_orig_mod.'): v for k, v in ck['model'].items()})
m.eval()
val = torch.from_numpy(np.fromfile(sys.argv[3], dtype=np.uint16).astype(np.int64))
T = 64; n = (len(val) - 1) // T; total = 0.0; count = 0
with torch.no_grad():
    for s in range(0, n, 32):
        starts = range(s * T, min(n, s + 32) * T, T)
        x = torch.stack([val[i:i + T] for i in starts]); y = torch.stack([val[i + 1:i + 1 + T] for i in starts])
        logits, loss = m(x, y)
        total += loss.item() * y.numel(); count += y.numel()
print(json.dumps({"val_loss_full_split": round(total / count, 4), "val_tokens": count, "checkpoint_iter": ck['iter_num']}))
"""

if __name__ == "__main__":
    main()
