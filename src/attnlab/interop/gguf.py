"""Read a llama.cpp GGUF file (Llama architecture) into an attnlab DecoderOnly model, with its
tokenizer rebuilt from the file's metadata. Needs the ``gguf`` package (``attnlab[pretrained]``).

Quantised tensors (Q4_1, Q8_0, …) are dequantised to fp32 (or the requested dtype) once, at load.
llama.cpp stores W_Q and W_K rows permuted for its interleaved RoPE; they are permuted back to the
"rotate half" layout attnlab (and Hugging Face) use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import TransformerConfig


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install 'attnlab[pretrained]'") from None
    return gguf


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs → two halves per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path):
    gguf = _gguf()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # truncated or not GGUF at all
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return reader


def gguf_hf_config(reader, path: str = "") -> dict:
    """The file's metadata as a Hugging Face ``LlamaConfig`` dict (its architecture must be Llama)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (attnlab reads 'llama')")
    def g(key, default=None):
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: the GGUF metadata has no llama.{key} (an incomplete Llama file)")
        return value

    d_model, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))
    # The metadata as a Hugging Face LlamaConfig: from here on the GGUF file is read by the same
    # Llama rules as an HF folder (interop/hf.py), so the layout is written once.
    return {
        "model_type": "llama", "vocab_size": int(g("vocab_size", len(_field(reader, "tokenizer.ggml.tokens", [])))),
        "hidden_size": d_model, "num_attention_heads": n_heads,
        "num_key_value_heads": int(g("attention.head_count_kv", n_heads)), "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")), "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)), "max_position_embeddings": int(g("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", eos)),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)), "eos_token_id": eos,
    }


# GGUF tensor names → Hugging Face Llama names (llama.cpp's convert script, in reverse).
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj",
                    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}


def gguf_config(reader, path: str = "") -> TransformerConfig:
    """The attnlab config of a Llama GGUF file (through the HF Llama config rule)."""
    from .hf import _ConfigDict, _llama_config
    meta = gguf_hf_config(reader, path)
    return _llama_config(_ConfigDict(meta)).replace(
        unk_id=int(_field(reader, "tokenizer.ggml.unknown_token_id", 0)), name=str(_field(reader, "general.name", "gguf")))


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, chat_template or None) from a Llama-architecture GGUF file."""
    gguf = _gguf()
    reader = read_gguf(path)
    cfg = gguf_config(reader, str(path))
    tensors = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if arr.size != int(np.prod(shape)):
            raise ValueError(f"{path}: tensor {t.name} has {arr.size} values, expected {shape} (truncated file?)")
        tensors[t.name] = arr.reshape(shape)
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.n_decoder_layers)
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_gate", "ffn_up", "ffn_down", "ffn_norm")}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:3]}{' …' if len(missing) > 3 else ''} (truncated or not Llama?)")

    from .hf import _ConfigDict, from_state_dict
    hf_sd = {}
    for name, arr in tensors.items():
        stem, _, leaf = name.rpartition(".")
        if stem.startswith("blk."):
            _, i, kind = stem.split(".", 2)
            if kind not in GGUF_LAYER_NAMES:
                continue
            hf_name = f"model.layers.{i}.{GGUF_LAYER_NAMES[kind]}.{leaf}"
            if kind in ("attn_q", "attn_k"):  # llama.cpp's interleaved-RoPE row order → "rotate half"
                arr = _unpermute(arr, cfg.n_heads if kind == "attn_q" else cfg.kv_heads)
        elif stem in GGUF_NAMES:
            hf_name = f"{GGUF_NAMES[stem]}.{leaf}"
        else:
            continue
        hf_sd[hf_name] = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
    model = from_state_dict(_ConfigDict(gguf_hf_config(reader, str(path))), hf_sd, "model")
    model.config = cfg  # the same model, with the file's unknown-token id and name
    model.to(dtype).eval()
    return model, gguf_tokenizer(reader, cfg), _field(reader, "tokenizer.chat_template")


def gguf_tokenizer(reader, cfg: TransformerConfig):
    """A byte-level BPE tokenizer from ``tokenizer.ggml.*`` (GPT-2 style vocabularies)."""
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as TK
    from tokenizers import decoders, models, pre_tokenizers

    from ..data.tokenizer import Tokenizer
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (attnlab reads byte-level BPE 'gpt2')")
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    merges = [tuple(str(m).split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    tk = TK(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
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
