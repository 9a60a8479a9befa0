"""A trained model is a directory: config.json, model.safetensors, tokenizer.json (+
tgt_tokenizer.json when source and target vocabularies are separate), training_args.json,
metrics.jsonl, and checkpoint_last.pt (everything needed to resume). Every file is written
atomically (temporary file + rename), so killing a process never leaves a corrupt model."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .config import TransformerConfig
from .model import build_model


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then rename over ``path`` (atomic on POSIX and Windows)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def save_weights(model: torch.nn.Module, path: str | Path) -> None:
    """safetensors refuses shared tensors: tied weights are stored once (the tie is in config)."""
    from safetensors.torch import save_file
    seen, state = set(), {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        state[name] = t.detach().contiguous().cpu()
    atomic_write(path, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    from safetensors.torch import load_file
    try:
        state = load_file(str(path))
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt "
                         f"({' '.join(str(e).split())[:200]})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config.json (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


def save_model_dir(directory: str | Path, model, tokenizer=None, tgt_tokenizer=None,
                   training_args: dict[str, Any] | None = None, weights_name: str = "model.safetensors") -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / "config.json", model.config.to_json())
    save_weights(model, d / weights_name)
    if tokenizer is not None:
        atomic_write_text(d / "tokenizer.json", tokenizer.to_str())
    if tgt_tokenizer is not None:
        atomic_write_text(d / "tgt_tokenizer.json", tgt_tokenizer.to_str())
    if training_args is not None:
        atomic_write_text(d / "training_args.json", json.dumps(training_args, indent=2, default=str) + "\n")


def _load_tokenizer(path: Path):
    from .data.tokenizer import Tokenizer
    try:
        return Tokenizer.load(path)
    except Exception as e:  # the tokenizers library raises plain Exceptions for broken files
        raise ValueError(f"{path}: not a readable tokenizer file ({' '.join(str(e).split())[:200]})") from None


def load(directory: str | Path, device: str | torch.device = "cpu", need_tokenizer: bool = False):
    """(model, tokenizer, target tokenizer) from a model directory. The target tokenizer is the
    source one when the vocabulary is joint; tokenizers are None if the directory has none, unless
    ``need_tokenizer`` (then a missing tokenizer.json, or tgt_tokenizer.json of a model with a
    separate target vocabulary, is an error naming the file). A tokenizer with more tokens than
    the model's vocabulary is always an error."""
    d = Path(directory)
    if not d.exists():
        raise FileNotFoundError(f"{d}: no such model directory")
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d}: not a model directory (no config.json)")
    try:
        config = TransformerConfig.from_json(d / "config.json")
    except UnicodeDecodeError:
        raise ValueError(f"{d / 'config.json'}: not UTF-8 text (a damaged model directory?)") from None
    except TypeError as e:  # a field of the wrong kind reaches a check that cannot compare it
        raise ValueError(f"{d / 'config.json'}: {e}") from None
    separate = config.family == "encoder-decoder" and config.tgt_vocab_size is not None
    if need_tokenizer and not config.is_image_model:  # a ViT reads pixels: it has no tokenizer
        for name in ("tokenizer.json", *(("tgt_tokenizer.json",) if separate else ())):
            if not (d / name).exists():
                raise FileNotFoundError(f"{d}: no {name} (the model directory is incomplete: copy {name} "
                                        "from the directory the model was trained in)")
    if not (d / "model.safetensors").exists():
        raise FileNotFoundError(f"{d}: no model.safetensors (the model directory is incomplete)")
    tok = _load_tokenizer(d / "tokenizer.json") if (d / "tokenizer.json").exists() else None
    tgt = _load_tokenizer(d / "tgt_tokenizer.json") if (d / "tgt_tokenizer.json").exists() else tok
    for name, t, size in (("tokenizer.json", tok, config.vocab_size),
                          ("tgt_tokenizer.json" if tgt is not tok else "tokenizer.json", tgt,
                           config.tgt_vocab_size if separate else config.vocab_size)):
        if t is not None and t.vocab_size > size:
            raise ValueError(f"{d / name}: {t.vocab_size} tokens, more than the model's vocabulary of {size} "
                             "in config.json (the tokenizer belongs to another model)")
    model = build_model(config, init=False)  # load_weights fills (and checks) every weight
    load_weights(model, d / "model.safetensors")
    model.to(device).eval()
    return model, tok, tgt


# -- the task record -------------------------------------------------------------------------------------


def save_task_info(out: str | Path, info: dict) -> None:
    """task.json: what the model directory was trained for (task, labels, block size, …)."""
    atomic_write_text(Path(out) / "task.json", json.dumps(info, ensure_ascii=False, indent=2) + "\n")


def load_task_info(directory: str | Path) -> dict:
    """task.json of a model directory; a directory without one is a translator (the first task)."""
    d = Path(directory)
    if not d.exists():
        raise FileNotFoundError(f"{d}: no such model directory")
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d}: not a model directory (no config.json)")
    p = d / "task.json"
    if not p.exists():
        return {"task": "translation"}
    from .data.readers import read_json
    info = read_json(p, "the task record of a model directory (damaged?)")
    if not isinstance(info.get("task"), str):
        raise ValueError(f"{p}: expected a JSON object with a \"task\" name")
    if info["task"] in ("classify", "image-classify") and not (isinstance(info.get("labels"), list) and info["labels"]):
        raise ValueError(f"{p}: a classifier's task.json needs its \"labels\" list")
    return info

