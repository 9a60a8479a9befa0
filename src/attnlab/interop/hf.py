"""Hugging Face transformers ⇄ attnlab, weights copied exactly.

``from_hf(hf_model)`` returns an attnlab model with the same weights (and the same outputs);
``to_hf(model)`` goes the other way. Supported architectures: BART, Marian, GPT-2, BERT, Llama.
``transformers`` is an optional extra (``pip install attnlab[hf]``), imported only here.

Each architecture is one table of rules "attnlab tensor = f(HF tensors)", read left-to-right by
``from_hf`` and right-to-left by ``to_hf``; that table is the clearest statement of how the two
code bases name the same parts of the Transformer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TransformerConfig
from ..model import build_model
from ..model.transformer import TransformerBase

ARCHITECTURES = ("bart", "marian", "gpt2", "bert", "llama")


def _transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("attnlab.interop.hf needs the 'transformers' package: "
                          "pip install 'attnlab[hf]'") from None
    return transformers


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


# -- public API -----------------------------------------------------------------------------------


def _prefixed(rules: list[Rule], prefix: str) -> list[Rule]:
    """HF keys are written relative to the base model; '^' marks keys of the task head."""
    def key(k: str) -> str:
        return k[1:] if k.startswith("^") else prefix + k
    return [Rule(r.ours, tuple(key(k) for k in r.hf), r.kind) for r in rules]


def from_hf(hf_model) -> TransformerBase:
    """An attnlab model with the weights of a Hugging Face BART, Marian, GPT-2, BERT or Llama model
    (base model or one with its LM / classification head)."""
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return from_state_dict(hf_model.config, sd, hf_model.base_model_prefix)


# Defaults of the HF config fields used above, for config.json files that omit them.
_DEFAULTS = {
    "bart": dict(dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, activation_function="gelu",
                 scale_embedding=False, init_std=0.02, max_position_embeddings=1024, pad_token_id=1,
                 bos_token_id=0, eos_token_id=2, share_encoder_decoder_embeddings=True, decoder_vocab_size=None),
    "marian": dict(dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, activation_function="gelu",
                   scale_embedding=False, init_std=0.02, max_position_embeddings=1024, pad_token_id=None,
                   bos_token_id=None, eos_token_id=0, share_encoder_decoder_embeddings=True, decoder_vocab_size=None),
    "gpt2": dict(n_inner=None, resid_pdrop=0.1, attn_pdrop=0.1, activation_function="gelu_new",
                 layer_norm_epsilon=1e-5, initializer_range=0.02, bos_token_id=50256, eos_token_id=50256),
    "bert": dict(hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 layer_norm_eps=1e-12, initializer_range=0.02, type_vocab_size=2, pad_token_id=0,
                 max_position_embeddings=512, num_labels=2),
    "llama": dict(attention_dropout=0.0, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                  initializer_range=0.02, attention_bias=False, mlp_bias=False, pad_token_id=None,
                  bos_token_id=1, eos_token_id=2, rope_theta=10000.0, rope_parameters=None, head_dim=None,
                  num_key_value_heads=None, max_position_embeddings=2048),
}


class _ConfigDict:
    """Attribute access over a config.json dict, with the architecture's defaults."""

    def __init__(self, data: dict):
        self._data = dict(data)
        arch = self._data.get("model_type")
        self._defaults = _DEFAULTS.get(arch, {})
        if arch == "llama" and self._data.get("num_key_value_heads") is None:
            self._data["num_key_value_heads"] = self._data.get("num_attention_heads")
        if arch == "bert" and "id2label" in self._data:
            self._data.setdefault("num_labels", len(self._data["id2label"]))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._data:
            return self._data[name]
        if name in self._defaults:
            return self._defaults[name]
        raise AttributeError(f"config.json has no field {name!r}")


def from_state_dict(c, sd: dict, base_prefix: str = "", pooling: str | None = None) -> TransformerBase:
    """The shared path of from_hf and load_hf_folder: an HF config (object or _ConfigDict) and a
    state dict, mapped by the architecture's rules."""
    arch = c.model_type
    prefix = base_prefix + "." if base_prefix and any(k.startswith(base_prefix + ".") for k in sd) else ""
    if arch in ("bart", "marian"):
        cfg = _seq2seq_config(c, arch)
    elif arch == "gpt2":
        cfg = _gpt2_config(c)
    elif arch == "bert":
        n_classes = c.num_labels if "classifier.weight" in sd else 0
        cfg = _bert_config(c, n_classes, pooler=f"{prefix}pooler.dense.weight" in sd and pooling is None)
        if pooling:
            cfg = cfg.replace(pooling=pooling)
    elif arch == "llama":
        cfg = _llama_config(c)
    else:
        raise ValueError(f"unsupported architecture {arch!r}; attnlab.interop.hf supports {', '.join(ARCHITECTURES)}")
    model = build_model(cfg, init=False)  # every weight is loaded next (checked)
    ours = {}
    for rule in _prefixed(_rules(cfg, arch), prefix):
        if rule.hf[0] not in sd and rule.ours == "lm_head.bias":  # a base model has no final_logits_bias
            ours[rule.ours] = torch.zeros(cfg.target_vocab_size)
            continue
        missing = [k for k in rule.hf if k not in sd]
        if missing:
            raise ValueError(f"{arch} weights lack {missing[0]!r} (needed for {rule.ours}); "
                             "is the file truncated or of another architecture?")
        ours[rule.ours] = rule.to_ours(sd)
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if unexpected or set(missing) - {"lm_head.weight", "tgt_embed.token.weight"}:
        raise RuntimeError(f"{arch}: unmapped attnlab parameters {missing}, unexpected {unexpected}")
    return model


