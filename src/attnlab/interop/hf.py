"""Hugging Face transformers ⇄ attnlab, weights copied exactly.

``from_hf(hf_model)`` returns an attnlab model with the same weights (and the same outputs);
``to_hf(model)`` goes the other way. Supported architectures: BART, Marian, GPT-2, BERT, Llama, T5
(and T5 v1.1, T5EncoderModel), ViT.
``transformers`` is an optional extra (``pip install attnlab[hf]``), imported only here.

Each architecture is one table of rules "attnlab tensor = f(HF tensors)", read left-to-right by
``from_hf`` and right-to-left by ``to_hf``; that table is the clearest statement of how the two
code bases name the same parts of the Transformer.
"""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..model import build_model
from ..model.transformer import TransformerBase
from .hf_rules import (_act_back, _bert_config, _gpt2_config, _llama_config, _prefixed, _rules, _seq2seq_config,
                       _t5_act_back, _t5_config, _vit_config)

ARCHITECTURES = ("bart", "marian", "gpt2", "bert", "llama", "t5", "vit")


def _transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("attnlab.interop.hf needs the 'transformers' package: "
                          "pip install 'attnlab[hf]'") from None
    return transformers


# -- public API -----------------------------------------------------------------------------------


def from_hf(hf_model) -> TransformerBase:
    """An attnlab model with the weights of a Hugging Face BART, Marian, GPT-2, BERT, Llama, T5 or ViT
    model (base model or one with its LM / classification head; T5EncoderModel gives an encoder)."""
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
    "t5": dict(d_kv=64, num_decoder_layers=None, relative_attention_num_buckets=32,
               relative_attention_max_distance=128, dropout_rate=0.1, layer_norm_epsilon=1e-6,
               feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=None),
    "vit": dict(hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                initializer_range=0.02, layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3,
                qkv_bias=True, pooler_act="tanh", pooler_output_size=None, num_labels=2),
}


class _ConfigDict:
    """Attribute access over a config.json dict, with the architecture's defaults."""

    def __init__(self, data: dict):
        self._data = dict(data)
        arch = self._data.get("model_type")
        self._defaults = _DEFAULTS.get(arch, {})
        if arch == "llama" and self._data.get("num_key_value_heads") is None:
            self._data["num_key_value_heads"] = self._data.get("num_attention_heads")
        if arch in ("bert", "vit") and "id2label" in self._data:
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
    elif arch == "t5":
        # T5 v1.1 has its own output projection; transformers 5 reports tie_word_embeddings=True for
        # it all the same, so the weights decide. No decoder at all: T5EncoderModel.
        head, shared = sd.get("lm_head.weight"), sd.get("shared.weight")
        own_head = head is not None and (shared is None or not torch.equal(head, shared))
        cfg = _t5_config(c, encoder_only=not any(k.startswith("decoder.") for k in sd), own_head=own_head)
    elif arch == "vit":
        n_classes = c.num_labels if "classifier.weight" in sd else 0
        cfg = _vit_config(c, n_classes, pooler=f"{prefix}pooler.dense.weight" in sd and pooling is None)
        if pooling:
            cfg = cfg.replace(pooling=pooling)
    else:
        raise ValueError(f"unsupported architecture {arch!r}; attnlab.interop.hf supports {', '.join(ARCHITECTURES)}")
    model = build_model(cfg, init=False)  # every weight is loaded next (checked)
    ours = {}
    for rule in _prefixed(_rules(cfg, arch, sd.keys()), prefix):
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
    from pathlib import Path

    from safetensors.torch import load_file
    d = Path(path)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d}: no config.json (not a Hugging Face model folder)")
    from ..data.readers import read_json
    c = _ConfigDict(read_json(d / "config.json", "a JSON object of config fields"))
    weights = d / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"{d}: no model.safetensors")
    try:
        sd = load_file(str(weights))
    except Exception as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    base = {"bart": "model", "marian": "model", "gpt2": "transformer", "bert": "bert", "llama": "model",
            "vit": "vit"}.get(c.model_type, "")
    return from_state_dict(c, sd, base, pooling)


