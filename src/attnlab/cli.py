"""The ``attnlab`` command line. Each sub-command is a small function over the library."""

from __future__ import annotations

import argparse
import sys

from .config import PRESETS, ConfigError, load_config


# -- argument types: a bad value is a usage error (exit 2) that names the flag ---------------------------


class UsageError(ValueError):
    """A wrong or missing command-line argument found after parsing: exit status 2, as argparse's own."""


def _ranged(kind, text: str, ok):
    def parse(raw: str):
        try:
            v = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {'an integer' if kind is int else 'a number'}") from None
        if v != v or not ok(v):
            raise argparse.ArgumentTypeError(f"{raw} is out of range: must be {text}")
        return v
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = _ranged(int, ">= 1", lambda v: v >= 1)
nonneg_int = _ranged(int, ">= 0", lambda v: v >= 0)
positive_float = _ranged(float, "> 0", lambda v: v > 0)
nonneg_float = _ranged(float, ">= 0", lambda v: v >= 0)
probability = _ranged(float, "in (0, 1]", lambda v: 0 < v <= 1)


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
        num_return_sequences=args.nbest if getattr(args, "nbest", 0) else 1,
        compile=getattr(args, "compile_step", False))


def _add_generation_flags(p, sampling: bool = False) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--beam", type=positive_int, default=1, help="beam size (1 = greedy)")
    g.add_argument("--lenpen", type=nonneg_float, default=0.6, help="GNMT length penalty alpha for beam search")
    g.add_argument("--max-len", type=positive_int, default=None,
                   help="max new tokens (default: source length + 50 for translation, 128 for LMs)")
    g.add_argument("--min-len", type=nonneg_int, default=0, help="min new tokens before EOS is allowed")
    g.add_argument("--no-repeat-ngram", type=nonneg_int, default=0, help="forbid repeating n-grams of this size")
    g.add_argument("--repetition-penalty", type=positive_float, default=1.0)
    g.add_argument("--compile", dest="compile_step", action="store_true",
                   help="torch.compile the decode step (about a minute to compile a 30-layer model on "
                        "2 CPU cores, then the fastest bf16 decoding; for long or repeated generation; "
                        "skipped on CPU in fp32, where the eager path is faster)")
    if sampling:
        g.add_argument("--sample", action="store_true", help="sample instead of greedy/beam")
        g.add_argument("--temperature", type=positive_float, default=1.0,
                       help="sampling temperature (> 0; for deterministic output drop --sample)")
        g.add_argument("--top-k", type=nonneg_int, default=0)
        g.add_argument("--top-p", type=probability, default=1.0)
        g.add_argument("--seed", type=int, default=None)


