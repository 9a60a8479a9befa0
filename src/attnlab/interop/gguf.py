"""Read a llama.cpp GGUF file (Llama architecture) into an attnlab DecoderOnly model, with its
tokenizer rebuilt from the file's metadata.

The file is parsed here (``GGUFFile``: the header, the metadata and the tensor table with ``struct``,
the tensor data as memory-mapped bytes), and the common storage types are dequantised here too (F32,
F16, BF16, Q8_0, Q4_0, Q4_1: SmolLM2's file is Q4_1 + Q8_0 + F32). Why not ``gguf``'s own reader: it
builds a numpy view per metadata item, ~4 s for SmolLM2's 49k-token vocabulary and merges, and its
dequantisation runs block-row by block-row; here the whole load takes about a second. Other types
(K-quants, IQ…) are dequantised by the ``gguf`` package when it is installed (``attnlab[pretrained]``).
The tests compare this reader with ``gguf``'s, value for value.

Quantised tensors are dequantised to fp32 (or the requested dtype) once, at load.
llama.cpp stores W_Q and W_K rows permuted for its interleaved RoPE; they are permuted back to the
"rotate half" layout attnlab (and Hugging Face) use.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import TransformerConfig

# -- the file format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) --------------------------

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # metadata value types; the others are scalars:
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}

# tensor storage types: id → (name, values per block, bytes per block) (ggml's type traits)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
         7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
         11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
         15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
         19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
         23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
         28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
         35: ("TQ2_0", 256, 66)}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # outermost first, as torch has it (GGUF lists dimensions innermost first)
    type: int               # a key of TYPES
    data: np.ndarray        # the stored bytes (uint8, memory-mapped)

    @property
    def type_name(self) -> str:
        return TYPES[self.type][0]  # GGUFFile refuses types not in TYPES


class GGUFFile:
    """A GGUF file's metadata (``metadata``: key → int, float, bool, str or list) and tensor table
    (``tensors``, in file order), parsed once; tensor data stays on disk until dequantised."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError("an empty file") from None
        self._pos = 0
        if self._bytes(4) != MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            big_endian = version.to_bytes(4, "little")[::-1] in (b"\0\0\0\2", b"\0\0\0\3")
            raise ValueError("a big-endian GGUF file (attnlab reads little-endian ones)" if big_endian
                             else f"GGUF version {version} (attnlab reads versions 2 and 3)")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"), key)
        table = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            table.append((name, tuple(reversed(dims)), self._unpack("<I"), self._unpack("<Q")))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align % 8:
            raise ValueError(f"general.alignment is {align!r} (a positive multiple of 8 expected)")
        start = -(-self._pos // align) * align
        file_bytes = np.frombuffer(self._buf, dtype=np.uint8)
        self.tensors = []
        for name, shape, kind, offset in table:
            if kind not in TYPES:
                raise ValueError(f"tensor {name} has the unknown storage type {kind}")
            _, block, size = TYPES[kind]
            if shape and shape[-1] % block:
                raise ValueError(f"tensor {name}: rows of {shape[-1]} values are not whole blocks of {block} "
                                 f"({TYPES[kind][0]})")
            begin, end = start + offset, start + offset + math.prod(shape) // block * size
            if end > len(file_bytes):
                raise ValueError(f"tensor {name} ends past the end of the file (truncated?)")
            self.tensors.append(GGUFTensor(name, shape, kind, file_bytes[begin:end]))

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    # -- parsing -------------------------------------------------------------------------------------------
    def _bytes(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            raise ValueError("the file ends inside its header (truncated?)")
        b = self._buf[self._pos: self._pos + n]
        self._pos += n
        return b

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._bytes(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._bytes(self._unpack("<Q")).decode("utf-8")

    def _value(self, kind: int, key: str):
        if kind == STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind != ARRAY:
            raise ValueError(f"metadata {key!r} has the unknown value type {kind}")
        item, n = self._unpack("<I"), self._unpack("<Q")
        if item in _NUMPY:  # numbers: one read for the whole array
            dtype = np.dtype(_NUMPY[item])
            return np.frombuffer(self._bytes(n * dtype.itemsize), dtype=dtype).tolist()
        return [self._value(item, key) for _ in range(n)]


_PLAIN = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "F64": "<f8"}  # stored as plain numbers


def dequantize(t: GGUFTensor) -> np.ndarray:
    """The tensor's values as fp32, shaped ``t.shape`` (a fresh array)."""
    name = t.type_name
    if name in ("F32", "F16"):
        return t.data.view("<f4" if name == "F32" else "<f2").astype(np.float32).reshape(t.shape)
    if name == "BF16":  # the top half of an fp32
        return (t.data.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
    if name in _PLAIN:
        return t.data.view(_PLAIN[name]).astype(np.float32).reshape(t.shape)
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        blocks = t.data.reshape(-1, TYPES[t.type][2])
        d = blocks[:, :2].view("<f2").astype(np.float32)  # (blocks, 1): every block starts with its fp16 scale
        if name == "Q8_0":  # d · q, q int8
            return (blocks[:, 2:].view(np.int8).astype(np.float32) * d).reshape(t.shape)
        qs = blocks[:, 4 if name == "Q4_1" else 2:]  # 32 4-bit q: low nibbles are values 0-15, high ones 16-31
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if name == "Q4_0":
            return (d * (q - 8)).reshape(t.shape)
        return (d * q + blocks[:, 2:4].view("<f2").astype(np.float32)).reshape(t.shape)  # d · q + min
    try:
        import gguf
    except ImportError:
        raise ValueError(f"tensor {t.name} is stored as {name}, which attnlab dequantises with the 'gguf' "
                         "package: pip install 'attnlab[pretrained]'") from None
    try:
        values = gguf.quants.dequantize(t.data.reshape(-1, t.shape[-1] // TYPES[t.type][1] * TYPES[t.type][2]),
                                        gguf.GGMLQuantizationType(t.type))
    except (NotImplementedError, ValueError) as e:
        raise ValueError(f"tensor {t.name} is stored as {name}, which neither attnlab nor the 'gguf' package "
                         f"dequantises ({e})") from None
    return values.astype(np.float32).reshape(t.shape)


def _values(t: GGUFTensor, path) -> np.ndarray:
    try:
        return dequantize(t)
    except ValueError as e:  # a type nothing here dequantises: say which file
        raise ValueError(f"{path}: {e}") from None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs → two halves per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return GGUFFile(path)
    except (ValueError, OverflowError, MemoryError) as e:  # truncated or not GGUF (bad UTF-8 is a ValueError)
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


def gguf_hf_config(reader, path: str = "") -> dict:
    """The file's metadata as a Hugging Face ``LlamaConfig`` dict (its architecture must be Llama)."""
    arch = reader.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (attnlab reads 'llama')")
    def g(key, default=None):
        value = reader.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: the GGUF metadata has no llama.{key} (an incomplete Llama file)")
        return value

    d_model, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    eos = int(reader.get("tokenizer.ggml.eos_token_id", 2))
    # The metadata as a Hugging Face LlamaConfig: from here on the GGUF file is read by the same
    # Llama rules as an HF folder (interop/hf.py), so the layout is written once.
    return {
        "model_type": "llama", "vocab_size": int(g("vocab_size", len(reader.get("tokenizer.ggml.tokens", [])))),
        "hidden_size": d_model, "num_attention_heads": n_heads,
        "num_key_value_heads": int(g("attention.head_count_kv", n_heads)), "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")), "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)), "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        "pad_token_id": int(reader.get("tokenizer.ggml.padding_token_id", eos)),
        "bos_token_id": int(reader.get("tokenizer.ggml.bos_token_id", 1)), "eos_token_id": eos,
    }


# GGUF tensor names → Hugging Face Llama names (llama.cpp's convert script, in reverse).
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj",
                    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}


def gguf_config(reader, path: str = "", meta: dict | None = None) -> TransformerConfig:
    """The attnlab config of a Llama GGUF file (through the HF Llama config rule; ``meta``: its
    ``gguf_hf_config``, if already made)."""
    from .hf import _ConfigDict, _llama_config
    meta = gguf_hf_config(reader, path) if meta is None else meta
    return _llama_config(_ConfigDict(meta)).replace(
        unk_id=int(reader.get("tokenizer.ggml.unknown_token_id", 0)), name=str(reader.get("general.name", "gguf")))


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, chat_template or None) from a Llama-architecture GGUF file."""
    reader = read_gguf(path)
    meta = gguf_hf_config(reader, str(path))
    cfg = gguf_config(reader, str(path), meta)
    tensors = {t.name: t for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.n_decoder_layers)
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_gate", "ffn_up", "ffn_down", "ffn_norm")}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:3]}{' …' if len(missing) > 3 else ''} (truncated or not Llama?)")

    from .hf import _ConfigDict, from_state_dict
    hf_sd = {}
    for name, t in tensors.items():
        stem, _, leaf = name.rpartition(".")
        if stem.startswith("blk."):
            _, i, kind = stem.split(".", 2)
            if kind not in GGUF_LAYER_NAMES:
                continue
            hf_name = f"model.layers.{i}.{GGUF_LAYER_NAMES[kind]}.{leaf}"
            arr = _values(t, path)
            if kind in ("attn_q", "attn_k"):  # llama.cpp's interleaved-RoPE row order → "rotate half"
                arr = _unpermute(arr, cfg.n_heads if kind == "attn_q" else cfg.kv_heads)
        elif stem in GGUF_NAMES:
            hf_name, arr = f"{GGUF_NAMES[stem]}.{leaf}", _values(t, path)
        else:
            continue
        hf_sd[hf_name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    model = from_state_dict(_ConfigDict(meta), hf_sd, "model")
    model.config = cfg  # the same model, with the file's unknown-token id and name
    model.to(dtype).eval()
    return model, gguf_tokenizer(reader, cfg), reader.get("tokenizer.chat_template")


def gguf_tokenizer(reader, cfg: TransformerConfig):
    """A byte-level BPE tokenizer from ``tokenizer.ggml.*`` (GPT-2 style vocabularies)."""
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as TK
    from tokenizers import decoders, models, pre_tokenizers

    from ..data.tokenizer import Tokenizer
    kind = reader.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (attnlab reads byte-level BPE 'gpt2')")
    tokens = [str(t) for t in reader.get("tokenizer.ggml.tokens")]
    merges = [tuple(str(m).split(" ", 1)) for m in reader.get("tokenizer.ggml.merges")]
    types = list(reader.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tk = TK(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = reader.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's SmolLM pre-tokenizer: every digit alone, then GPT-2's split
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                                                    byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if int(ty) == 3])  # 3 = CONTROL
    return Tokenizer(tk, pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id, unk_id=cfg.unk_id)