def infer_architecture(cfg: TransformerConfig) -> str:
    if cfg.positions == "t5":  # T5's relative positions, whatever the family
        return "t5"
    if cfg.is_image_model:
        return "vit"
    if cfg.family == "encoder-decoder":
        return "marian" if cfg.positions == "sinusoidal" else "bart"
    if cfg.family == "encoder-only":
        return "bert"
    return "llama" if cfg.positions == "rope" else "gpt2"


def to_hf(model: TransformerBase, architecture: str | None = None):
    """A Hugging Face model (BartForConditionalGeneration, MarianMTModel, GPT2LMHeadModel,
    BertModel / BertForSequenceClassification, LlamaForCausalLM, T5ForConditionalGeneration /
    T5EncoderModel, ViTModel / ViTForImageClassification) with this model's weights."""
    tf = _transformers()
    cfg = model.config
    arch = architecture or infer_architecture(cfg)
    ours = model.state_dict()
    if arch == "t5" and (cfg.embed_scale or cfg.attention_scale):
        cfg, ours = _t5_canonical(cfg, ours)
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
    elif arch == "t5":
        if cfg.has_decoder:
            hf = tf.T5ForConditionalGeneration(c)
            hf.generation_config.decoder_start_token_id = cfg.bos_id  # generate() needs it; T5: the pad id
            if not cfg.tie_output:
                _untie_lm_head(hf)
        else:
            hf = tf.T5EncoderModel(c)
    elif arch == "vit":
        hf = (tf.ViTForImageClassification(c) if cfg.n_classes
              else tf.ViTModel(c, add_pooling_layer=cfg.pooler_activation))
    else:
        raise ValueError(f"unsupported architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    prefix = hf.base_model_prefix + "."
    if not any(k.startswith(prefix) for k in hf.state_dict()):
        prefix = ""
    target = hf.state_dict()
    new = {}
    for rule in _prefixed(_rules(cfg, arch, target.keys()), prefix):
        sizes = [target[k].shape[0] for k in rule.hf if k in target]
        for k, t in rule.to_hf(ours[rule.ours], sizes).items():
            if k in target:
                new[k] = t
    hf.load_state_dict(new, strict=False)
    if hasattr(hf, "tie_weights") and not (arch == "t5" and not cfg.tie_output):  # would re-tie lm_head
        hf.tie_weights()
    return hf.eval() if not model.training else hf


def _untie_lm_head(hf) -> None:
    """T5 v1.1's output projection is its own matrix. transformers 5 ties lm_head to the shared
    embedding whatever the config says (a checkpoint with both unties them on loading): do the same."""
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone())
    tied = getattr(hf, "all_tied_weights_keys", None)
    if tied:
        tied.pop("lm_head.weight", None)  # so that save_pretrained keeps it


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
    if arch == "t5":
        _check_t5(cfg)
        return tf.T5Config(vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.head_dim, d_ff=cfg.d_ff,
                           num_layers=cfg.n_encoder_layers, num_decoder_layers=cfg.n_decoder_layers,
                           num_heads=cfg.n_heads, relative_attention_num_buckets=cfg.rel_buckets,
                           relative_attention_max_distance=cfg.rel_max_distance, dropout_rate=cfg.dropout,
                           layer_norm_epsilon=cfg.norm_eps, feed_forward_proj=_t5_act_back(cfg.activation),
                           tie_word_embeddings=cfg.tied_output_scale, pad_token_id=cfg.pad_id,
                           eos_token_id=cfg.eos_id, decoder_start_token_id=cfg.bos_id)
    if arch == "vit":
        _check_vit(cfg)
        return tf.ViTConfig(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_encoder_layers,
                            num_attention_heads=cfg.n_heads, intermediate_size=cfg.d_ff,
                            hidden_act=_act_back(cfg.activation), hidden_dropout_prob=cfg.dropout,
                            attention_probs_dropout_prob=cfg.attention_dropout, layer_norm_eps=cfg.norm_eps,
                            image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=cfg.n_channels,
                            qkv_bias=True, num_labels=max(cfg.n_classes, 2))
    return tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                          num_hidden_layers=cfg.n_decoder_layers, num_attention_heads=cfg.n_heads,
                          num_key_value_heads=cfg.kv_heads, hidden_act="silu",
                          max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
                          tie_word_embeddings=cfg.tie_output, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                          rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, **common)


