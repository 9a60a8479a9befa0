"""The ``attnlab`` command line. Each sub-command is a small function over the library."""

from __future__ import annotations

import argparse
import sys

from .config import PRESETS, ConfigError, load_config


def _model_from_spec(spec: str):
    from .model import build_model
    return build_model(load_config(spec))


def cmd_params(args) -> int:
    from .inspect.params import parameter_table
    model = _model_from_spec(args.config)
    cfg = model.config
    print(f"{args.config}: {cfg.family}, d_model={cfg.d_model}, heads={cfg.n_heads}"
          f" (kv {cfg.kv_heads}), layers={cfg.n_encoder_layers if cfg.has_encoder else 0}"
          f"+{cfg.n_decoder_layers if cfg.has_decoder else 0}, d_ff={cfg.d_ff}, vocab={cfg.vocab_size}")
    print(parameter_table(model))
    return 0


def cmd_shapes(args) -> int:
    from .inspect.shapes import shapes_report
    model = _model_from_spec(args.config).eval()
    print(shapes_report(model))
    return 0


def _read_lines(path: str | None) -> list[str]:
    if path in (None, "-"):
        return [l.rstrip("\n") for l in sys.stdin]
    from .data.readers import open_text_lines
    return [l for _, l in open_text_lines(path)]


def _generation_config(args):
    from .generate import GenerationConfig
    return GenerationConfig(
        max_new_tokens=args.max_len, min_new_tokens=getattr(args, "min_len", 0), num_beams=args.beam,
        length_penalty=args.lenpen, do_sample=getattr(args, "sample", False),
        temperature=getattr(args, "temperature", 1.0), top_k=getattr(args, "top_k", 0),
        top_p=getattr(args, "top_p", 1.0), repetition_penalty=getattr(args, "repetition_penalty", 1.0),
        no_repeat_ngram_size=getattr(args, "no_repeat_ngram", 0), seed=getattr(args, "seed", None),
        num_return_sequences=args.nbest if getattr(args, "nbest", 0) else 1)


def _add_generation_flags(p, sampling: bool = False) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy)")
    g.add_argument("--lenpen", type=float, default=0.6, help="GNMT length penalty alpha for beam search")
    g.add_argument("--max-len", type=int, default=None,
                   help="max new tokens (default: source length + 50 for translation, 128 for LMs)")
    g.add_argument("--min-len", type=int, default=0, help="min new tokens before EOS is allowed")
    g.add_argument("--no-repeat-ngram", type=int, default=0, help="forbid repeating n-grams of this size")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    if sampling:
        g.add_argument("--sample", action="store_true", help="sample instead of greedy/beam")
        g.add_argument("--temperature", type=float, default=1.0)
        g.add_argument("--top-k", type=int, default=0)
        g.add_argument("--top-p", type=float, default=1.0)
        g.add_argument("--seed", type=int, default=None)


