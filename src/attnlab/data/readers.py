"""Readers for parallel text. Every error names the file and line; nothing is silently dropped
(overlong pairs are filtered with a count)."""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


class DataError(ValueError):
    """Bad input data; the message names file and line."""


def open_text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, line without newline) of a UTF-8 text file, plain or gzip-compressed (told by
    its first bytes, whatever its name). A binary file, invalid UTF-8 and a corrupt or truncated
    .gz are errors that name the file and the line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a text file")
    with open(path, "rb") as f:
        compressed = f.read(2) == b"\x1f\x8b"
    opener = gzip.open if compressed else open
    lineno = 0
    try:
        with opener(path, "rb") as f:
            head = f.peek(8192)[:8192] if hasattr(f, "peek") else b""
            if b"\x00" in head:  # as git and grep tell a binary file: a NUL byte near the start
                line = head.count(b"\n", 0, head.index(0)) + 1
                raise DataError(f"{path}:{line}: binary data (a NUL byte), not a UTF-8 text file")
            for lineno, raw in enumerate(f, 1):
                if b"\x00" in raw:
                    raise DataError(f"{path}:{lineno}: binary data (a NUL byte at byte {raw.index(0)}), "
                                    "not a UTF-8 text file")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    text = raw.rstrip(b"\r\n")
                    raise DataError(f"{path}:{lineno}: invalid UTF-8 at byte {e.start} "
                                    f"({text[max(0, e.start - 10): e.start + 10]!r})") from None
                yield lineno, line.rstrip("\r\n")
    except (EOFError, OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        if not compressed or isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            raise
        raise DataError(f"{path}:{lineno + 1}: corrupt or truncated gzip data ({e})") from None


def read_lines(path: str | Path, what: str = "lines") -> list[str]:
    """Every line of a text file (blank ones too: outputs stay aligned with inputs); an empty
    file (or one of blank lines only) is an error naming the file."""
    lines = [line for _, line in open_text_lines(path)]
    if not any(line.strip() for line in lines):
        raise DataError(f"{path}: {'empty file' if not lines else 'only blank lines'}, no {what}")
    return lines


def read_json(path: str | Path, what: str = "JSON", expect: type | None = dict):
    """A JSON file; a missing, non-UTF-8 or broken file, or a value of another type than ``expect``, is
    an error naming the file (and the line)."""
    import json
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        value = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{p}: not UTF-8 text (expected {what})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{e.lineno}: not valid JSON ({e.msg}); expected {what}") from None
    if expect is not None and not isinstance(value, expect):
        raise DataError(f"{p}: expected {what}, found a JSON {type(value).__name__}")
    return value


@dataclass
class Pairs:
    src: list[str]
    tgt: list[str]
    source: str  # description for messages

    def __len__(self) -> int:
        return len(self.src)


def read_tsv_pairs(path: str | Path, src_col: int = 0, tgt_col: int = 1, reverse: bool = False,
                   limit: int | None = None) -> Pairs:
    """``src<TAB>tgt[<TAB>...]`` lines (e.g. Tatoeba's en, zh, attribution). ``reverse`` swaps
    the direction (translate column tgt_col → src_col)."""
    src, tgt = [], []
    need = max(src_col, tgt_col) + 1
    for lineno, line in open_text_lines(path):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < need:
            raise DataError(f"{path}:{lineno}: expected at least {need} TAB-separated fields "
                            f"(columns {src_col} and {tgt_col}), found {len(fields)}: {line[:80]!r}")
        s, t = fields[src_col].strip(), fields[tgt_col].strip()
        if not s or not t:
            raise DataError(f"{path}:{lineno}: empty {'source' if not s else 'target'} field")
        src.append(s)
        tgt.append(t)
        if limit and len(src) >= limit:
            break
    if reverse:
        src, tgt = tgt, src
    if not src:
        raise DataError(f"{path}: no sentence pairs found (the file is empty or blank; expected "
                        "SOURCE<TAB>TARGET lines)")
    return Pairs(src, tgt, str(path))


def read_parallel_files(src_path: str | Path, tgt_path: str | Path, limit: int | None = None) -> Pairs:
    """Two aligned files, one sentence per line (e.g. multi30k train.de.gz + train.en.gz)."""
    src, tgt = [], []
    a, b = open_text_lines(src_path), open_text_lines(tgt_path)
    while True:
        x, y = next(a, None), next(b, None)
        if x is None and y is None:
            break
        if x is None or y is None:
            shorter, longer = (src_path, tgt_path) if x is None else (tgt_path, src_path)
            n = (y or x)[0]
            raise DataError(f"misaligned files: {shorter} ends before line {n} of {longer}")
        if not x[1].strip() or not y[1].strip():
            which = src_path if not x[1].strip() else tgt_path
            raise DataError(f"{which}:{x[0]}: empty line (files must be aligned line by line)")
        src.append(x[1].strip())
        tgt.append(y[1].strip())
        if limit and len(src) >= limit:
            break
    if not src:
        raise DataError(f"{src_path}: no sentence pairs found (the file is empty)")
    return Pairs(src, tgt, f"{src_path} + {tgt_path}")


def read_pairs(spec: str, src_col: int = 0, tgt_col: int = 1, reverse: bool = False,
               limit: int | None = None) -> Pairs:
    """A TSV file, or two aligned files written ``SRC_FILE,TGT_FILE``."""
    if "," in spec and not Path(spec).exists():
        s, t = spec.split(",", 1)
        return read_parallel_files(s, t, limit)
    return read_tsv_pairs(spec, src_col, tgt_col, reverse, limit)


def to_simplified(texts: list[str]) -> list[str]:
    """Traditional → Simplified Chinese (OpenCC t2s); needs the ``attnlab[zh]`` extra."""
    try:
        import opencc
    except ImportError:
        raise ImportError("script normalisation needs OpenCC: pip install 'attnlab[zh]'") from None
    conv = opencc.OpenCC("t2s")
    return [conv.convert(t) for t in texts]


def read_text(spec: str | Path) -> str:
    """Plain text for language modelling: a file (.gz ok) or a folder of files (sorted, joined)."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataError(f"{path}: folder has no files")
        return "\n".join(read_text(f) for f in files)
    lines = [line for _, line in open_text_lines(path)]
    if not any(l.strip() for l in lines):
        raise DataError(f"{path}: no text (the file is empty or blank)")
    return "\n".join(lines) + "\n"


@dataclass
class Labeled:
    labels: list[str]
    texts: list[str]
    source: str

    def __len__(self) -> int:
        return len(self.labels)


_TEXT_NAMES = ("text", "sentence", "review", "content", "message", "document")


def read_labeled(path: str | Path, label_col: int | None = None, text_col: int | None = None,
                 known_labels: list[str] | None = None) -> Labeled:
    """Labelled rows for classification: TSV (``label<TAB>text`` by default) or CSV (by the
    extension, RFC 4180 quoting). A header row naming a ``label`` column is recognised and the
    columns are taken from it. Errors name file and line: broken rows, empty texts, labels not seen
    in training (``known_labels``)."""
    import csv

    path = Path(path)
    is_csv = ".csv" in path.suffixes
    rows = []
    lines = open_text_lines(path)
    if is_csv:
        numbered = list(lines)
        reader = csv.reader([l for _, l in numbered])
        rows = [(numbered[i][0], r) for i, r in enumerate(reader)]
    else:
        rows = [(n, l.split("\t")) for n, l in lines if l.strip()]
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty or blank; expected LABEL<TAB>TEXT lines)")
    first = [f.strip().lower() for f in rows[0][1]]
    if "label" in first:
        lc = first.index("label") if label_col is None else label_col
        tc = text_col if text_col is not None else next(
            (first.index(n) for n in _TEXT_NAMES if n in first), 1 - lc if len(first) == 2 else None)
        if tc is None:
            raise DataError(f"{path}:1: cannot tell the text column from the header {rows[0][1]}; use --text-col")
        rows = rows[1:]
    else:
        lc = 0 if label_col is None else label_col
        tc = (1 if lc == 0 else 0) if text_col is None else text_col
    labels, texts = [], []
    for lineno, fields in rows:
        if not fields or all(not f.strip() for f in fields):
            continue
        if len(fields) <= max(lc, tc):
            raise DataError(f"{path}:{lineno}: expected a label in column {lc} and text in column {tc}, "
                            f"found {len(fields)} field(s): {str(fields)[:80]}")
        label, text = fields[lc].strip(), fields[tc].strip()
        if not label:
            raise DataError(f"{path}:{lineno}: empty label")
        if not text:
            raise DataError(f"{path}:{lineno}: empty text")
        if known_labels is not None and label not in known_labels:
            raise DataError(f"{path}:{lineno}: unknown label {label!r}; the model knows {known_labels}")
        labels.append(label)
        texts.append(text)
    if not labels:
        raise DataError(f"{path}: no labelled rows")
    return Labeled(labels, texts, str(path))