def _t5_canonical(cfg: TransformerConfig, sd: dict) -> tuple[TransformerConfig, dict]:
    """A T5 stored the way ``t5-mini`` trains with AdamW → T5's own storage, the same function:

    * ``embed_scale=True`` (embedding E' = E/√d, ×√d on the way in, no output rescale) → E = √d·E',
      not scaled in, a tied output rescaled by d^-0.5: √d·E'[id] = E[id] and h·E'ᵀ = h·Eᵀ·d^-0.5;
    * ``attention_scale=True`` (scores q'·k/√d_k) → W_q = W_q'/√d_k and unscaled scores q·k."""
    if cfg.embed_scale and cfg.tied_output_scale:
        raise ValueError("to_hf('t5'): embed_scale=True with tied_output_scale=True is not a T5")
    sd = dict(sd)
    if cfg.embed_scale:
        root = cfg.d_model ** 0.5
        for k in [k for k in sd if k.endswith("embed.token.weight") or (k == "lm_head.weight" and cfg.tie_output)]:
            sd[k] = sd[k] * root  # a tied lm_head is the same tensor, listed twice
        cfg = cfg.replace(embed_scale=False, tied_output_scale=cfg.tie_output)
    if cfg.attention_scale:
        q_rows, inv = cfg.n_heads * cfg.head_dim, cfg.head_dim ** -0.5
        for k in [k for k in sd if k.endswith(("self_attn.qkv_proj.weight", "cross_attn.q_proj.weight"))]:
            w = sd[k].clone()
            w[:q_rows] *= inv
            sd[k] = w
        cfg = cfg.replace(attention_scale=False)
    return cfg, sd


def _check(arch: str, requirements) -> None:
    """(name, ok) pairs: the options HF's model has no switch for; anything else would load into a
    model that computes something different, silently."""
    wrong = [name for name, ok in requirements if not ok]
    if wrong:
        raise ValueError(f"to_hf({arch!r}) needs {', '.join(wrong)} (Hugging Face's {arch})")


def _check_t5(cfg: TransformerConfig) -> None:
    _check("t5", (
        ("norm='rmsnorm'", cfg.norm == "rmsnorm"), ("norm_placement='pre'", cfg.norm_placement == "pre"),
        ("a final norm", cfg.has_final_norm), ("bias=False", not cfg.bias and not cfg.output_bias),
        ("attention_scale=False", not cfg.attention_scale), ("embed_scale=False", not cfg.embed_scale),
        ("share_embeddings=True", cfg.share_embeddings or not cfg.has_decoder),
        ("n_kv_heads = n_heads", cfg.kv_heads == cfg.n_heads), ("no embedding_norm", not cfg.embedding_norm),
        ("no classifier", not cfg.n_classes)))


def _check_vit(cfg: TransformerConfig) -> None:
    _check("vit", (
        ("an image model", cfg.is_image_model), ("norm='layernorm'", cfg.norm == "layernorm"),
        ("norm_placement='pre'", cfg.norm_placement == "pre"), ("a final norm", cfg.has_final_norm),
        ("bias=True", cfg.bias), ("positions='learned'", cfg.positions == "learned"),
        ("attention_scale=True", cfg.attention_scale), ("n_kv_heads = n_heads", cfg.kv_heads == cfg.n_heads),
        ("pooling='cls'", cfg.pooling == "cls"),
        ("a non-gated activation", cfg.activation in ("gelu", "relu", "silu", "gelu_tanh"))))