def cmd_train(args) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from .train import TrainArgs, Trainer
    from .train.trainer import check_train_options
    values = {}
    if args.config:
        values = check_train_options(_read_json(args.config, "a JSON object of training options"), args.config)
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArgs)
             if f.name != "config_overrides" and getattr(args, f.name, None) is not None}
    if args.resume_dir:
        saved_path = Path(args.resume_dir) / "training_args.json"
        if not saved_path.exists():
            raise FileNotFoundError(f"--resume {args.resume_dir}: no training_args.json there "
                                    "(not a directory written by attnlab train)")
        saved = check_train_options(_read_json(saved_path, "the run's training options"), str(saved_path))
        asked = flags.get("task", values.get("task"))
        if asked and asked != saved.get("task", "translation"):
            raise ValueError(f"--resume {args.resume_dir}: that run is --task {saved.get('task', 'translation')}, "
                             f"not --task {asked}")
        # saved options, then --config, then flags: what the user gives now wins
        values = {**saved, **values}
        values.update(resume=True, out=args.resume_dir)
    values.update(flags)
    overrides = dict(values.get("config_overrides", {}))
    for item in args.set or []:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set d_model=384")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    values["config_overrides"] = overrides
    from .config import TransformerConfig
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TransformerConfig)})
    if unknown:
        given = {item.partition("=")[0] for item in args.set or []}
        where = "--set" if set(unknown) & given else "config_overrides"
        raise ConfigError(f"{where}: unknown model config field(s) {', '.join(unknown)} (known: "
                          f"{', '.join(sorted(f.name for f in dataclasses.fields(TransformerConfig)))})")
    if values.get("betas") is not None:
        values["betas"] = tuple(values["betas"])
    else:
        values.pop("betas", None)
    train_args = TrainArgs(**values)
    if not train_args.train:
        raise UsageError("--train is required (a TSV file, or SRC_FILE,TGT_FILE)")
    if train_args.preset:  # before reading data and training a tokenizer
        try:
            load_config(train_args.preset)
        except ConfigError as e:
            raise ConfigError(f"--preset {train_args.preset}: {e}") from None
    if args.resume_dir:
        import zipfile
        ckpt = Path(args.resume_dir) / "checkpoint_last.pt"
        if not ckpt.exists():
            raise FileNotFoundError(f"--resume {args.resume_dir}: no checkpoint_last.pt there, nothing to resume "
                                    "(start a new run with --out)")
        if not zipfile.is_zipfile(ckpt):  # torch.save writes a zip: a cut one has no central directory
            raise ValueError(f"{ckpt}: not a readable checkpoint (truncated or corrupt); the weights of the "
                             f"last saved steps are in {Path(args.resume_dir) / 'checkpoints'}")
        # the saved weights only fit the model they were trained as (--preset, --set)
        from .train.tasks import TASKS
        default = getattr(TASKS.get(train_args.task), "default_preset", "mt-small")
        was = load_config(saved.get("preset") or default, **saved.get("config_overrides", {}))
        now = load_config(train_args.preset or default, **train_args.config_overrides)
        from_data = {"name", "vocab_size", "tgt_vocab_size", "share_embeddings", "pad_id", "bos_id", "eos_id", "unk_id"}
        changed = [f"{f.name}={getattr(was, f.name)!r}, not {getattr(now, f.name)!r}" for f in dataclasses.fields(was)
                   if f.name not in from_data and getattr(was, f.name) != getattr(now, f.name)]
        if changed:
            raise ValueError(f"--resume {args.resume_dir}: the saved run's model has {'; '.join(changed)}; a resumed "
                             "run keeps its model (start a new run with --out to change it)")
    _check_writable(train_args.out)
    trainer = Trainer(train_args)
    trainer.setup()
    result = trainer.train()
    print(json.dumps(result))
    if result["stop"] == "interrupted":
        print(f"interrupted at step {result['steps']}: checkpoint saved in {train_args.out}; "
              f"continue with: attnlab train --resume {train_args.out}", file=sys.stderr)
        return 130
    print(f"model saved in {train_args.out}")
    return 0


def _read_json(path, what: str):
    import json
    from pathlib import Path
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        value = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not UTF-8 text (expected {what})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg}); expected {what}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{p}: expected {what}, found a JSON {type(value).__name__}")
    return value


