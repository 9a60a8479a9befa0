"""attnlab evaluate: the metric of the model's task on held-out data (BLEU/chrF, perplexity, accuracy,
masked-token accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

from .common import add_device, add_generation, add_model, generation_config, load, nonneg_int, positive_int, \
    read_lines

HELP = ("translation: sacreBLEU (zh tokenizer for Chinese, 13a otherwise) and chrF; lm: loss and perplexity; "
        "classify, image-classify: accuracy, macro-F1, confusion matrix; mlm: masked-token loss and accuracy; "
        "span: span-corruption loss and accuracy")
EXAMPLES = """attnlab evaluate --model runs/enzh --src test.en --ref test.zh --json
  attnlab evaluate --model runs/enzh --data test.tsv --beam 4
  attnlab evaluate --task lm --model runs/shakespeare --data val.txt
  attnlab evaluate --task classify --model runs/sst2 --data test.tsv --confusion-png cm.png
  attnlab evaluate --task mlm --model runs/mlm --data held_out.txt
  attnlab evaluate --task image-classify --model runs/vit --test mnist10k/dev.npz --json"""


def arguments(p) -> None:
    from ..train.tasks import TASKS
    p.add_argument("--task", choices=list(TASKS), help="default: what the model was trained for")
    add_model(p)
    p.add_argument("--data", "--test", dest="data", help="a TSV of pairs (translation), a text file (lm, mlm), "
                   "labelled rows (classify), a .npz or a folder of class folders (image-classify)")
    p.add_argument("--src", help="translation: source sentences, one per line")
    p.add_argument("--ref", help="translation: reference translations, one per line")
    p.add_argument("--src-col", type=nonneg_int, default=0)
    p.add_argument("--tgt-col", type=nonneg_int, default=1)
    p.add_argument("--block-size", type=positive_int, default=None, help="lm: tokens per evaluation block")
    p.add_argument("--label-col", type=nonneg_int, default=None)
    p.add_argument("--text-col", type=nonneg_int, default=None)
    p.add_argument("--confusion-png", default=None, help="classify: draw the confusion matrix here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--batch-size", type=positive_int, default=64)
    add_device(p)
    add_generation(p)


def run(args) -> int:
    from ..modeldir import load_task_info
    task = load_task_info(args.model)["task"]
    if args.task and args.task != task:
        raise ValueError(f"--task {args.task}: {args.model} was trained for --task {task} (see its task.json)")
    if task in ("lm", "mlm", "classify", "image-classify", "span") and not args.data:
        raise ValueError(f"attnlab evaluate --task {task} needs --data FILE")
    if task not in EVALUATORS:
        raise ValueError(f"{args.model}: attnlab evaluate does not know --task {task} (see its task.json)")
    return EVALUATORS[task](args)


def _print(args, scores: dict, keys: tuple, line: str) -> int:
    print(json.dumps({k: scores[k] for k in keys}) if args.json else line)
    return 0


def _translation(args) -> int:
    if args.data:
        from ..data.readers import read_tsv_pairs
        pairs = read_tsv_pairs(args.data, args.src_col, args.tgt_col)
        src, ref = pairs.src, pairs.tgt
    else:
        if not (args.src and args.ref):
            raise ValueError("give --src and --ref files (or --data TSV)")
        src, ref = read_lines(args.src, "source sentences"), read_lines(args.ref, "reference translations")
        if len(src) != len(ref):
            raise ValueError(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    s = load(args).score(src, ref, generation_config(args), batch_size=args.batch_size)
    return _print(args, s, ("bleu", "chrf", "n", "tokenize"),
                  f"sacreBLEU {s['bleu']:.2f} (tokenize={s['tokenize']})  chrF {s['chrf']:.2f}  n={s['n']}")


def _lm(args) -> int:
    from ..data.readers import read_text
    s = load(args).score(read_text(args.data), block_size=args.block_size)
    return _print(args, s, ("loss", "perplexity", "tokens", "block_size"),
                  f"loss {s['loss']:.4f}  perplexity {s['perplexity']:.3f}  ({s['tokens']:,} tokens, "
                  f"blocks of {s['block_size']})")


def _mlm(args) -> int:
    from ..data.readers import read_text
    s = load(args).score(read_text(args.data))
    return _print(args, s, ("mlm_loss", "mlm_accuracy", "masked_tokens"),
                  f"masked-LM loss {s['mlm_loss']:.4f}  accuracy {s['mlm_accuracy']:.4f}  "
                  f"({s['masked_tokens']:,} masked tokens)")


def _span(args) -> int:
    """Span-corruption loss and target-token accuracy on held-out lines, corrupted once with a fixed
    seed as the trainer's dev split is: two checkpoints are scored on the same gaps."""
    from types import SimpleNamespace

    import torch

    from ..data.readers import read_text
    from ..train.tasks.span import SpanCorruptionTask, sentinel_ids
    model = load(args)
    info = model.task
    task = SpanCorruptionTask()
    task.tok, task.sentinels = model.tokenizer, sentinel_ids(model.tokenizer)
    task.args = SimpleNamespace(max_len=info["max_len"], noise_density=info["noise_density"],
                                mean_span_length=info["mean_span_length"])
    rows, _ = task._rows([l.strip() for l in read_text(args.data).splitlines() if l.strip()])  # as training reads
    g = torch.Generator().manual_seed(1)
    task.dev_pairs = [task._corrupt(ids, g) for ids in rows]
    s = task.evaluate(model.module, model.device, False)
    return _print(args, s, ("dev_span_loss", "dev_span_accuracy", "tokens"),
                  f"span loss {s['dev_span_loss']:.4f}  accuracy {s['dev_span_accuracy']:.4f}  "
                  f"({s['tokens']:,} target tokens)")


