import json

import pytest

from attnlab import PRESETS, ConfigError, TransformerConfig, build_model, get_preset, load_config


@pytest.mark.parametrize("changes, message", [
    (dict(d_model=500, n_heads=8), "d_model=500 is not divisible by n_heads=8"),
    (dict(n_heads=8, n_kv_heads=3), "n_heads=8 is not divisible by n_kv_heads=3"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not one of layernorm, rmsnorm"),
    (dict(positions="relative"), "positions='relative'"),
    (dict(family="decoder-only", tgt_vocab_size=100), "tgt_vocab_size is only meaningful"),
    (dict(tgt_vocab_size=100), "share_embeddings=True needs a joint vocabulary"),
    (dict(dropout=1.5), "dropout=1.5 must be in [0, 1)"),
    (dict(n_classes=3), "n_classes (a classification head) needs family='encoder-only'"),
    (dict(d_model=72, n_heads=8, positions="rope"), "even head dimension"),
    (dict(vocab_size=2), "eos_id=2 is outside the vocabulary [0, 2)"),
])
def test_invalid_configs_name_the_field_and_rule(changes, message):
    with pytest.raises(ConfigError) as e:
        TransformerConfig(**changes)
    assert message in str(e.value)


def test_json_round_trip(tmp_path):
    cfg = get_preset("llama-mini", n_kv_heads=4)
    path = tmp_path / "config.json"
    cfg.to_json(path)
    again = TransformerConfig.from_json(path)
    assert again == cfg
    assert load_config(tmp_path) == cfg  # a model directory works too


def test_json_errors_name_file_and_field(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text('{"d_model": 64,\n "n_heads": }')
    with pytest.raises(ConfigError, match=r"c.json:2: not valid JSON"):
        TransformerConfig.from_json(bad)
    bad.write_text(json.dumps({"d_modle": 64}))
    with pytest.raises(ConfigError, match="unknown field.*d_modle"):
        TransformerConfig.from_json(bad)
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        load_config("nope")


def test_presets_build():
    for name in PRESETS:
        cfg = get_preset(name)
        assert cfg.name == name
        if name not in ("paper-big",):
            build_model(cfg)


def test_derived_fields():
    cfg = TransformerConfig(norm_placement="pre")
    assert cfg.has_final_norm and cfg.kv_heads == 8 and cfg.head_dim == 64
    assert not TransformerConfig().has_final_norm  # Post-Norm (the paper) has no final norm