def _check_writable(directory) -> None:
    """Fail before any work when the output directory cannot be written (not after an hour of training)."""
    import os
    from pathlib import Path
    d = Path(directory)
    existing = next((p for p in [d, *d.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"--out {d}: {existing} is a file, not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {d}: {existing} is not writable; choose another --out")


def cmd_translate(args) -> int:
    from .data.readers import read_lines
    from .generate.translate import translate
    from .modeldir import load
    lines = [args.text] if args.text else _read_lines(args.input) if args.input in (None, "-") else \
        read_lines(args.input, "sentences to translate")
    model, src_tok, tgt_tok = load(args.model, _device(args), need_tokenizer=True)
    if model.config.family != "encoder-decoder":
        raise ValueError(f"{args.model} is {model.config.family}; attnlab translate needs an "
                         "encoder-decoder (attnlab generate runs decoder-only models)")
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
    from pathlib import Path

    from .modeldir import load
    from .train.tasks import load_task_info
    info = load_task_info(args.model)
    if args.task and args.task != info["task"]:
        if (Path(args.model) / "task.json").exists():
            raise ValueError(f"--task {args.task}: {args.model} was trained for --task {info['task']} "
                             f"(see its task.json)")
        if args.task == "classify":
            raise ValueError(f"--task classify: {args.model} has no task.json (where a classifier keeps its "
                             "labels)")
    task = args.task or info["task"]
    if task == "lm":
        return _evaluate_lm(args, info)
    if task == "classify":
        return _evaluate_classify(args, info)
    if task == "mlm":
        return _evaluate_mlm(args, info)
    from .evaluate import corpus_scores
    from .generate.translate import translate
    if args.data:
        from .data.readers import read_tsv_pairs
        pairs = read_tsv_pairs(args.data, args.src_col, args.tgt_col)
        src, ref = pairs.src, pairs.tgt
    else:
        if not (args.src and args.ref):
            raise ValueError("give --src and --ref files (or --data TSV)")
        from .data.readers import read_lines
        src = _read_lines(args.src) if args.src == "-" else read_lines(args.src, "source sentences")
        ref = _read_lines(args.ref) if args.ref == "-" else read_lines(args.ref, "reference translations")
        if len(src) != len(ref):
            raise ValueError(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    model, src_tok, tgt_tok = load(args.model, _device(args), need_tokenizer=True)
    if model.config.family != "encoder-decoder":
        raise ValueError(f"{args.model} is {model.config.family}; translation scores need an "
                         "encoder-decoder (--task lm or classify for other models)")
    hyps = translate(model, src_tok, tgt_tok, src, _generation_config(args), batch_size=args.batch_size)
    scores = corpus_scores(hyps, ref)
    if args.json:
        print(json.dumps({k: scores[k] for k in ("bleu", "chrf", "n", "tokenize")}))
    else:
        print(f"sacreBLEU {scores['bleu']:.2f} (tokenize={scores['tokenize']})  chrF {scores['chrf']:.2f}  "
              f"n={scores['n']}")
    return 0


def _evaluate_lm(args, info) -> int:
    import json

    import torch

    from .data.readers import read_text
    from .modeldir import load
    from .train.tasks import lm_loss
    if not args.data:
        raise ValueError("attnlab evaluate --task lm needs --data TEXT_FILE")
    model, tok, _ = load(args.model, _device(args), need_tokenizer=True)
    ids = torch.tensor(tok.encode(read_text(args.data)), dtype=torch.long)
    block = args.block_size or info.get("block_size") or model.config.max_len
    r = lm_loss(model, ids, block, model.device)
    out = {"loss": r["val_loss"], "perplexity": r["val_ppl"], "tokens": r["tokens"], "block_size": block}
    print(json.dumps(out) if args.json else f"loss {out['loss']:.4f}  perplexity {out['perplexity']:.3f}  "
          f"({out['tokens']:,} tokens, blocks of {block})")
    return 0


def _evaluate_mlm(args, info) -> int:
    import json

    from .data.readers import read_text
    from .modeldir import load
    from .train.tasks import mlm_rows, mlm_scores
    if not args.data:
        raise ValueError("attnlab evaluate --task mlm needs --data TEXT_FILE (one example per line)")
    model, tok, _ = load(args.model, _device(args), need_tokenizer=True)
    if tok.mask_id is None:
        raise ValueError(f"{args.model}: its tokenizer has no <mask> token (not a --task mlm model)")
    lines = [l.strip() for l in read_text(args.data).splitlines() if l.strip()]
    r = mlm_scores(model, mlm_rows(tok, lines, info.get("max_len", model.config.max_len)), tok, model.device)
    out = {"mlm_loss": r["dev_mlm_loss"], "mlm_accuracy": r["dev_mlm_accuracy"], "masked_tokens": r["tokens"]}
    print(json.dumps(out) if args.json else f"masked-LM loss {out['mlm_loss']:.4f}  accuracy "
          f"{out['mlm_accuracy']:.4f}  ({out['masked_tokens']:,} masked tokens)")
    return 0


def _evaluate_classify(args, info) -> int:
    import json

    from .data.readers import read_labeled
    from .evaluate.classification import classification_scores, confusion_text, plot_confusion
    from .modeldir import load
    from .train.tasks import encode_for_classifier, predict_classes
    if not args.data:
        raise ValueError("attnlab evaluate --task classify needs --data FILE (label and text columns)")
    labels = info["labels"]
    data = read_labeled(args.data, args.label_col, args.text_col, known_labels=labels)
    model, tok, _ = load(args.model, _device(args), need_tokenizer=True)
    pred, _ = predict_classes(model, encode_for_classifier(tok, data.texts, info), model.device)
    s = classification_scores([labels.index(l) for l in data.labels], pred, len(labels))
    if args.confusion_png:
        plot_confusion(s["confusion"], labels, args.confusion_png, f"{args.data}: accuracy {s['accuracy']:.4f}")
    if args.json:
        print(json.dumps({k: s[k] for k in ("accuracy", "macro_f1", "n", "confusion")}))
    else:
        print(f"accuracy {s['accuracy']:.4f}  macro-F1 {s['macro_f1']:.4f}  n={s['n']}")
        print(confusion_text(s["confusion"], labels))
        if args.confusion_png:
            print(f"confusion matrix drawn in {args.confusion_png}")
    return 0


def cmd_classify(args) -> int:
    from .modeldir import load
    from .train.tasks import encode_for_classifier, load_task_info, predict_classes
    info = load_task_info(args.model)
    if info["task"] != "classify":
        raise ValueError(f"{args.model} is a {info['task']} model, not a classifier")
    from .data.readers import read_lines
    lines = [args.text] if args.text else _read_lines(args.input) if args.input in (None, "-") else \
        read_lines(args.input, "texts to classify")
    model, tok, _ = load(args.model, _device(args), need_tokenizer=True)
    pred, prob = predict_classes(model, encode_for_classifier(tok, lines, info), model.device)
    for p, q in zip(pred, prob):
        print(f"{info['labels'][p]}\t{q:.4f}")
    return 0


def cmd_attention(args) -> int:
    from .generate.translate import translate
    from .inspect.attention import attention_maps, plot_attention
    from .modeldir import load
    model, src_tok, tgt_tok = load(args.model, _device(args), need_tokenizer=True)
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


def _load_any(spec: str, device, dtype=None):
    """A pretrained name (minilm, smollm2), a .gguf / HF folder, or an attnlab model directory."""
    import torch

    from .pretrained import load_pretrained
    p = load_pretrained(spec, dtype or torch.float32)
    p.model.to(device)
    return p


def cmd_generate(args) -> int:
    import torch

    from .generate import generate
    from .generate.search import DecoderOnlyStepper, stream_tokens
    from .pretrained import apply_chat_template
    from .accel import resolve_bf16
    device = _device(args)
    dtype = torch.bfloat16 if resolve_bf16(args.bf16, device) else torch.float32
    p = _load_any(args.model, device, dtype)
    model, tok = p.model, p.tokenizer
    if model.config.family != "decoder-only":
        raise ValueError(f"attnlab generate needs a decoder-only model; {args.model} is {model.config.family} "
                         "(use attnlab translate)")
    prompts = [args.prompt] if args.prompt not in (None, "-") else _read_lines("-")
    cfg = _generation_config(args)
    for n, text in enumerate(prompts, 1):
        if args.chat:
            if not p.chat_template:
                raise ValueError(f"{args.model} has no chat template; drop --chat")
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                [{"role": "user", "content": text}]
            ids = tok.encode(apply_chat_template(p.chat_template, messages))
        else:
            ids = tok.encode(text, bos=model.config.bos_id != model.config.eos_id and not p.chat_template)
        if model.config.positions == "learned" and len(ids) >= model.config.max_len:
            # as Hugging Face: learned positions end at max_len, there is no position for a new token
            where = "--prompt" if args.prompt not in (None, "-") else f"stdin line {n}"
            raise ValueError(f"{where}: the prompt is {len(ids)} tokens but {args.model} has a context of "
                             f"{model.config.max_len} positions (learned position embeddings), leaving no room "
                             f"to generate; shorten the prompt to at most {model.config.max_len - 1} tokens")
        x = torch.tensor([ids], device=model.device)
        prefix = "" if args.chat else text
        if args.stream and cfg.num_beams == 1:
            print(prefix, end="", flush=True)
            max_new = cfg.max_new_tokens or 128
            if model.config.positions == "learned":
                max_new = min(max_new, model.config.max_len - x.shape[1])
            out: list[int] = []
            shown = ""
            with torch.inference_mode():
                stepper = DecoderOnlyStepper(model, x, None, capacity=x.shape[1] + max_new + 1,
                                             compile=cfg.compile)
                for _, t in stream_tokens(stepper, 1, None, cfg, model.config.eos_id, max_new, [ids]):
                    if t.item() == model.config.eos_id:
                        break
                    out.append(t.item())
                    full = _continuation(tok, ids, out)
                    if not full.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                        print(full[len(shown):], end="", flush=True)
                        shown = full
            print()
        else:
            res = generate(model, x, None, cfg)
            print(prefix + _continuation(tok, ids, res.sequences[0]))
    return 0


def _continuation(tok, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add to the prompt. Decoding them alone would lose the space a token
    carries at its start (" Paris"); decoding prompt + continuation and cutting keeps it."""
    raw = tok.tk.decode  # not Tokenizer.decode: a chat prompt holds end-of-turn tokens it would cut at
    before = raw(list(prompt_ids), skip_special_tokens=False)
    full = raw(list(prompt_ids) + list(new_ids), skip_special_tokens=False)
    return full[len(before):] if full.startswith(before) else tok.decode(new_ids)


def cmd_embed(args) -> int:
    import json

    import numpy as np

    from .data.readers import read_lines
    from .pretrained import embed
    lines = [args.text] if args.text else _read_lines(args.input) if args.input in (None, "-") else \
        read_lines(args.input, "sentences to embed")
    p = _load_any(args.model, _device(args))
    vectors = embed(p, lines, batch_size=args.batch_size)
    if args.out and args.out.endswith(".npy"):
        np.save(args.out, vectors)
        print(f"{len(lines)} embeddings of dimension {vectors.shape[1]} written to {args.out}")
    else:
        stream = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
        for text, v in zip(lines, vectors):
            stream.write(json.dumps({"text": text, "embedding": [round(float(x), 7) for x in v]}) + "\n")
        if args.out:
            stream.close()
    return 0


def _device(args):
    from .accel import pick_device
    return pick_device(getattr(args, "device", "auto") or "auto")


def cmd_doctor(args) -> int:
    from .doctor import main as doctor
    return doctor(["--json"] if args.json else [])


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(minutes=args.minutes, out=args.out, threads=args.threads, test_sentences=args.test_sentences,
                    device=args.device)


EXAMPLES = {
    "params": "attnlab params paper-base\n  attnlab params my_config.json",
    "shapes": "attnlab shapes mt-tiny\n  attnlab shapes llama-mini",
    "demo": "attnlab demo                 # ~10 minutes on 2 CPU cores\n  attnlab demo --minutes 3",
    "train": ("attnlab train --train data/train.tsv.gz --dev data/dev.tsv --out runs/enzh --minutes 30 --bf16\n"
              "  attnlab train --task lm --preset shakespeare-char --tokenizer char --train input.txt --out runs/sh\n"
              "  attnlab train --task classify --init minilm --train sst2/train.tsv.gz --out runs/sst2\n"
              "  attnlab train --task mlm --train sentences.txt --out runs/mlm --max-len 64 --max-steps 4000 --bf16\n"
              "  attnlab train --task classify --init runs/mlm --train sst2/train.tsv.gz --out runs/sst2-mlm\n"
              "  attnlab train --train train.de.gz,train.en.gz --dev val.de.gz,val.en.gz --preset mt-small \\\n"
              "      --set d_model=384 --max-tokens 4000 --max-steps 20000\n"
              "  attnlab train --resume runs/enzh --minutes 60     # continue exactly where it stopped\n"
              "  torchrun --nproc_per_node 2 -m attnlab train --train ... --out runs/ddp"),
    "translate": ('echo "I love coding." | attnlab translate --model runs/enzh\n'
                  "  attnlab translate --model runs/enzh --input sentences.txt --beam 4 --lenpen 0.6\n"
                  "  attnlab translate --model runs/enzh --text 'How are you?' --beam 4 --nbest 4"),
    "evaluate": ("attnlab evaluate --model runs/enzh --src test.en --ref test.zh --json\n"
                 "  attnlab evaluate --model runs/enzh --data test.tsv --beam 4\n"
                 "  attnlab evaluate --task lm --model runs/shakespeare --data val.txt\n"
                 "  attnlab evaluate --task classify --model runs/sst2 --data test.tsv --confusion-png cm.png"),
    "classify": ('echo "a gorgeous, witty film" | attnlab classify --model runs/sst2\n'
                 '  attnlab classify --model runs/sst2 --input reviews.txt'),
    "attention": 'attnlab attention --model runs/enzh "I love coding." --out attn.png',
    "average": "attnlab average --model runs/enzh --last 5",
    "doctor": "attnlab doctor\n  attnlab doctor --json\n  python -m attnlab.doctor",
    "generate": ('attnlab generate --model smollm2 --chat --prompt "What is attention?" --stream\n'
                 '  attnlab generate --model runs/lm --prompt "ROMEO:" --sample --top-k 50 --temperature 0.8\n'
                 '  echo "Once upon a time" | attnlab generate --model model.gguf --prompt - --beam 4'),
    "embed": ('echo "A man is eating food." | attnlab embed --model minilm\n'
              '  attnlab embed --model minilm --input sentences.txt --out vectors.npy'),
}


def _add_train_flags(p) -> None:
    import dataclasses

    from .train import TrainArgs
    from .train.trainer import CHOICES, RANGES
    p.add_argument("--config", help="JSON file of training options (flags override it)")
    p.add_argument("--resume", dest="resume_dir", metavar="DIR", help="continue the run saved in DIR exactly")
    p.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"),
                   help="Adam betas (default 0.9 0.98, the paper's)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a model config field, e.g. --set d_model=384 --set norm_placement=post")
    helps = {"train": "TSV file (src<TAB>tgt[<TAB>...], .gz ok) or SRC_FILE,TGT_FILE",
             "dev": "dev set, same formats", "out": "model directory", "minutes": "time budget",
             "max_tokens": "tokens per batch (per process)", "update_freq": "gradient accumulation steps",
             "lr": "peak learning rate (default: the paper's d^-0.5 warmup^-0.5)",
             "schedule": "inverse_sqrt (the paper's) | cosine | constant", "bf16": "bf16 autocast",
             "compile": "torch.compile the model",
             "preset": "model preset or config.json (default: mt-small, gpt-mini or bert-mini by --task)",
             "zh_simplified": "convert Traditional Chinese targets to Simplified (needs attnlab[zh])",
             "reverse": "swap the TSV columns' direction", "joint_vocab": "one BPE vocabulary for both sides",
             "patience": "early stopping after N evaluations without BLEU improvement"}
    for f in dataclasses.fields(TrainArgs):
        if f.name in ("config_overrides", "betas", "resume"):
            continue
        if f.name in CHOICES:
            p.add_argument("--" + f.name.replace("_", "-"), choices=CHOICES[f.name], default=None,
                           help=helps.get(f.name))
            continue
        if f.name == "task":
            p.add_argument("--task", choices=["translation", "lm", "classify", "mlm"], default=None,
                           help="translation (encoder-decoder), lm (decoder-only), classify (encoder-only), "
                                "mlm (encoder-only masked-LM pretraining, BERT's 15%% / 80-10-10)")
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helps.get(f.name))
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            typ = _ranged(kind, *RANGES[f.name]) if f.name in RANGES else kind
            p.add_argument(flag, type=typ, default=None,
                           help=(helps.get(f.name, "") + f" (default: {f.default})").strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The Transformer of 'Attention Is All You Need': build, train, run, inspect.",
        epilog="presets: " + ", ".join(PRESETS))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    parser.add_argument("--debug", action="store_true", help="show tracebacks and which fast paths run")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the command's arguments and exit without running it")

    def add(name: str, help: str, fn):
        p = sub.add_parser(name, help=help, description=help,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples:\n  " + EXAMPLES.get(name, ""))
        p.set_defaults(fn=fn, subparser=p)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks and which fast paths run")
        return p

    p = add("demo", "the main job: train English→Chinese on the shipped corpus, evaluate, translate, draw", cmd_demo)
    p.add_argument("--minutes", type=positive_float, default=10.0, help="training time budget (default 10)")
    p.add_argument("--out", default="runs/demo", help="model directory (default runs/demo)")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--test-sentences", type=positive_int, default=None, metavar="N",
                   help="score only the first N test sentences (a small budget, e.g. for tests)")
    p.add_argument("--device", default="auto")
    p = add("train", "train a model: translation (default), --task lm, --task classify, --task mlm", cmd_train)
    _add_train_flags(p)
    p = add("translate", "translate sentences (stdin, --input file or --text) with a trained model", cmd_translate)
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--input", help="file with one sentence per line (default: stdin)")
    p.add_argument("--text", help="translate this one sentence")
    p.add_argument("--nbest", type=nonneg_int, default=0, help="print the N best hypotheses with scores (beam)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--device", default="auto")
    _add_generation_flags(p)
    p = add("evaluate", "translation: sacreBLEU (zh tokenizer for Chinese, 13a otherwise) and chrF; "
                        "lm: loss and perplexity; classify: accuracy, macro-F1, confusion matrix", cmd_evaluate)
    p.add_argument("--task", choices=["translation", "lm", "classify", "mlm"], help="default: what the model was trained for")
    p.add_argument("--block-size", type=positive_int, default=None, help="lm: tokens per evaluation block")
    p.add_argument("--label-col", type=nonneg_int, default=None)
    p.add_argument("--text-col", type=nonneg_int, default=None)
    p.add_argument("--confusion-png", default=None, help="classify: draw the confusion matrix here")
    p.add_argument("--model", required=True)
    p.add_argument("--src", help="source sentences, one per line")
    p.add_argument("--ref", help="reference translations, one per line")
    p.add_argument("--data", help="a TSV of pairs (translation), a text file (lm), labelled rows (classify)")
    p.add_argument("--src-col", type=nonneg_int, default=0)
    p.add_argument("--tgt-col", type=nonneg_int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object with bleu, chrf, n")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--device", default="auto")
    _add_generation_flags(p)
    p = add("attention", "draw encoder, decoder and cross-attention maps for one sentence", cmd_attention)
    p.add_argument("--model", required=True)
    p.add_argument("sentence")
    p.add_argument("--out", default="attention.png")
    p.add_argument("--device", default="cpu")
    p = add("classify", "label texts (stdin, --input file or --text) with a trained classifier", cmd_classify)
    p.add_argument("--model", required=True)
    p.add_argument("--input", help="file with one text per line (default: stdin)")
    p.add_argument("--text", help="classify this one text")
    p.add_argument("--device", default="auto")
    p = add("average", "average the last N checkpoints (as the paper does)", cmd_average)
    p.add_argument("--model", required=True)
    p.add_argument("--last", type=positive_int, default=5)
    p.add_argument("--out", default=None, help="output file (default: MODEL/model.safetensors)")
    p = add("generate", "generate text with a decoder-only model (smollm2, a .gguf, or a trained LM)", cmd_generate)
    p.add_argument("--model", required=True, help="smollm2, a .gguf file, an HF folder, or a model directory")
    p.add_argument("--prompt", default="-", help='prompt text, or "-" for one prompt per stdin line')
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--bf16", action="store_true",
                   help="run the model in bfloat16 where it is native (fp32 on CPUs that would emulate it)")
    p.add_argument("--device", default="auto")
    _add_generation_flags(p, sampling=True)
    p = add("embed", "sentence embeddings (mean-pooled, L2-normalised for minilm) as .npy or JSON lines", cmd_embed)
    p.add_argument("--model", required=True, help="minilm, an HF sentence-transformers folder, or a model dir")
    p.add_argument("--input", help="file with one sentence per line (default: stdin)")
    p.add_argument("--text", help="embed this one sentence")
    p.add_argument("--out", help="output .npy (matrix) or .jsonl (default: JSON lines on stdout)")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--device", default="auto")
    p = add("doctor", "what this machine supports and which fast paths attnlab takes here", cmd_doctor)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = add("params", "per-module parameter table and total (vs the 12·L·d² rule of thumb)", cmd_params)
    p.add_argument("config", help="preset name, config.json, or model directory")
    p = add("shapes", "tensor shape after every stage of a forward pass on a sample batch", cmd_shapes)
    p.add_argument("config", help="preset name, config.json, or model directory")
    return parser


# Errors a person can act on: bad files, values, formats, missing packages. One line, exit status 1.
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               ImportError, UnicodeError)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 a user error or a failure (one line on stderr, no traceback), 2 a usage
    error, 130 interrupted. ``--debug`` shows tracebacks and attnlab's debug log (which fast paths ran)."""
    import logging
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    debug = getattr(args, "debug", False)
    if debug:
        logging.basicConfig(format="attnlab: %(message)s")
        logging.getLogger("attnlab").setLevel(logging.DEBUG)
    where = f"attnlab {args.command}"
    if args.dry_run:
        print(f"{where}: arguments accepted (dry run, nothing was run)")
        return 0
    try:
        return args.fn(args)
    except UsageError as e:
        if debug:
            raise
        args.subparser.print_usage(sys.stderr)
        print(f"{where}: error: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `attnlab translate ... | head -1`
        sys.stderr.close()
        return 0
    except Exception as e:  # a bug, or a failure we did not foresee: one line, the traceback on request
        if debug:
            raise
        print(f"{where}: internal error: {type(e).__name__}: {_one_line(e)}\n"
              f"rerun with --debug for the traceback", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)) and e.filename:
        text = f"{e.filename}: {e.strerror or text}"
    return " ".join(text.split())[:2000]


__all__ = ["main", "build_parser"]
