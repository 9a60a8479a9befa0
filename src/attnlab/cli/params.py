"""attnlab params: the parameter table of a preset, config.json or model directory."""

from __future__ import annotations

HELP = "per-module parameter table and total (vs the 12·L·d² rule of thumb)"
EXAMPLES = "attnlab params paper-base\n  attnlab params my_config.json"


def arguments(p) -> None:
    p.add_argument("config", help="preset name, config.json, or model directory")


def run(args) -> int:
    from ..config import load_config
    from ..inspect.params import parameter_table
    from ..model import build_model
    model = build_model(load_config(args.config))
    cfg = model.config
    print(f"{args.config}: {cfg.family}, d_model={cfg.d_model}, heads={cfg.n_heads}"
          f" (kv {cfg.kv_heads}), layers={cfg.n_encoder_layers if cfg.has_encoder else 0}"
          f"+{cfg.n_decoder_layers if cfg.has_decoder else 0}, d_ff={cfg.d_ff}, vocab={cfg.vocab_size}")
    print(parameter_table(model))
    return 0
