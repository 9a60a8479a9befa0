"""``attnlab demo``: the main job, end to end, on the corpus shipped inside the package.

Trains a small English→Chinese Transformer for a time budget, then reports sacreBLEU and chrF on
the shipped test split, translates a few sentences, and draws attention maps and training curves.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

# The recipe, chosen by measurement on the dev split on 2 CPU cores (docs/results.md):
# - small batches (2000 tokens): on CPU they give the most tokens/s *and* the most updates in a
#   fixed time (updates/s by CPU: docs/results.md);
# - separate 4000-token BPE vocabularies: the Chinese side is close to character level, which is
#   what sacreBLEU's zh tokenizer scores;
# - Pre-Norm, peak lr 1.5e-3 with 300 warmup steps, cosine decay to 0 over the time budget: a short
#   run needs a high learning rate early and a small one at the end;
# - label smoothing 0.1 and dropout 0.1 as in the paper.
# - bf16 autocast only where the CPU has native bf16 (AVX512-BF16/AMX): emulated bf16 is ~6x slower.
DEMO_RECIPE = dict(preset="mt-small", vocab_size=4000, max_tokens=2000, lr=1.5e-3, schedule="cosine",
                   warmup=300, label_smoothing=0.1, eval_sentences=200, beam=1)
EVAL_EVERY = 200  # dev loss + BLEU every 200 updates: enough points for a readable curve
EXAMPLES = ["I love coding.", "How are you?", "The weather is nice today.", "Where is the train station?",
            "I don't know what to do."]


def corpus_dir() -> Path:
    return Path(str(resources.files("attnlab") / "data" / "corpora" / "tatoeba_cmn_eng"))


def _log(*parts) -> None:
    print(*parts, flush=True)


def run_demo(minutes: float = 10.0, out: str = "runs/demo", threads: int | None = None, log=_log,
             test_sentences: int | None = None, device: str = "auto", preset: str = "mt-small") -> int:
    """``test_sentences`` scores only the first N test sentences, and at most N dev sentences at each of training's
    evaluations (a small budget for tests: an untrained model decodes every sentence to its length limit);
    ``preset`` is the encoder-decoder to train with the same recipe (e.g. t5-mini)."""
    import torch

    from .accel import bf16_native, cpu_isa, cpu_name, pick_device
    if threads:
        torch.set_num_threads(threads)
    out_dir, dev = Path(out), pick_device(device)
    bf16 = bf16_native(dev)  # the demo adapts to the machine: bf16 only where it is native
    where = f"{dev.type.upper()} {cpu_name()} ({cpu_isa()})" if dev.type == "cpu" else str(dev)
    log(f"== attnlab demo: English → Chinese on Tatoeba (CC-BY 2.0 FR, {corpus_dir()})")
    log(f"   training {preset} for {minutes:g} minutes on {where}, "
        f"{'bf16 autocast (native)' if bf16 else 'fp32 (no native bf16 here)'}; model directory: {out_dir}")
    eval_sentences = min(DEMO_RECIPE["eval_sentences"], test_sentences or DEMO_RECIPE["eval_sentences"])
    result = _train(out_dir, minutes, dev, bf16, log, preset, eval_sentences)
    if result["stop"] == "interrupted":
        log(f"== interrupted: checkpoint in {out_dir}; continue with attnlab train --resume {out_dir}")
        return 130
    _evaluate(out_dir, dev, bf16, test_sentences, log, steps=result["steps"], minutes=minutes, device=where,
              preset=preset)
    return 0


def _train(out_dir: Path, minutes: float, dev, bf16: bool, log, preset: str, eval_sentences: int) -> dict:
    from .train import TrainArgs, Trainer
    corpus = corpus_dir()
    if (out_dir / "metrics.jsonl").exists():
        (out_dir / "metrics.jsonl").unlink()  # a fresh demo run
    args = TrainArgs(out=str(out_dir), train=str(corpus / "train.tsv.gz"), dev=str(corpus / "dev.tsv"),
                     minutes=minutes, eval_every=EVAL_EVERY, save_every=500, bf16=bf16, device=str(dev),
                     **{**DEMO_RECIPE, "preset": preset, "eval_sentences": eval_sentences})
    trainer = Trainer(args, log=log)
    trainer.setup()
    task = trainer.task
    log(f"   {trainer.model.num_parameters():,} parameters, {task.n_train:,} training pairs, "
        f"vocabularies {task.src_tok.vocab_size} (en) / {task.tgt_tok.vocab_size} (zh)")
    result = trainer.train()
    log(f"   trained {result['steps']} steps in {result['elapsed']:.0f} s ({result['stop']})")
    return result


def _evaluate(out_dir: Path, dev, bf16: bool, test_sentences: int | None, log, **record) -> None:
    """Test scores, example translations and the two pictures, through the public API."""
    import torch

    from .api import load
    from .data.readers import read_tsv_pairs
    from .generate import GenerationConfig
    from .inspect.attention import plot_attention, plot_curves
    model = load(out_dir, dev)
    test = read_tsv_pairs(corpus_dir() / "test.tsv")
    src, ref = (test.src[:test_sentences], test.tgt[:test_sentences]) if test_sentences else (test.src, test.tgt)
    beam = GenerationConfig(num_beams=4, length_penalty=0.6)
    t0 = time.time()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        scores = model.score(src, ref, beam)
        outs = model.translate(EXAMPLES, beam)
    log(f"\n== test split ({scores['n']} sentences, beam 4, {time.time() - t0:.0f} s): "
        f"sacreBLEU {scores['bleu']:.2f} (tokenize=zh)  chrF {scores['chrf']:.2f}")
    scores.update(record, bf16=bf16)
    (out_dir / "test_scores.json").write_text(json.dumps(scores, indent=2) + "\n", encoding="utf-8")
    log("\n== translations")
    for s, t in zip(EXAMPLES, outs):
        log(f"   {s}  →  {t}")
    attn_png, curves_png = out_dir / "attention.png", out_dir / "curves.png"
    plot_attention(model.attention(EXAMPLES[0], outs[0]), str(attn_png), f"{EXAMPLES[0]} → {outs[0]}")
    plot_curves(str(out_dir / "metrics.jsonl"), str(curves_png))
    log(f"\n== pictures: {attn_png} (attention maps), {curves_png} (loss and BLEU curves)")
    log(f"== model: {out_dir.resolve()}  (attnlab translate --model {out_dir} --text \"...\")")