def load_hf_folder(path, pooling: str | None = None) -> TransformerBase:
    """A Hugging Face model folder (config.json + model.safetensors) of a supported architecture,
    read directly: ``transformers`` is not needed."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    d = Path(path)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d}: no config.json (not a Hugging Face model folder)")
    try:
        data = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{d / 'config.json'}: not UTF-8 text (expected JSON)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{d / 'config.json'}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{d / 'config.json'}: expected a JSON object of config fields")
    c = _ConfigDict(data)
    weights = d / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"{d}: no model.safetensors")
    try:
        sd = load_file(str(weights))
    except Exception as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    base = {"bart": "model", "marian": "model", "gpt2": "transformer", "bert": "bert", "llama": "model"}.get(c.model_type, "")
    return from_state_dict(c, sd, base, pooling)


def infer_architecture(cfg: TransformerConfig) -> str:
    if cfg.family == "encoder-decoder":
        return "marian" if cfg.positions == "sinusoidal" else "bart"
    if cfg.family == "encoder-only":
        return "bert"
    return "llama" if cfg.positions == "rope" else "gpt2"


def to_hf(model: TransformerBase, architecture: str | None = None):
    """A Hugging Face model (BartForConditionalGeneration, MarianMTModel, GPT2LMHeadModel,
    BertModel / BertForSequenceClassification, LlamaForCausalLM) with this model's weights."""
    tf = _transformers()
    cfg = model.config
    arch = architecture or infer_architecture(cfg)
    c = _hf_config(tf, cfg, arch)
    if arch == "bart":
        hf = tf.BartForConditionalGeneration(c)
    elif arch == "marian":
        hf = tf.MarianMTModel(c)
    elif arch == "gpt2":
        hf = tf.GPT2LMHeadModel(c)
    elif arch == "bert":
        hf = (tf.BertForSequenceClassification(c) if cfg.n_classes
              else tf.BertModel(c, add_pooling_layer=cfg.pooler_activation))
    elif arch == "llama":
        hf = tf.LlamaForCausalLM(c)
    else:
        raise ValueError(f"unsupported architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    prefix = hf.base_model_prefix + "."
    if not any(k.startswith(prefix) for k in hf.state_dict()):
        prefix = ""
    ours = model.state_dict()
    target = hf.state_dict()
    new = {}
    for rule in _prefixed(_rules(cfg, arch), prefix):
        sizes = [target[k].shape[0] for k in rule.hf if k in target]
        for k, t in rule.to_hf(ours[rule.ours], sizes).items():
            if k in target:
                new[k] = t
    hf.load_state_dict(new, strict=False)
    if hasattr(hf, "tie_weights"):
        hf.tie_weights()
    return hf.eval() if not model.training else hf


def _hf_config(tf, cfg: TransformerConfig, arch: str):
    common = dict(pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id)
    if arch in ("bart", "marian"):
        kw = dict(vocab_size=cfg.vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
                  decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
                  decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
                  activation_function=_act_back(cfg.activation), dropout=cfg.dropout,
                  attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
                  max_position_embeddings=cfg.max_len, scale_embedding=cfg.embed_scale,
                  decoder_start_token_id=cfg.bos_id if arch == "bart" else cfg.pad_id, **common)
        if arch == "marian":
            return tf.MarianConfig(decoder_vocab_size=cfg.target_vocab_size,
                                   share_encoder_decoder_embeddings=cfg.share_embeddings, **kw)
        return tf.BartConfig(**kw)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_len, n_embd=cfg.d_model,
                             n_layer=cfg.n_decoder_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
                             activation_function=_act_back(cfg.activation), resid_pdrop=cfg.dropout,
                             embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention_dropout,
                             layer_norm_epsilon=cfg.norm_eps, **common)
    if arch == "bert":
        return tf.BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                             num_hidden_layers=cfg.n_encoder_layers, num_attention_heads=cfg.n_heads,
                             intermediate_size=cfg.d_ff, hidden_act=_act_back(cfg.activation),
                             hidden_dropout_prob=cfg.dropout,
                             attention_probs_dropout_prob=cfg.attention_dropout,
                             max_position_embeddings=cfg.max_len, type_vocab_size=cfg.type_vocab_size,
                             layer_norm_eps=cfg.norm_eps, num_labels=max(cfg.n_classes, 2),
                             pad_token_id=cfg.pad_id)
    return tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                          num_hidden_layers=cfg.n_decoder_layers, num_attention_heads=cfg.n_heads,
                          num_key_value_heads=cfg.kv_heads, hidden_act="silu",
                          max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
                          tie_word_embeddings=cfg.tie_output, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                          rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, **common)
