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


def _t5_act(feed_forward_proj: str) -> str:
    """T5's ``feed_forward_proj`` is ``ACT`` (wi → act → wo) or ``gated-ACT`` (act(wi_0 x) · wi_1 x → wo).
    HF runs "gated-gelu" with gelu_new (the tanh approximation), as Mesh TensorFlow did."""
    gated, _, act = feed_forward_proj.rpartition("-")
    if not gated:
        names = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                 "silu": "silu", "swish": "silu"}
    elif gated == "gated":  # attnlab's GLU variants: no ReLU gate (ReGLU)
        names = {"gelu": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu_pytorch_tanh": "geglu_tanh",
                 "silu": "swiglu", "swish": "swiglu"}
    else:
        names = {}
    return names.get(act) or _unsupported(f"T5 feed_forward_proj {feed_forward_proj!r} (attnlab has "
                                          "relu, gelu, gelu_new, silu, gated-gelu and gated-silu)")


def _t5_act_back(activation: str) -> str:
    return {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu",
            "geglu_tanh": "gated-gelu", "swiglu": "gated-silu"}.get(activation) or _unsupported(
        f"activation {activation!r} in a T5 model")


def _t5_scales_output(c) -> bool:
    """Whether HF multiplies the decoder output by d_model^-0.5 before lm_head. transformers < 5 does
    it iff tie_word_embeddings; transformers 5 keeps that answer in ``scale_decoder_outputs`` and
    always sets tie_word_embeddings=True (a checkpoint's own lm_head.weight then unties it)."""
    scale = getattr(c, "scale_decoder_outputs", None)
    return bool(c.tie_word_embeddings if scale is None else scale)


def _t5_config(c, encoder_only: bool, own_head: bool) -> TransformerConfig:
    """``own_head``: the weights hold an lm_head.weight that differs from the shared embedding (T5
    v1.1). ``encoder_only``: T5EncoderModel, read as an attnlab encoder (hidden states only)."""
    if c.d_kv * c.num_heads != c.d_model:
        _unsupported(f"T5 with d_kv * num_heads = {c.d_kv} * {c.num_heads} != d_model = {c.d_model} "
                     "(attnlab's heads split d_model)")
    scale = _t5_scales_output(c) and not encoder_only
    if own_head and scale:
        _unsupported("T5 with its own lm_head.weight and the tied-embedding rescale (tie_word_embeddings)")
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, (list, tuple)) else c.eos_token_id
    pad = c.pad_token_id if c.pad_token_id is not None else 0
    start = getattr(c, "decoder_start_token_id", None)  # T5 starts decoding from the pad token
    return TransformerConfig(
        family="encoder-only" if encoder_only else "encoder-decoder", vocab_size=c.vocab_size,
        d_model=c.d_model, n_heads=c.num_heads, n_encoder_layers=c.num_layers,
        n_decoder_layers=c.num_decoder_layers or c.num_layers, d_ff=c.d_ff, dropout=c.dropout_rate,
        attention_dropout=c.dropout_rate, activation_dropout=c.dropout_rate,
        activation=_t5_act(c.feed_forward_proj), norm="rmsnorm", norm_eps=c.layer_norm_epsilon,
        norm_placement="pre", final_norm=True, positions="t5", rel_buckets=c.relative_attention_num_buckets,
        rel_max_distance=c.relative_attention_max_distance, attention_scale=False, embed_scale=False,
        tie_output=not own_head, tied_output_scale=scale, share_embeddings=True, bias=False,
        output_bias=False, init="t5", pad_id=pad, bos_id=pad if start is None else start,
        eos_id=1 if eos is None else eos, unk_id=2 if c.vocab_size > 2 else 0, name="t5")


def _t5_rules(cfg: TransformerConfig) -> list[Rule]:
    """T5 numbers the sublayers of a block: layer.0 self-attention, (decoder) layer.1 cross-attention,
    last the feed-forward; each with its own pre-norm ``layer_norm``. The relative-position table
    lives in the first block's self-attention and serves the whole stack; no linear has a bias."""
    r = [Rule(f"{'src_embed' if cfg.has_decoder else 'embed'}.token.weight", ("shared.weight",))]
    stacks = [("encoder", cfg.n_encoder_layers)]
    if cfg.has_decoder:
        stacks.append(("decoder", cfg.n_decoder_layers))
    for side, n_layers in stacks:
        r.append(Rule(f"{side}.relative_bias.weight",
                      (f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)))
        for i in range(n_layers):
            a, b = f"{side}.layers.{i}", f"{side}.block.{i}.layer"
            r += _cat(f"{a}.self_attn.qkv_proj", [f"{b}.0.SelfAttention.{p}" for p in "qkv"], False)
            r += _lin(f"{a}.self_attn.out_proj", f"{b}.0.SelfAttention.o", False)
            r += _norm(f"{a}.attn_residual.norm", f"{b}.0.layer_norm", False)
            ff = 1
            if side == "decoder":
                ff = 2
                r += _lin(f"{a}.cross_attn.q_proj", f"{b}.1.EncDecAttention.q", False)
                r += _cat(f"{a}.cross_attn.kv_proj", [f"{b}.1.EncDecAttention.{p}" for p in "kv"], False)
                r += _lin(f"{a}.cross_attn.out_proj", f"{b}.1.EncDecAttention.o", False)
                r += _norm(f"{a}.cross_residual.norm", f"{b}.1.layer_norm", False)
            d = f"{b}.{ff}.DenseReluDense"
            if cfg.activation in ("geglu_tanh", "swiglu"):  # attnlab's w_in is [gate; up]
                r += _cat(f"{a}.feed_forward.w_in", [f"{d}.wi_0", f"{d}.wi_1"], False)
            else:
                r += _lin(f"{a}.feed_forward.w_in", f"{d}.wi", False)
            r += _lin(f"{a}.feed_forward.w_out", f"{d}.wo", False)
            r += _norm(f"{a}.ffn_residual.norm", f"{b}.{ff}.layer_norm", False)
        r += _norm(f"{side}.norm", f"{side}.final_layer_norm", False)
    if cfg.has_decoder and not cfg.tie_output:
        r.append(Rule("lm_head.weight", ("^lm_head.weight",)))
    return r


