"""attnlab train: one trainer for every task (--task translation | lm | classify | mlm).

Options come from three places, later ones winning: a resumed run's training_args.json, a --config
JSON file, and the flags. Each is checked (names, types, ranges) before any data is read."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .common import UsageError

HELP = "train a model: translation (default), --task lm, --task classify, --task mlm"
EXAMPLES = """attnlab train --train data/train.tsv.gz --dev data/dev.tsv --out runs/enzh --minutes 30 --bf16
  attnlab train --task lm --preset shakespeare-char --tokenizer char --train input.txt --out runs/sh
  attnlab train --task classify --init minilm --train sst2/train.tsv.gz --out runs/sst2
  attnlab train --task mlm --train sentences.txt --out runs/mlm --max-len 64 --max-steps 4000 --bf16
  attnlab train --task classify --init runs/mlm --train sst2/train.tsv.gz --out runs/sst2-mlm
  attnlab train --task span --train sentences.txt --out runs/t5 --max-len 64 --max-steps 4000 --bf16
  attnlab train --train train.de.gz,train.en.gz --dev val.de.gz,val.en.gz --preset mt-small \\
      --set d_model=384 --max-tokens 4000 --max-steps 20000
  attnlab train --resume runs/enzh --minutes 60     # continue exactly where it stopped
  torchrun --nproc_per_node 2 -m attnlab train --train ... --out runs/ddp"""

HELPS = {"train": "TSV file (src<TAB>tgt[<TAB>...], .gz ok) or SRC_FILE,TGT_FILE",
         "dev": "dev set, same formats", "out": "model directory", "minutes": "time budget",
         "max_tokens": "tokens per batch (per process)", "update_freq": "gradient accumulation steps",
         "lr": "peak learning rate (default: the paper's d^-0.5 warmup^-0.5)",
         "schedule": "inverse_sqrt (the paper's) | cosine | constant",
         "bf16": "bf16 autocast where the device has native bf16 (fp32 elsewhere, with one line saying so)",
         "compile": "torch.compile the model",
         "preset": "model preset or config.json (default: the task's own, e.g. mt-small for translation)",
         "zh_simplified": "convert Traditional Chinese targets to Simplified (needs attnlab[zh])",
         "reverse": "swap the TSV columns' direction", "joint_vocab": "one BPE vocabulary for both sides",
         "source_prefix": "text put before every source sentence, e.g. 'translate English to German: ' (T5); "
                          "recorded in task.json, so attnlab translate adds it too",
         "noise_density": "share of each example's tokens dropped into spans (T5: 0.15)",
         "mean_span_length": "average length of a dropped span, in tokens (T5: 3)",
         "patience": "early stopping after N evaluations without improvement",
         "src_col": "TSV column of the source", "tgt_col": "TSV column of the target",
         "eval_sentences": "dev sentences translated for BLEU at each evaluation", "beam": "beam size for dev BLEU",
         "tokenizer": "char (one token per character, as nanoGPT) or bpe", "block_size": "tokens per training sequence",
         "eval_batches": "cap on validation blocks (0: the whole split)",
         "label_col": "column of the label (default: from the header)", "text_col": "column of the text",
         "init": "start from a pretrained encoder: minilm, or a model directory (e.g. of --task mlm)",
         "batch_size": "lm: sequences per batch; classify, mlm: at most this many sentences per batch; "
                       "image-classify: images per batch",
         "augment": "shift: move each training image by a random offset (zero-padded); none: as they are",
         "shift_pixels": "--augment shift: the largest offset, in pixels",
         "val_fraction": "without --dev: the share held out for validation",
         "reuse_tokenizer": "reuse the tokenizer already in --out (e.g. made by another process)"}


GROUPS = {  # how --help groups the options of every task; each task's own options follow
    "data and model": ("train", "dev", "out", "preset", "vocab_size", "max_len", "max_tokens", "batch_size",
                       "val_fraction", "reuse_tokenizer", "seed"),
    "optimisation": ("lr", "schedule", "warmup", "min_lr", "label_smoothing", "clip_norm", "weight_decay", "eps",
                     "update_freq"),
    "run": ("minutes", "max_steps", "eval_every", "patience", "save_every", "keep_last", "bf16", "compile",
            "threads", "device", "progress"),
}


def arguments(p) -> None:
    from ..train import TrainArgs
    from ..train.tasks import TASKS
    p.add_argument("--task", choices=list(TASKS), default=None,
                   help="; ".join(f"{name}: {task.summary}" for name, task in TASKS.items()))
    p.add_argument("--config", help="JSON file of training options (flags override it)")
    p.add_argument("--resume", dest="resume_dir", metavar="DIR", help="continue the run saved in DIR exactly")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a model config field, e.g. --set d_model=384 --set norm_placement=post")
    fields = {f.name: f for f in dataclasses.fields(TrainArgs)}
    for title, names in GROUPS.items():
        g = p.add_argument_group(title)
        for name in names:
            _add_option(g, fields[name])
        if title == "optimisation":
            g.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"),
                           help="Adam betas (default 0.9 0.98, the paper's)")
    for name, task in TASKS.items():
        if task.options:
            g = p.add_argument_group(f"--task {name} only")
            for option in task.options:
                _add_option(g, fields[option])
    listed = {n for names in GROUPS.values() for n in names} | {o for t in TASKS.values() for o in t.options}
    missing = set(fields) - listed - {"task", "config_overrides", "betas", "resume"}
    assert not missing, f"TrainArgs fields without a flag group: {sorted(missing)}"


def _add_option(g, f) -> None:
    from ..train.options import CHOICES, RANGES
    from .common import ranged
    flag, kind = "--" + f.name.replace("_", "-"), str(f.type).split(" |")[0]
    if f.name in CHOICES:
        g.add_argument(flag, choices=CHOICES[f.name], default=None, help=HELPS.get(f.name))
    elif kind == "bool":
        g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=HELPS.get(f.name))
    else:
        typ = {"int": int, "float": float}.get(kind, str)
        g.add_argument(flag, type=ranged(typ, *RANGES[f.name]) if f.name in RANGES else typ, default=None,
                       help=(HELPS.get(f.name, "") + f" (default: {f.default})").strip())


def check_task_options(args, task: str) -> None:
    """A flag that only another task reads is a usage error, not silently ignored."""
    from ..train.tasks import TASKS
    for name, other in TASKS.items():
        if name == task:
            continue
        for option in other.options:
            if getattr(args, option, None) is not None:
                raise UsageError(f"--{option.replace('_', '-')} is an option of --task {name} only "
                                 f"(this run is --task {task})")


def run(args) -> int:
    from ..train import TrainArgs, Trainer
    values, saved = options(args)
    train_args = TrainArgs(**values)
    check_task_options(args, train_args.task)
    if not train_args.train:
        raise UsageError("--train is required (a TSV file, or SRC_FILE,TGT_FILE)")
    check_model_options(train_args, saved, args)
    check_writable(train_args.out)
    trainer = Trainer(train_args)
    trainer.setup()
    result = trainer.train()
    # under torchrun every process trains; one reports (the main one: it holds `best`)
    report = print if trainer.is_main else (lambda *a, **k: None)
    report(json.dumps(result))
    if result["stop"] == "interrupted":
        report(f"interrupted at step {result['steps']}: checkpoint saved in {train_args.out}; "
               f"continue with: attnlab train --resume {train_args.out}", file=sys.stderr)
        return 130
    report(f"model saved in {train_args.out}")
    return 0


def options(args) -> tuple[dict, dict | None]:
    """The run's options (saved run < --config < flags), and the saved run's options when resuming."""
    from ..data.readers import read_json
    from ..train import TrainArgs
    from ..train.options import check_train_options
    values = check_train_options(read_json(args.config, "a JSON object of training options"), args.config) \
        if args.config else {}
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArgs)
             if f.name != "config_overrides" and getattr(args, f.name, None) is not None}
    saved = None
    if args.resume_dir:
        saved_path = Path(args.resume_dir) / "training_args.json"
        if not saved_path.exists():
            raise FileNotFoundError(f"--resume {args.resume_dir}: no training_args.json there "
                                    "(not a directory written by attnlab train)")
        saved = check_train_options(read_json(saved_path, "the run's training options"), str(saved_path))
        asked = flags.get("task", values.get("task"))
        if asked and asked != saved.get("task", "translation"):
            raise ValueError(f"--resume {args.resume_dir}: that run is --task {saved.get('task', 'translation')}, "
                             f"not --task {asked}")
        values = {**saved, **values}
        out = flags.pop("out", None)
        if out is not None and Path(out).resolve() != Path(args.resume_dir).resolve():
            raise UsageError(f"--resume {args.resume_dir} continues that run in {args.resume_dir}; drop --out {out} "
                             "(or start a new run with --out alone)")
    values.update(flags)
    if args.resume_dir:
        values.update(resume=True, out=args.resume_dir)
    values["config_overrides"] = model_overrides(values.get("config_overrides", {}), args.set or [])
    if values.get("betas") is not None:
        values["betas"] = tuple(values["betas"])
    else:
        values.pop("betas", None)
    return values, saved


def model_overrides(overrides: dict, items: list[str]) -> dict:
    """config_overrides updated by ``--set FIELD=VALUE`` (VALUE as JSON, else a string); unknown fields
    are an error naming where they came from."""
    from ..config import ConfigError, TransformerConfig
    overrides = dict(overrides)
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set d_model=384")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        where = "--set" if set(unknown) & {i.partition("=")[0] for i in items} else "config_overrides"
        raise ConfigError(f"{where}: unknown model config field(s) {', '.join(unknown)} (known: "
                          f"{', '.join(sorted(known))})")
    return overrides


def check_model_options(train_args, saved: dict | None, args) -> None:
    """Before any data is read: the preset exists, and a resumed run keeps the model it was trained as."""
    from ..config import ConfigError, load_config
    from ..train.tasks import TASKS
    if train_args.preset:
        try:
            load_config(train_args.preset)
        except ConfigError as e:
            raise ConfigError(f"--preset {train_args.preset}: {e}") from None
    if saved is None:
        return
    import zipfile
    ckpt = Path(args.resume_dir) / "checkpoint_last.pt"
    if not ckpt.exists():
        raise FileNotFoundError(f"--resume {args.resume_dir}: no checkpoint_last.pt there, nothing to resume "
                                "(start a new run with --out)")
    if not zipfile.is_zipfile(ckpt):  # torch.save writes a zip: a cut one has no central directory
        raise ValueError(f"{ckpt}: not a readable checkpoint (truncated or corrupt); the weights of the "
                         f"last saved steps are in {Path(args.resume_dir) / 'checkpoints'}")
    default = TASKS[train_args.task].default_preset
    was = load_config(saved.get("preset") or default, **saved.get("config_overrides", {}))
    now = load_config(train_args.preset or default, **train_args.config_overrides)
    from_data = {"name", "vocab_size", "tgt_vocab_size", "share_embeddings", "pad_id", "bos_id", "eos_id", "unk_id"}
    changed = [f"{f.name}={getattr(was, f.name)!r}, not {getattr(now, f.name)!r}" for f in dataclasses.fields(was)
               if f.name not in from_data and getattr(was, f.name) != getattr(now, f.name)]
    if changed:
        raise ValueError(f"--resume {args.resume_dir}: the saved run's model has {'; '.join(changed)}; a resumed "
                         "run keeps its model (start a new run with --out to change it)")


def check_writable(directory) -> None:
    """Fail before any work when the output directory cannot be written (not after an hour of training)."""
    d = Path(directory)
    existing = next((p for p in [d, *d.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"--out {d}: {existing} is a file, not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {d}: {existing} is not writable; choose another --out")
