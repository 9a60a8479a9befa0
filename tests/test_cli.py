import subprocess
import sys

from attnlab.cli import main


def test_params_prints_table_and_exact_total(capsys):
    assert main(["params", "paper-base"]) == 0
    out = capsys.readouterr().out
    assert "63,082,496" in out and "rule of thumb" in out and "encoder.layers.*.self_attn" in out


def test_params_from_config_json(tmp_path, capsys):
    from attnlab import get_preset
    get_preset("llama-mini").to_json(tmp_path / "config.json")
    assert main(["params", str(tmp_path / "config.json")]) == 0
    assert "decoder.layers.*.self_attn" in capsys.readouterr().out


def test_shapes_lists_every_stage(capsys):
    assert main(["shapes", "mt-tiny"]) == 0
    out = capsys.readouterr().out
    assert "src_embed.position" in out and "decoder.layers.1.cross_attn" in out
    assert "lm_head" in out and "(2, 9, 1000)" in out


def test_bad_config_is_a_clear_error(capsys):
    assert main(["params", "no-such-preset"]) == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "attnlab", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "params" in out.stdout