def cmd_train(args) -> int:
    import dataclasses
    import json

    from .train import TrainArgs, Trainer
    values = {}
    if args.config:
        from pathlib import Path
        try:
            values = json.loads(Path(args.config).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.config}:{e.lineno}: not valid JSON ({e.msg})") from None
        known = {f.name for f in dataclasses.fields(TrainArgs)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{args.config}: unknown training option(s) {', '.join(unknown)}")
    for f in dataclasses.fields(TrainArgs):
        v = getattr(args, f.name, None)
        if v is not None and f.name not in ("config_overrides",):
            values[f.name] = v
    if args.resume_dir:
        values.update(out=args.resume_dir, resume=True)
        saved = json.loads((__import__("pathlib").Path(args.resume_dir) / "training_args.json").read_text())
        values = {**saved, **{k: v for k, v in values.items() if getattr(args, k, None) is not None}, "resume": True,
                  "out": args.resume_dir}
    overrides = dict(values.get("config_overrides", {}))
    for item in args.set or []:
        key, _, raw = item.partition("=")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    values["config_overrides"] = overrides
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    train_args = TrainArgs(**values)
    if not train_args.train:
        raise ValueError("--train is required (a TSV file, or SRC_FILE,TGT_FILE)")
    trainer = Trainer(train_args)
    trainer.setup()
    result = trainer.train()
    print(json.dumps(result))
    print(f"model saved in {train_args.out}")
    return 0


def cmd_translate(args) -> int:
    from .generate.translate import translate
    from .modeldir import load
    model, src_tok, tgt_tok = load(args.model, _device(args))
    lines = [args.text] if args.text else _read_lines(args.input)
    out = translate(model, src_tok, tgt_tok, lines, _generation_config(args), batch_size=args.batch_size,
                    nbest=bool(args.nbest))
    for item in out:
        if args.nbest:
            for text, score in item:
                print(f"{score:.4f}\t{text}")
            print()
        else:
            print(item)
    return 0


def cmd_evaluate(args) -> int:
    import json

    from .evaluate import corpus_scores
    from .generate.translate import translate
    from .modeldir import load
    if args.data:
        from .data.readers import read_tsv_pairs
        pairs = read_tsv_pairs(args.data, args.src_col, args.tgt_col)
        src, ref = pairs.src, pairs.tgt
    else:
        if not (args.src and args.ref):
            raise ValueError("give --src and --ref files (or --data TSV)")
        src, ref = _read_lines(args.src), _read_lines(args.ref)
        if len(src) != len(ref):
            raise ValueError(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    model, src_tok, tgt_tok = load(args.model, _device(args))
    hyps = translate(model, src_tok, tgt_tok, src, _generation_config(args), batch_size=args.batch_size)
    scores = corpus_scores(hyps, ref)
    if args.json:
        print(json.dumps({k: scores[k] for k in ("bleu", "chrf", "n", "tokenize")}))
    else:
        print(f"sacreBLEU {scores['bleu']:.2f} (tokenize={scores['tokenize']})  chrF {scores['chrf']:.2f}  "
              f"n={scores['n']}")
    return 0


def cmd_attention(args) -> int:
    from .generate.translate import translate
    from .inspect.attention import attention_maps, plot_attention
    from .modeldir import load
    model, src_tok, tgt_tok = load(args.model, _device(args))
    if model.config.family != "encoder-decoder":
        raise ValueError("attnlab attention draws encoder-decoder models (encoder, decoder and cross-attention)")
    translation = translate(model, src_tok, tgt_tok, [args.sentence])[0]
    ids = tgt_tok.encode(translation) + [tgt_tok.eos_id]
    plot_attention(attention_maps(model, src_tok, tgt_tok, args.sentence, ids), args.out,
                   f"{args.sentence} → {translation}")
    print(f"{args.sentence} → {translation}\nattention maps written to {args.out}")
    return 0


def cmd_average(args) -> int:
    from .train import average_checkpoints
    out = average_checkpoints(args.model, args.last, args.out)
    print(f"averaged the last {args.last} checkpoints of {args.model} into {out}")
    return 0


def cmd_generate(args) -> int:
    import torch

    from .data.batching import pad_batch
    from .generate import GenerationConfig
    from .generate.search import DecoderOnlyStepper, stream_tokens
    from .generate import generate
    from .modeldir import load
    model, tok, _ = load(args.model, _device(args))
    if model.config.family != "decoder-only":
        raise ValueError(f"attnlab generate needs a decoder-only model; {args.model} is {model.config.family} "
                         "(use attnlab translate)")
    prompts = [args.prompt] if args.prompt not in (None, "-") else _read_lines("-")
    cfg = _generation_config(args)
    for text in prompts:
        ids = tok.encode(text, bos=model.config.bos_id != model.config.eos_id)
        x = torch.tensor([ids], device=model.device)
        if args.stream and cfg.num_beams == 1:
            print(text, end="", flush=True)
            out: list[int] = []
            stepper = DecoderOnlyStepper(model, x, None)
            max_new = cfg.max_new_tokens or 128
            if model.config.positions == "learned":
                max_new = min(max_new, model.config.max_len - x.shape[1])
            shown = ""
            with torch.no_grad():
                for _, t in stream_tokens(stepper, 1, None, cfg, model.config.eos_id, max_new, [ids]):
                    if t.item() == model.config.eos_id:
                        break
                    out.append(t.item())
                    full = tok.decode(ids + out)[len(tok.decode(ids)):]
                    print(full[len(shown):], end="", flush=True)
                    shown = full
            print()
        else:
            res = generate(model, x, None, cfg)
            print(tok.decode(ids + res.sequences[0]))
    return 0


def _device(args):
    from .train.trainer import pick_device
    return pick_device(getattr(args, "device", "auto") or "auto")


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(minutes=args.minutes, out=args.out, threads=args.threads)


EXAMPLES = {
    "params": "attnlab params paper-base\n  attnlab params my_config.json",
    "shapes": "attnlab shapes mt-tiny\n  attnlab shapes llama-mini",
    "demo": "attnlab demo                 # ~10 minutes on 2 CPU cores\n  attnlab demo --minutes 3",
    "train": ("attnlab train --train data/train.tsv.gz --dev data/dev.tsv --out runs/enzh --minutes 30 --bf16\n"
              "  attnlab train --train train.de.gz,train.en.gz --dev val.de.gz,val.en.gz --preset mt-small \\\n"
              "      --set d_model=384 --max-tokens 4000 --max-steps 20000\n"
              "  attnlab train --resume runs/enzh --minutes 60     # continue exactly where it stopped\n"
              "  torchrun --nproc_per_node 2 -m attnlab train --train ... --out runs/ddp"),
    "translate": ('echo "I love coding." | attnlab translate --model runs/enzh\n'
                  "  attnlab translate --model runs/enzh --input sentences.txt --beam 4 --lenpen 0.6\n"
                  "  attnlab translate --model runs/enzh --text 'How are you?' --beam 4 --nbest 4"),
    "evaluate": ("attnlab evaluate --model runs/enzh --src test.en --ref test.zh --json\n"
                 "  attnlab evaluate --model runs/enzh --data test.tsv --beam 4"),
    "attention": 'attnlab attention --model runs/enzh "I love coding." --out attn.png',
    "average": "attnlab average --model runs/enzh --last 5",
    "generate": ('attnlab generate --model runs/lm --prompt "ROMEO:" --sample --top-k 50 --stream\n'
                 '  echo "Once upon a time" | attnlab generate --model runs/lm --prompt - --beam 4'),
}


def _add_train_flags(p) -> None:
    import dataclasses

    from .train import TrainArgs
    p.add_argument("--config", help="JSON file of training options (flags override it)")
    p.add_argument("--resume", dest="resume_dir", metavar="DIR", help="continue the run saved in DIR exactly")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a model config field, e.g. --set d_model=384 --set norm_placement=post")
    helps = {"train": "TSV file (src<TAB>tgt[<TAB>...], .gz ok) or SRC_FILE,TGT_FILE",
             "dev": "dev set, same formats", "out": "model directory", "minutes": "time budget",
             "max_tokens": "tokens per batch (per process)", "update_freq": "gradient accumulation steps",
             "lr": "peak learning rate (default: the paper's d^-0.5 warmup^-0.5)",
             "schedule": "inverse_sqrt (the paper's) | cosine | constant", "bf16": "bf16 autocast",
             "compile": "torch.compile the model", "preset": "model preset or config.json",
             "zh_simplified": "convert Traditional Chinese targets to Simplified (needs attnlab[zh])",
             "reverse": "swap the TSV columns' direction", "joint_vocab": "one BPE vocabulary for both sides",
             "patience": "early stopping after N evaluations without BLEU improvement"}
    for f in dataclasses.fields(TrainArgs):
        if f.name in ("config_overrides", "betas", "resume"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helps.get(f.name))
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0], str)
            if "float" in str(f.type):
                typ = float
            elif "int" in str(f.type):
                typ = int
            p.add_argument(flag, type=typ, default=None,
                           help=(helps.get(f.name, "") + f" (default: {f.default})").strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The Transformer of 'Attention Is All You Need': build, train, run, inspect.",
        epilog="presets: " + ", ".join(PRESETS))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str, fn):
        p = sub.add_parser(name, help=help, description=help,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples:\n  " + EXAMPLES.get(name, ""))
        p.set_defaults(fn=fn)
        return p

    p = add("demo", "the main job: train English→Chinese on the shipped corpus, evaluate, translate, draw", cmd_demo)
    p.add_argument("--minutes", type=float, default=10.0, help="training time budget (default 10)")
    p.add_argument("--out", default="runs/demo", help="model directory (default runs/demo)")
    p.add_argument("--threads", type=int, default=None)
    p = add("train", "train a translation model (teacher forcing, label smoothing, warmup, checkpoints)", cmd_train)
    _add_train_flags(p)
    p = add("translate", "translate sentences (stdin, --input file or --text) with a trained model", cmd_translate)
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--input", help="file with one sentence per line (default: stdin)")
    p.add_argument("--text", help="translate this one sentence")
    p.add_argument("--nbest", type=int, default=0, help="print the N best hypotheses with scores (beam)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    _add_generation_flags(p)
    p = add("evaluate", "sacreBLEU (zh tokenizer for Chinese, 13a otherwise) and chrF on a test set", cmd_evaluate)
    p.add_argument("--model", required=True)
    p.add_argument("--src", help="source sentences, one per line")
    p.add_argument("--ref", help="reference translations, one per line")
    p.add_argument("--data", help="or a TSV of pairs")
    p.add_argument("--src-col", type=int, default=0)
    p.add_argument("--tgt-col", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object with bleu, chrf, n")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    _add_generation_flags(p)
    p = add("attention", "draw encoder, decoder and cross-attention maps for one sentence", cmd_attention)
    p.add_argument("--model", required=True)
    p.add_argument("sentence")
    p.add_argument("--out", default="attention.png")
    p.add_argument("--device", default="cpu")
    p = add("average", "average the last N checkpoints (as the paper does)", cmd_average)
    p.add_argument("--model", required=True)
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--out", default=None, help="output file (default: MODEL/model.safetensors)")
    p = add("generate", "generate text with a decoder-only model", cmd_generate)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="-", help='prompt text, or "-" for one prompt per stdin line')
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--device", default="auto")
    _add_generation_flags(p, sampling=True)
    p = add("params", "per-module parameter table and total (vs the 12·L·d² rule of thumb)", cmd_params)
    p.add_argument("config", help="preset name, config.json, or model directory")
    p = add("shapes", "tensor shape after every stage of a forward pass on a sample batch", cmd_shapes)
    p.add_argument("config", help="preset name, config.json, or model directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "build_parser"]
