"""The public inference API: ``attnlab.load(name_or_dir)`` → one :class:`LoadedModel` for every kind
of model, with the calls that kind supports. The CLI's commands (and the server) only call these.

    import attnlab
    m = attnlab.load("runs/enzh")                      # a model directory written by attnlab train
    m.translate(["I love coding."], attnlab.GenerationConfig(num_beams=4))
    lm = attnlab.load("smollm2")                       # or a .gguf file, an HF folder, "minilm"
    for piece in lm.stream("Once upon a time", attnlab.GenerationConfig(max_new_tokens=20)):
        print(piece, end="")

What each kind supports (a call it does not support raises ``ValueError`` saying which kind it is):

| kind | family | calls |
|---|---|---|
| ``translation`` | encoder-decoder | ``translate``, ``score`` (sacreBLEU/chrF), ``attention`` |
| (``--task span``) | encoder-decoder | loads as ``translation``: ``translate`` writes the spans behind sentinels |
| ``lm`` | decoder-only | ``generate``, ``stream``, ``score`` (loss/perplexity) |
| ``classify`` | encoder-only | ``classify``, ``embed``, ``score`` (accuracy/macro-F1) |
| ``mlm`` | encoder-only | ``embed``, ``score`` (masked-token loss/accuracy) |
| ``embedding`` | encoder-only | ``embed`` (MiniLM, sentence-transformers folders) |
| ``image-classify`` | encoder-only (ViT) | ``classify`` (of images), ``score`` (accuracy/macro-F1) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .generate.search import GenerationConfig

KINDS = {"translation": "encoder-decoder", "lm": "decoder-only", "classify": "encoder-only",
         "mlm": "encoder-only", "embedding": "encoder-only", "image-classify": "encoder-only"}


@dataclass
class LoadedModel:
    """A network with everything needed to use it: tokenizer(s), task record, chat template."""
    module: torch.nn.Module             # the attnlab network (EncoderDecoder, DecoderOnly, EncoderOnly)
    tokenizer: object                   # source (or only) tokenizer
    tgt_tokenizer: object = None        # target tokenizer of a translator (the source one if joint)
    kind: str = "translation"           # see KINDS
    name: str = ""
    task: dict = field(default_factory=dict)  # task.json of a trained directory (labels, block size, …)
    chat_template: str | None = None
    normalize: bool = False             # embeddings: L2-normalise (sentence-transformers' Normalize)

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.module.config

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _need(self, *kinds: str, call: str) -> None:
        if self.kind not in kinds:
            use = {"translation": "translate", "lm": "generate", "classify": "classify", "mlm": "embed",
                   "embedding": "embed", "image-classify": "classify"}[self.kind]
            raise ValueError(f"{self.name or 'this model'} is {self.config.family} (a {self.kind} model): {call} "
                             f"needs a {' or '.join(kinds)} model ({KINDS[kinds[0]]}); use attnlab {use}")

    # -- translation -------------------------------------------------------------------------------------
    def translate(self, texts: list[str], options: GenerationConfig | None = None, batch_size: int = 64,
                  nbest: bool = False):
        """Translations in input order; with ``nbest``, lists of (text, score) best first. A model trained
        with ``--source-prefix`` gets its prefix before every text here (task.json keeps it)."""
        from .generate.translate import translate
        self._need("translation", call="translate")
        _listed(texts, "translate")
        prefix = self.task.get("source_prefix", "")
        return translate(self.module, self.tokenizer, self.tgt_tokenizer, [prefix + t for t in texts], options,
                         batch_size=batch_size, nbest=nbest)

    def attention(self, text: str, translation: str | None = None) -> dict:
        """Every attention map (encoder self-, decoder self-, cross-attention; per layer and head) for
        one sentence and its translation (the model's own if none is given)."""
        from .inspect.attention import attention_maps
        self._need("translation", call="attention")
        translation = translation if translation is not None else self.translate([text])[0]
        ids = self.tgt_tokenizer.encode(translation)  # decoder input BOS y1..yn: its last row is the one that chose EOS
        source = self.task.get("source_prefix", "") + text  # what the encoder reads (translate adds it too)
        maps = attention_maps(self.module, self.tokenizer, self.tgt_tokenizer, source, ids)
        maps["translation"] = translation
        return maps

    # -- language models ----------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a prompt: through the model's chat template with ``chat``, else with BOS where the
        model uses one."""
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            return self.chat_ids(messages)
        cfg = self.config
        ids = self.tokenizer.encode(prompt, bos=cfg.bos_id != cfg.eos_id and not self.chat_template)
        if not ids:
            raise ValueError("the prompt is empty (no tokens to continue): give some text"
                             + (", or use --chat" if self.chat_template else ""))
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation (``{"role", "content"}`` dicts) through the model's own chat template,
        rendered as Hugging Face renders it (:func:`attnlab.pretrained.apply_chat_template`)."""
        from .pretrained import apply_chat_template
        if not self.chat_template:
            raise ValueError(f"{self.name or 'this model'} has no chat template; drop --chat")
        return self.tokenizer.encode(apply_chat_template(self.chat_template, messages, tokenizer=self.tokenizer))

    def generate(self, prompts: list[str], options: GenerationConfig | None = None, chat: bool = False,
                 system: str | None = None) -> list[str]:
        """The continuation of each prompt (the prompt itself is not repeated)."""
        from .generate import generate
        self._need("lm", call="generate")
        _listed(prompts, "generate")
        out = []
        for prompt in prompts:  # one at a time: prompts of different lengths need no padding
            ids = self.prompt_ids(prompt, chat, system)
            res = generate(self.module, torch.tensor([ids], device=self.device), None, options)
            out.append(self.continuation(ids, res.sequences[0]))
        return out

    def stream(self, prompt: str, options: GenerationConfig | None = None, chat: bool = False,
               system: str | None = None) -> Iterator[str]:
        """Pieces of text as they are generated; joined, they equal ``generate([prompt])[0]``. A piece
        is held back while it ends inside a multi-byte character."""
        from .generate.search import stream
        self._need("lm", call="stream")
        ids = self.prompt_ids(prompt, chat, system)
        new: list[int] = []
        shown = ""
        text = ""
        for t in stream(self.module, ids, options):
            new.append(t)
            text = self.continuation(ids, new)
            if not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
        if len(text) > len(shown):  # generation ended inside a multi-byte character: what generate gives
            yield text[len(shown):]

    def continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """The text the new tokens add to the prompt. Decoding them alone would lose the space a token
        carries at its start (" Paris"); decoding prompt + continuation and cutting keeps it."""
        raw = self.tokenizer.tk.decode  # not Tokenizer.decode: a chat prompt holds end-of-turn tokens
        if not self.chat_template:  # (with one, BOS may be a turn's start, <|im_start|>: stop strings see it)
            new_ids = self.tokenizer.content_ids(new_ids)
        before = raw(list(prompt_ids), skip_special_tokens=False)
        full = raw(list(prompt_ids) + list(new_ids), skip_special_tokens=False)
        return full[len(before):] if full.startswith(before) else self.tokenizer.decode(new_ids)

    # -- encoders ---------------------------------------------------------------------------------------------
    def embed(self, texts: list[str], batch_size: int = 32):
        """Sentence embeddings (numpy float32, one row per text): pooled hidden states, L2-normalised
        where the model says so (MiniLM)."""
        from .data.encoding import encode_for_classifier, mlm_rows
        from .pretrained import Pretrained, embed
        self._need("embedding", "classify", "mlm", call="embed")
        _listed(texts, "embed")
        encoded = None  # (attnlab's own classifiers and masked LMs: framed as in training, so <s> is what is pooled)
        if self.kind == "classify" and self.task.get("add_bos", True):
            encoded = encode_for_classifier(self.tokenizer, texts, self._classifier_info())
        elif self.kind == "mlm":
            encoded = mlm_rows(self.tokenizer, texts, self._max_text_len())
        return embed(Pretrained(self.module, self.tokenizer, normalize=self.normalize), texts, batch_size, encoded)

    def classify(self, texts: list[str]) -> list[tuple[str, float]]:
        """(label, probability of that label) per text; for an image classifier, per image: uint8
        pixels (N, H, W[, C]) as a numpy array or tensor, or image file paths."""
        _listed(texts, "classify")
        if self.kind == "image-classify":
            from .train.tasks.image_classify import classify_images
            return classify_images(self.module, self.task, texts, self.device)
        from .data.encoding import encode_for_classifier
        from .evaluate.scoring import predict_classes
        self._need("classify", call="classify")
        pred, prob = predict_classes(self.module, encode_for_classifier(self.tokenizer, texts, self._classifier_info()),
                                     self.device)
        return [(self.task["labels"][p], q) for p, q in zip(pred, prob)]

    def _max_text_len(self) -> int:
        """Tokens a text may take: the task record's ``max_len``, never past the model's positions (without one:
        the model's)."""
        return min(self.task.get("max_len", self.config.max_len), self.config.max_len)

    def _classifier_info(self) -> dict:
        """The task record as ``encode_for_classifier`` reads it, with :meth:`_max_text_len`."""
        return {**self.task, "max_len": self._max_text_len()}

    # -- scores ----------------------------------------------------------------------------------------------
    def score(self, texts: list[str] | str, references: list[str] | None = None,
              options: GenerationConfig | None = None, batch_size: int = 64, block_size: int | None = None) -> dict:
        """The metric of the model's kind on held-out data:

        * translation: ``texts`` sources, ``references`` translations → sacreBLEU, chrF;
        * lm: ``texts`` one text (or lines) → loss, perplexity over consecutive blocks;
        * classify: ``texts`` with gold ``references`` labels → accuracy, macro-F1, confusion matrix;
        * image-classify: images (as ``classify`` takes them) with gold labels → the same;
        * mlm: ``texts`` lines → masked-token loss and accuracy (fixed-seed masks).
        """
        if self.kind == "translation":
            from .evaluate import corpus_scores
            if references is None or len(references) != len(texts):
                raise ValueError(f"scoring a translator needs one reference per source "
                                 f"({len(texts)} sources, {0 if references is None else len(references)} references)")
            return corpus_scores(self.translate(list(texts), options, batch_size), list(references))
        if self.kind == "lm":
            from .evaluate.scoring import lm_loss
            text = texts if isinstance(texts, str) else "\n".join(texts)
            ids = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
            block = block_size or self.task.get("block_size") or self.config.max_len
            r = lm_loss(self.module, ids, block, self.device)
            return {"loss": r["val_loss"], "perplexity": r["val_ppl"], "tokens": r["tokens"], "block_size": block}
        if self.kind == "classify":
            from .evaluate.classification import classification_scores
            from .data.encoding import encode_for_classifier
            from .evaluate.scoring import predict_classes
            labels = self.task["labels"]
            unknown = sorted(set(references or []) - set(labels))
            if references is None or len(references) != len(texts) or unknown:
                raise ValueError(f"scoring a classifier needs one known label per text (labels: {labels}"
                                 + (f"; unknown: {unknown[:5]}" if unknown else "") + ")")
            pred, _ = predict_classes(self.module, encode_for_classifier(self.tokenizer, texts, self._classifier_info()),
                                      self.device)
            return classification_scores([labels.index(l) for l in references], pred, len(labels))
        if self.kind == "image-classify":
            from .train.tasks.image_classify import score_images
            return score_images(self.module, self.task, texts, references, self.device)
        if self.kind == "mlm":
            from .data.encoding import mlm_rows
            from .evaluate.scoring import mlm_scores
            if self.tokenizer.mask_id is None:
                raise ValueError(f"{self.name}: its tokenizer has no <mask> token (not a --task mlm model)")
            lines = [l.strip() for l in ([texts] if isinstance(texts, str) else texts) for l in l.splitlines() if l.strip()]
            r = mlm_scores(self.module, mlm_rows(self.tokenizer, lines, self.task.get("max_len", self.config.max_len)),
                           self.tokenizer, self.device)
            return {"mlm_loss": r["dev_mlm_loss"], "mlm_accuracy": r["dev_mlm_accuracy"], "masked_tokens": r["tokens"]}
        raise ValueError(f"{self.name or 'this model'} is a {self.kind} model: it has no held-out score "
                         "(use embed and your own metric)")


def _listed(texts, call: str) -> None:
    """A list of texts is expected: a bare string would be taken one character at a time."""
    if isinstance(texts, str):
        raise TypeError(f"{call} takes a list of texts; for one text: {call}([text])")


def load(name_or_dir: str | Path, device: str | torch.device = "auto", bf16: bool = False,
         quantize: str | None = None) -> LoadedModel:
    """Any model attnlab reads: ``minilm``, ``smollm2``, a ``.gguf`` file, a Hugging Face folder, or a
    model directory written by ``attnlab train``. ``bf16`` loads the weights in bfloat16 where the
    device computes it natively (fp32 elsewhere, with one line saying so). ``quantize`` ("int8" or
    "int4") stores every linear layer's weights in 8 or 4 bits (``attnlab.quant``): less memory and,
    on CPU, faster batch-1 decoding, for a small loss of quality."""
    from .accel import pick_device, resolve_bf16
    from .pretrained import load_pretrained
    from .quant import check_kind, quantize_model
    check_kind(quantize)  # before loading anything
    dev = pick_device(str(device))
    dtype = torch.bfloat16 if resolve_bf16(bf16, dev) else torch.float32
    spec = str(name_or_dir)
    from .accel import accelerate_for_inference
    p = load_pretrained(spec, torch.float32 if quantize else dtype)
    if quantize:  # from the fp32 weights (not bf16-rounded ones); the scales then take the dtype
        quantize_model(p.model, quantize).to(dtype)
    accelerate_for_inference(p.model.to(dev).eval())
    task = _task_record(spec)
    family = p.model.config.family
    if task:  # span-corruption pretraining (T5) loads as a translator: translate fills <extra_id_N> gaps
        kind = "translation" if task["task"] == "span" else task["task"]
    elif family == "encoder-decoder":
        kind = "translation"
    elif family == "decoder-only":
        kind = "lm"
    else:
        kind = ("image-classify" if p.model.config.is_image_model else "classify") if p.model.config.n_classes \
            else "embedding"
    if not task and kind == "classify":  # a Hugging Face classifier: its labels, and its tokenizer frames the text
        task = {"task": "classify", "labels": _hf_labels(spec, p.model.config.n_classes), "add_bos": False}
    tgt = getattr(p, "tgt_tokenizer", None) or p.tokenizer
    return LoadedModel(p.model, p.tokenizer, tgt, kind, spec, task, p.chat_template, p.normalize)


def _hf_labels(spec: str, n_classes: int) -> list[str]:
    """A Hugging Face classifier's class names in id order: config.json's ``id2label``, else Hugging Face's own
    default names (LABEL_0, LABEL_1, ...)."""
    import json
    try:
        id2label = json.loads((Path(spec) / "config.json").read_text(encoding="utf-8")).get("id2label") or {}
    except (OSError, ValueError):
        id2label = {}
    return [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(n_classes)]


def _task_record(spec: str) -> dict:
    """task.json of an attnlab model directory ({} for pretrained names, files and HF folders, whose
    config.json has a ``model_type`` rather than attnlab's ``family``)."""
    import json
    d = Path(spec)
    try:
        is_ours = "family" in json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not is_ours or not (d / "task.json").exists():  # no record: the kind follows the model's family
        return {}
    from .modeldir import load_task_info
    return load_task_info(d)


__all__ = ["LoadedModel", "load", "KINDS", "GenerationConfig"]
