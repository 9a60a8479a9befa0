"""The weight layout of each Hugging Face architecture as rules "attnlab tensor = f(HF tensors)", and
the HF config → attnlab config of each. Read left-to-right by ``from_hf`` and right-to-left by
``to_hf`` (``hf.py``); the GGUF reader maps llama.cpp's names to HF's and reuses the Llama rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TransformerConfig


@dataclass
class Rule:
    ours: str
    hf: tuple[str, ...]
    kind: str = "copy"  # copy | cat (ours = cat(hf...)) | T (Conv1D) | offset2 (BART) | row

    def to_ours(self, sd: dict) -> torch.Tensor:
        ts = [sd[k] for k in self.hf]
        if self.kind == "cat":
            return torch.cat(ts, 0)
        if self.kind == "T":
            return ts[0].T
        if self.kind == "offset2":
            return ts[0][2:]
        if self.kind == "row":
            return ts[0][0]
        return ts[0]

    def to_hf(self, t: torch.Tensor, sizes: list[int]) -> dict[str, torch.Tensor]:
        if self.kind == "cat":
            return dict(zip(self.hf, t.split(sizes, 0)))
        if self.kind == "T":
            return {self.hf[0]: t.T}
        if self.kind == "offset2":  # BART's two unused leading rows of the position table
            return {self.hf[0]: torch.cat([t.new_zeros(2, t.shape[1]), t], 0)}
        if self.kind == "row":
            return {self.hf[0]: t[None]}
        return {self.hf[0]: t}


def _lin(ours: str, hf: str, bias: bool = True, kind: str = "copy") -> list[Rule]:
    rules = [Rule(f"{ours}.weight", (f"{hf}.weight",), kind)]
    if bias:
        rules.append(Rule(f"{ours}.bias", (f"{hf}.bias",), "copy"))
    return rules


def _cat(ours: str, hfs: list[str], bias: bool = True) -> list[Rule]:
    rules = [Rule(f"{ours}.weight", tuple(f"{h}.weight" for h in hfs), "cat")]
    if bias:
        rules.append(Rule(f"{ours}.bias", tuple(f"{h}.bias" for h in hfs), "cat"))
    return rules


def _norm(ours: str, hf: str, bias: bool = True) -> list[Rule]:
    return _lin(ours, hf, bias)


# -- per-architecture configs and rules -----------------------------------------------------------


def _act(name: str) -> str:
    return {"gelu": "gelu", "relu": "relu", "swish": "silu", "silu": "silu", "gelu_new": "gelu_tanh",
            "gelu_pytorch_tanh": "gelu_tanh"}.get(name) or _unsupported(f"activation {name!r}")


def _act_back(name: str) -> str:
    return {"gelu": "gelu", "relu": "relu", "silu": "swish", "gelu_tanh": "gelu_new"}[name]


def _unsupported(what: str):
    raise ValueError(f"unsupported {what} for attnlab.interop.hf")


def _seq2seq_config(c, arch: str) -> TransformerConfig:
    if c.encoder_attention_heads != c.decoder_attention_heads or c.encoder_ffn_dim != c.decoder_ffn_dim:
        _unsupported("encoder/decoder of different widths")
    marian = arch == "marian"
    tgt_vocab = getattr(c, "decoder_vocab_size", None) or c.vocab_size
    share = getattr(c, "share_encoder_decoder_embeddings", True)
    return TransformerConfig(
        family="encoder-decoder", vocab_size=c.vocab_size,
        tgt_vocab_size=None if share else tgt_vocab,
        d_model=c.d_model, n_heads=c.encoder_attention_heads, n_encoder_layers=c.encoder_layers,
        n_decoder_layers=c.decoder_layers, d_ff=c.encoder_ffn_dim, dropout=c.dropout,
        attention_dropout=c.attention_dropout, activation_dropout=c.activation_dropout,
        activation=_act(c.activation_function), norm_placement="post", final_norm=False,
        positions="sinusoidal" if marian else "learned",
        sinusoidal_layout="split", max_len=c.max_position_embeddings,
        embedding_norm=not marian, embed_scale=bool(c.scale_embedding), tie_output=True,
        share_embeddings=share, bias=True, output_bias=True, init="normal", init_std=c.init_std,
        pad_id=c.pad_token_id, bos_id=c.bos_token_id if c.bos_token_id is not None else c.pad_token_id,
        eos_id=c.eos_token_id, unk_id=c.pad_token_id, name=arch)


def _seq2seq_rules(cfg: TransformerConfig, arch: str) -> list[Rule]:
    r: list[Rule] = []
    if cfg.share_embeddings:
        r.append(Rule("src_embed.token.weight", ("shared.weight",)))
    else:
        r += [Rule("src_embed.token.weight", ("encoder.embed_tokens.weight",)),
              Rule("tgt_embed.token.weight", ("decoder.embed_tokens.weight",))]
    for side, emb in (("encoder", "src_embed"), ("decoder", "tgt_embed")):
        if arch == "bart":
            r.append(Rule(f"{emb}.position.weight", (f"{side}.embed_positions.weight",), "offset2"))
            r += _norm(f"{emb}.norm", f"{side}.layernorm_embedding")
    for i in range(cfg.n_encoder_layers):
        a, b = f"encoder.layers.{i}", f"encoder.layers.{i}"
        r += _cat(f"{a}.self_attn.qkv_proj", [f"{b}.self_attn.{p}_proj" for p in "qkv"])
        r += _lin(f"{a}.self_attn.out_proj", f"{b}.self_attn.out_proj")
        r += _norm(f"{a}.attn_residual.norm", f"{b}.self_attn_layer_norm")
        r += _lin(f"{a}.feed_forward.w_in", f"{b}.fc1") + _lin(f"{a}.feed_forward.w_out", f"{b}.fc2")
        r += _norm(f"{a}.ffn_residual.norm", f"{b}.final_layer_norm")
    for i in range(cfg.n_decoder_layers):
        a, b = f"decoder.layers.{i}", f"decoder.layers.{i}"
        r += _cat(f"{a}.self_attn.qkv_proj", [f"{b}.self_attn.{p}_proj" for p in "qkv"])
        r += _lin(f"{a}.self_attn.out_proj", f"{b}.self_attn.out_proj")
        r += _norm(f"{a}.attn_residual.norm", f"{b}.self_attn_layer_norm")
        r += _lin(f"{a}.cross_attn.q_proj", f"{b}.encoder_attn.q_proj")
        r += _cat(f"{a}.cross_attn.kv_proj", [f"{b}.encoder_attn.{p}_proj" for p in "kv"])
        r += _lin(f"{a}.cross_attn.out_proj", f"{b}.encoder_attn.out_proj")
        r += _norm(f"{a}.cross_residual.norm", f"{b}.encoder_attn_layer_norm")
        r += _lin(f"{a}.feed_forward.w_in", f"{b}.fc1") + _lin(f"{a}.feed_forward.w_out", f"{b}.fc2")
        r += _norm(f"{a}.ffn_residual.norm", f"{b}.final_layer_norm")
    r.append(Rule("lm_head.bias", ("^final_logits_bias",), "row"))  # ^: outside the base model
    return r


def _gpt2_config(c) -> TransformerConfig:
    return TransformerConfig(
        family="decoder-only", vocab_size=c.vocab_size, d_model=c.n_embd, n_heads=c.n_head,
        n_decoder_layers=c.n_layer, d_ff=c.n_inner or 4 * c.n_embd, dropout=c.resid_pdrop,
        attention_dropout=c.attn_pdrop, activation=_act(c.activation_function), norm_placement="pre",
        norm_eps=c.layer_norm_epsilon, positions="learned", max_len=c.n_positions,
        embed_scale=False, tie_output=True, bias=True, init="normal", init_std=c.initializer_range,
        pad_id=0, bos_id=c.bos_token_id, eos_id=c.eos_token_id, unk_id=c.eos_token_id, name="gpt2")


def _gpt2_rules(cfg: TransformerConfig) -> list[Rule]:
    r = [Rule("embed.token.weight", ("wte.weight",)), Rule("embed.position.weight", ("wpe.weight",))]
    for i in range(cfg.n_decoder_layers):
        a, b = f"decoder.layers.{i}", f"h.{i}"
        r += _lin(f"{a}.self_attn.qkv_proj", f"{b}.attn.c_attn", kind="T")
        r += _lin(f"{a}.self_attn.out_proj", f"{b}.attn.c_proj", kind="T")
        r += _norm(f"{a}.attn_residual.norm", f"{b}.ln_1")
        r += _lin(f"{a}.feed_forward.w_in", f"{b}.mlp.c_fc", kind="T")
        r += _lin(f"{a}.feed_forward.w_out", f"{b}.mlp.c_proj", kind="T")
        r += _norm(f"{a}.ffn_residual.norm", f"{b}.ln_2")
    return r + _norm("decoder.norm", "ln_f")


def _bert_config(c, n_classes: int, pooler: bool) -> TransformerConfig:
    return TransformerConfig(
        family="encoder-only", vocab_size=c.vocab_size, d_model=c.hidden_size,
        n_heads=c.num_attention_heads, n_encoder_layers=c.num_hidden_layers, d_ff=c.intermediate_size,
        dropout=c.hidden_dropout_prob, attention_dropout=c.attention_probs_dropout_prob,
        activation=_act(c.hidden_act), norm_placement="post", final_norm=False, norm_eps=c.layer_norm_eps,
        positions="learned", max_len=c.max_position_embeddings, type_vocab_size=c.type_vocab_size,
        embedding_norm=True, embed_scale=False, tie_output=True, bias=True, init="normal",
        init_std=c.initializer_range, n_classes=n_classes, pooling="cls", pooler_activation=pooler,
        pad_id=c.pad_token_id or 0, bos_id=0, eos_id=0, unk_id=0, name="bert")


def _bert_rules(cfg: TransformerConfig) -> list[Rule]:
    e = "embeddings"
    r = [Rule("embed.token.weight", (f"{e}.word_embeddings.weight",)),
         Rule("embed.position.weight", (f"{e}.position_embeddings.weight",)),
         Rule("embed.token_type.weight", (f"{e}.token_type_embeddings.weight",))]
    r += _norm("embed.norm", f"{e}.LayerNorm")
    for i in range(cfg.n_encoder_layers):
        a, b = f"encoder.layers.{i}", f"encoder.layer.{i}"
        r += _cat(f"{a}.self_attn.qkv_proj", [f"{b}.attention.self.{p}" for p in ("query", "key", "value")])
        r += _lin(f"{a}.self_attn.out_proj", f"{b}.attention.output.dense")
        r += _norm(f"{a}.attn_residual.norm", f"{b}.attention.output.LayerNorm")
        r += _lin(f"{a}.feed_forward.w_in", f"{b}.intermediate.dense")
        r += _lin(f"{a}.feed_forward.w_out", f"{b}.output.dense")
        r += _norm(f"{a}.ffn_residual.norm", f"{b}.output.LayerNorm")
    if cfg.pooler_activation:
        r += _lin("pooler", "pooler.dense")
    if cfg.n_classes:
        r += [Rule("classifier.1.weight", ("^classifier.weight",)), Rule("classifier.1.bias", ("^classifier.bias",))]
    return r


def _llama_config(c) -> TransformerConfig:
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        _unsupported(f"rope_type {rope.get('rope_type')!r}")
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        _unsupported("head_dim * num_attention_heads != hidden_size")
    if getattr(c, "attention_bias", False) != getattr(c, "mlp_bias", False):
        _unsupported("attention_bias != mlp_bias")
    return TransformerConfig(
        family="decoder-only", vocab_size=c.vocab_size, d_model=c.hidden_size,
        n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
        n_decoder_layers=c.num_hidden_layers, d_ff=c.intermediate_size, dropout=0.0,
        attention_dropout=c.attention_dropout, activation={"silu": "swiglu"}.get(c.hidden_act)
        or _unsupported(f"Llama hidden_act {c.hidden_act!r}"), norm="rmsnorm", norm_eps=c.rms_norm_eps,
        norm_placement="pre", positions="rope", rope_theta=float(theta), max_len=c.max_position_embeddings,
        embed_scale=False, tie_output=bool(c.tie_word_embeddings), bias=bool(getattr(c, "attention_bias", False)),
        init="normal", init_std=c.initializer_range,
        pad_id=c.pad_token_id if c.pad_token_id is not None else 0,
        bos_id=c.bos_token_id if c.bos_token_id is not None else 0,
        eos_id=c.eos_token_id if isinstance(c.eos_token_id, int) else 0, unk_id=0, name="llama")


def _llama_rules(cfg: TransformerConfig) -> list[Rule]:
    r = [Rule("embed.token.weight", ("embed_tokens.weight",))]
    b_ = cfg.bias
    for i in range(cfg.n_decoder_layers):
        a, b = f"decoder.layers.{i}", f"layers.{i}"
        r += _cat(f"{a}.self_attn.qkv_proj", [f"{b}.self_attn.{p}_proj" for p in "qkv"], b_)
        r += _lin(f"{a}.self_attn.out_proj", f"{b}.self_attn.o_proj", b_)
        r += [Rule(f"{a}.attn_residual.norm.weight", (f"{b}.input_layernorm.weight",))]
        r += _cat(f"{a}.feed_forward.w_in", [f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj"], b_)
        r += _lin(f"{a}.feed_forward.w_out", f"{b}.mlp.down_proj", b_)
        r += [Rule(f"{a}.ffn_residual.norm.weight", (f"{b}.post_attention_layernorm.weight",))]
    r.append(Rule("decoder.norm.weight", ("norm.weight",)))
    if not cfg.tie_output:
        r.append(Rule("lm_head.weight", ("^lm_head.weight",)))
    return r


def _rules(cfg: TransformerConfig, arch: str) -> list[Rule]:
    if arch in ("bart", "marian"):
        return _seq2seq_rules(cfg, arch)
    return {"gpt2": _gpt2_rules, "bert": _bert_rules, "llama": _llama_rules}[arch](cfg)


def _prefixed(rules: list[Rule], prefix: str) -> list[Rule]:
    """HF keys are written relative to the base model; '^' marks keys of the task head."""
    def key(k: str) -> str:
        return k[1:] if k.startswith("^") else prefix + k
    return [Rule(r.ours, tuple(key(k) for k in r.hf), r.kind) for r in rules]