def _classify(args) -> int:
    from ..data.readers import read_labeled
    from ..modeldir import load_task_info
    labels = load_task_info(args.model)["labels"]
    data = read_labeled(args.data, args.label_col, args.text_col, known_labels=labels)
    return _classification_report(args, labels, load(args).score(data.texts, data.labels))


def _image_classify(args) -> int:
    from ..data.images import read_images
    from ..modeldir import load_task_info
    labels = load_task_info(args.model)["labels"]
    data = read_images(args.data, known_labels=labels)
    model = load(args)
    cfg = model.config
    if (data.channels, data.size) != (cfg.n_channels, (cfg.image_size, cfg.image_size)):
        from ..data.readers import DataError
        raise DataError(f"{args.data}: images are {data.size[1]}×{data.size[0]}×{data.channels}, but the model reads "
                        f"{cfg.image_size}×{cfg.image_size}×{cfg.n_channels}")
    return _classification_report(args, labels, model.score(data.images.permute(0, 2, 3, 1), data.labels))


def _classification_report(args, labels: list[str], s: dict) -> int:
    """Accuracy, macro-F1 and n (and the confusion matrix, as text and with --confusion-png drawn)."""
    from ..evaluate.classification import confusion_text, plot_confusion
    if args.confusion_png:
        plot_confusion(s["confusion"], labels, args.confusion_png, f"{Path(args.data).name}: accuracy {s['accuracy']:.4f}")
    if args.json:
        return _print(args, s, ("accuracy", "macro_f1", "n", "confusion"), "")
    print(f"accuracy {s['accuracy']:.4f}  macro-F1 {s['macro_f1']:.4f}  n={s['n']}")
    print(confusion_text(s["confusion"], labels))
    if args.confusion_png:
        print(f"confusion matrix drawn in {args.confusion_png}")
    return 0


EVALUATORS = {"translation": _translation, "lm": _lm, "mlm": _mlm, "classify": _classify,
              "image-classify": _image_classify, "span": _span}
