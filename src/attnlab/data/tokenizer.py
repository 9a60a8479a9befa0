"""Subword tokenizers (BPE with the `tokenizers` library), saved as ``tokenizer.json``.

The pre-tokenizer is SentencePiece's "metaspace" scheme: spaces become "▁" and are part of the
tokens, so text without spaces (Chinese) is handled the same way as English, and decoding restores
the exact text (needed for honest BLEU). Unseen characters fall back to UTF-8 byte tokens instead
of <unk>.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3 = config pad/bos/eos/unk


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with BOS/EOS handling and batch decode."""

    def __init__(self, tk, pad_id: int | None = None, bos_id: int | None = None, eos_id: int | None = None,
                 unk_id: int | None = None):
        """``tk`` is a ``tokenizers.Tokenizer``. Special ids default to attnlab's own
        <pad>/<s>/</s>/<unk>; pretrained vocabularies (BERT, SmolLM2) pass theirs."""
        self.tk = tk
        own = [tk.token_to_id(t) for t in SPECIALS]
        self.pad_id = pad_id if pad_id is not None else own[0]
        self.bos_id = bos_id if bos_id is not None else own[1]
        self.eos_id = eos_id if eos_id is not None else own[2]
        self.unk_id = unk_id if unk_id is not None else own[3]

    @property
    def mask_id(self) -> int | None:
        """The [MASK] token of masked-LM pretraining (attnlab's ``<mask>``, BERT's ``[MASK]``)."""
        for t in ("<mask>", "[MASK]"):
            i = self.tk.token_to_id(t)
            if i is not None:
                return i
        return None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tk.encode(text).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        b, e = [self.bos_id] if bos else [], [self.eos_id] if eos else []
        return [b + enc.ids + e for enc in self.tk.encode_batch(texts)]

    def content_ids(self, ids: Iterable[int]) -> list[int]:
        """``ids`` without padding and BOS, which are no text (EOS kept, where it is the padding id too)."""
        return [i for i in ids if i not in (self.pad_id, self.bos_id) or i == self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        ids = self.content_ids(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        # The byte-fallback tokens <0xNN> are registered as special (so BPE never merges them) but
        # must be decoded, so specials are not skipped here; pad/BOS/EOS were removed above.
        return self.tk.decode(ids, skip_special_tokens=False).strip()

    def tokens(self, text: str) -> list[str]:
        return self.tk.encode(text).tokens

    def id_to_token(self, i: int) -> str:
        return self.tk.id_to_token(i)

    def save(self, path: str | Path) -> None:
        self.tk.save(str(path))

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as TK
        return cls(TK.from_file(str(path)))

    @classmethod
    def from_str(cls, text: str) -> "Tokenizer":
        from tokenizers import Tokenizer as TK
        return cls(TK.from_str(text))

    def to_str(self) -> str:
        return self.tk.to_str()


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    extra_specials: tuple[str, ...] = ()) -> Tokenizer:
    """BPE over the texts (training split only) with metaspace pre-tokenisation and byte fallback.
    ``extra_specials`` (e.g. ``("<mask>",)`` for masked-LM pretraining) follow the four specials."""
    from tokenizers import Tokenizer as TK
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tk = TK(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.NFC()  # canonical composition only: keeps full-width punctuation
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                prepend_scheme="always")])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=SPECIALS + list(extra_specials) + byte_tokens,
                                  show_progress=False)
    tk.train_from_iterator(texts, trainer)
    return Tokenizer(tk)


def char_tokenizer(text: str) -> Tokenizer:
    """One token per character of the training text (nanoGPT's Shakespeare model), after the four
    special tokens; decoding joins characters back exactly."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as TK
    from tokenizers import decoders, models, pre_tokenizers

    chars = sorted(set(text))
    vocab = {t: i for i, t in enumerate(SPECIALS + [c for c in chars if c not in SPECIALS])}
    tk = TK(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIALS)
    return Tokenizer(tk)