def _vit_config(c, n_classes: int, pooler: bool) -> TransformerConfig:
    size, patch = c.image_size, c.patch_size
    if isinstance(size, (list, tuple)):  # attnlab's images are square
        size = size[0] if len(set(size)) == 1 else _unsupported(f"ViT image_size {size} (not square)")
    if isinstance(patch, (list, tuple)):
        patch = patch[0] if len(set(patch)) == 1 else _unsupported(f"ViT patch_size {patch} (not square)")
    if not c.qkv_bias:  # attnlab's bias flag covers every linear; ViT's output projections keep theirs
        _unsupported("ViT with qkv_bias=False")
    if pooler and (getattr(c, "pooler_act", "tanh") != "tanh"
                   or (getattr(c, "pooler_output_size", None) or c.hidden_size) != c.hidden_size):
        _unsupported("a ViT pooler other than dense(hidden_size) + tanh")
    return TransformerConfig(
        family="encoder-only", vocab_size=1, image_size=size, patch_size=patch, n_channels=c.num_channels,
        d_model=c.hidden_size, n_heads=c.num_attention_heads, n_encoder_layers=c.num_hidden_layers,
        d_ff=c.intermediate_size, dropout=c.hidden_dropout_prob, attention_dropout=c.attention_probs_dropout_prob,
        activation=_act(c.hidden_act), norm_placement="pre", final_norm=True, norm_eps=c.layer_norm_eps,
        positions="learned", max_len=(size // patch) ** 2 + 1, embed_scale=False, tie_output=False, bias=True,
        init="normal", init_std=c.initializer_range, n_classes=n_classes, pooling="cls",
        pooler_activation=pooler, pad_id=0, bos_id=0, eos_id=0, unk_id=0, name="vit")


# ViT's layer names on disk (every checkpoint; also transformers < 5 in memory) and in transformers
# 5's modules, which rename the file's keys while loading and back while saving.
_VIT_NAMES = {
    "file": dict(layer="encoder.layer", q="attention.attention.query", k="attention.attention.key",
                 v="attention.attention.value", o="attention.output.dense", fc1="intermediate.dense",
                 fc2="output.dense"),
    "modules": dict(layer="layers", q="attention.q_proj", k="attention.k_proj", v="attention.v_proj",
                    o="attention.o_proj", fc1="mlp.fc1", fc2="mlp.fc2"),
}


def _vit_layout(keys) -> str:
    return "file" if any(".encoder.layer." in k or k.startswith("encoder.layer.") for k in keys) else "modules"


def _vit_rules(cfg: TransformerConfig, layout: str = "file") -> list[Rule]:
    """A Pre-Norm BERT over patches: ``layernorm_before`` / ``layernorm_after`` are the two pre-norms,
    ``layernorm`` the final one; the (1, N+1, d) position table is one row of ours."""
    e, n = "embeddings", _VIT_NAMES[layout]
    r = [Rule("embed.cls", (f"{e}.cls_token",)), Rule("embed.position.weight", (f"{e}.position_embeddings",), "row")]
    r += _lin("embed.proj", f"{e}.patch_embeddings.projection")
    for i in range(cfg.n_encoder_layers):
        a, b = f"encoder.layers.{i}", f"{n['layer']}.{i}"
        r += _cat(f"{a}.self_attn.qkv_proj", [f"{b}.{n[p]}" for p in "qkv"])
        r += _lin(f"{a}.self_attn.out_proj", f"{b}.{n['o']}")
        r += _norm(f"{a}.attn_residual.norm", f"{b}.layernorm_before")
        r += _lin(f"{a}.feed_forward.w_in", f"{b}.{n['fc1']}") + _lin(f"{a}.feed_forward.w_out", f"{b}.{n['fc2']}")
        r += _norm(f"{a}.ffn_residual.norm", f"{b}.layernorm_after")
    r += _norm("encoder.norm", "layernorm")
    if cfg.pooler_activation:
        r += _lin("pooler", "pooler.dense")
    if cfg.n_classes:
        r += [Rule("classifier.1.weight", ("^classifier.weight",)), Rule("classifier.1.bias", ("^classifier.bias",))]
    return r


def _rules(cfg: TransformerConfig, arch: str, keys=()) -> list[Rule]:
    """``keys``: the HF state dict's keys, where an architecture's names depend on the layout."""
    if arch in ("bart", "marian"):
        return _seq2seq_rules(cfg, arch)
    if arch == "vit":
        return _vit_rules(cfg, _vit_layout(keys))
    return {"gpt2": _gpt2_rules, "bert": _bert_rules, "llama": _llama_rules, "t5": _t5_rules}[arch](cfg)


def _prefixed(rules: list[Rule], prefix: str) -> list[Rule]:
    """HF keys are written relative to the base model; '^' marks keys of the task head."""
    def key(k: str) -> str:
        return k[1:] if k.startswith("^") else prefix + k
    return [Rule(r.ours, tuple(key(k) for k in r.hf), r.kind) for r in rules]
