"""Every option of ``attnlab train``, what each may hold, and the check that names a bad one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TrainArgs:
    """Every option of ``attnlab train`` (saved as training_args.json)."""
    out: str = "runs/model"
    task: str = "translation"       # translation | lm | classify
    train: str = ""                 # TSV file, or SRC_FILE,TGT_FILE; text for lm; labelled rows for classify
    dev: str = ""
    src_col: int = 0
    tgt_col: int = 1
    reverse: bool = False
    zh_simplified: bool = False     # OpenCC Traditional → Simplified on the Chinese target
    source_prefix: str = ""         # translation: T5's task prefix, before every source (kept in task.json)
    label_col: int | None = None    # classify: column of the label (default: found from the header)
    text_col: int | None = None     # classify: column of the text
    init: str = ""                  # classify: start from a pretrained encoder: minilm, or a model directory (e.g. --task mlm)
    augment: str = "none"           # image-classify: none | shift (random translation of each training image)
    shift_pixels: int = 2           # image-classify: --augment shift moves images by up to this many pixels
    tokenizer: str = "bpe"          # lm: char | bpe
    block_size: int = 256           # lm: tokens per training sequence
    noise_density: float = 0.15     # span: share of each example's tokens dropped (T5: 0.15)
    mean_span_length: float = 3.0   # span: average tokens per dropped span (T5: 3)
    batch_size: int = 32            # lm: sequences per batch; classify: max sentences per batch
    val_fraction: float = 0.1       # lm/classify without --dev: the held-out tail / seeded share
    eval_batches: int = 0           # lm: cap on validation blocks (0 = the whole split)
    reuse_tokenizer: bool = False   # use the tokenizer already in --out (e.g. shared by torchrun workers)
    preset: str = ""                # model preset or config.json; "": the task's default_preset
    config_overrides: dict = field(default_factory=dict)
    vocab_size: int = 8000          # per side (separate) or joint
    joint_vocab: bool = False
    max_len: int = 128              # tokens per side; longer pairs are filtered (counted)
    max_tokens: int = 4000          # tokens per batch (per process)
    update_freq: int = 1
    lr: float | None = None         # peak learning rate; None: the paper's d^-0.5 · warmup^-0.5
    schedule: str = "inverse_sqrt"  # inverse_sqrt (= the paper's), cosine, constant
    warmup: int = 4000
    min_lr: float = 0.0
    label_smoothing: float | None = None  # None: the task's default (0.1 translation, 0 lm/classify)
    clip_norm: float = 1.0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.98)
    eps: float = 1e-9
    bf16: bool = False
    compile: bool = False
    seed: int = 1
    max_steps: int | None = None
    minutes: float | None = None
    eval_every: int = 500
    eval_sentences: int = 300       # dev subset for BLEU during training
    beam: int = 1                   # beam size for dev BLEU
    patience: int = 0               # early stopping after N evaluations without improvement (0: off)
    save_every: int = 500
    keep_last: int = 5              # step checkpoints kept for `attnlab average`
    resume: bool = False
    threads: int | None = None
    progress: bool = True
    device: str = "auto"


# What each option may hold; checked for flags (a usage error) and for --config files (naming the file).
RANGES = {
    "minutes": ("> 0", lambda v: v > 0), "max_steps": (">= 1", lambda v: v >= 1),
    "max_tokens": (">= 1", lambda v: v >= 1), "update_freq": (">= 1", lambda v: v >= 1),
    "lr": ("> 0", lambda v: v > 0), "warmup": (">= 0", lambda v: v >= 0), "min_lr": (">= 0", lambda v: v >= 0),
    "label_smoothing": ("in [0, 1)", lambda v: 0 <= v < 1), "clip_norm": (">= 0", lambda v: v >= 0),
    "weight_decay": (">= 0", lambda v: v >= 0), "eps": ("> 0", lambda v: v > 0),
    "eval_every": (">= 0", lambda v: v >= 0), "eval_sentences": (">= 1", lambda v: v >= 1),
    "beam": (">= 1", lambda v: v >= 1), "patience": (">= 0", lambda v: v >= 0),
    "save_every": (">= 0", lambda v: v >= 0), "keep_last": (">= 1", lambda v: v >= 1),
    "threads": (">= 1", lambda v: v >= 1), "vocab_size": (">= 16", lambda v: v >= 16),
    "max_len": (">= 2", lambda v: v >= 2), "block_size": (">= 1", lambda v: v >= 1),
    "batch_size": (">= 1", lambda v: v >= 1), "val_fraction": ("in (0, 1)", lambda v: 0 < v < 1),
    "eval_batches": (">= 0", lambda v: v >= 0), "src_col": (">= 0", lambda v: v >= 0),
    "tgt_col": (">= 0", lambda v: v >= 0), "label_col": (">= 0", lambda v: v >= 0),
    "text_col": (">= 0", lambda v: v >= 0), "shift_pixels": (">= 1", lambda v: v >= 1),
    "noise_density": ("in (0, 1)", lambda v: 0 < v < 1), "mean_span_length": (">= 1", lambda v: v >= 1),
}
CHOICES = {"schedule": ("inverse_sqrt", "cosine", "constant"), "tokenizer": ("bpe", "char"),
           "augment": ("none", "shift")}


def check_train_options(values: dict, source: str) -> dict:
    """Unknown names, wrong types and out-of-range values of training options, named with their
    source (a --config file, training_args.json); returns the values with JSON lists made tuples."""
    fields = {f.name: f for f in dataclasses.fields(TrainArgs)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{source}: unknown training option(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(fields))})")
    out = dict(values)
    for name, v in values.items():
        kind = str(fields[name].type)
        if v is None and "None" in kind:
            continue
        ok = {"bool": isinstance(v, bool), "dict": isinstance(v, dict), "str": isinstance(v, str),
              "tuple": isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v),
              "int": isinstance(v, int) and not isinstance(v, bool),
              "float": isinstance(v, (int, float)) and not isinstance(v, bool)}[kind.split(" |")[0]]
        if not ok:
            raise ValueError(f"{source}: option {name!r} must be {kind.split(' |')[0]}, got {v!r}")
        if name in RANGES and not RANGES[name][1](v):
            raise ValueError(f"{source}: option {name!r} = {v!r} must be {RANGES[name][0]}")
        if name in CHOICES and v not in CHOICES[name]:
            raise ValueError(f"{source}: option {name!r} = {v!r} must be one of {', '.join(CHOICES[name])}")
        if kind == "tuple":
            out[name] = tuple(v)
    return out
