"""attnlab — the Transformer of "Attention Is All You Need", as readable, fast, real software."""

from .config import PRESETS, ConfigError, TransformerConfig, get_preset, load_config
from .model import DecoderOnly, EncoderDecoder, EncoderOnly, build_model
from .modeldir import load

__version__ = "0.1.0"

__all__ = ["TransformerConfig", "ConfigError", "PRESETS", "get_preset", "load_config",
           "EncoderDecoder", "DecoderOnly", "EncoderOnly", "build_model", "load", "__version__"]
