"""attnlab — the Transformer of "Attention Is All You Need", as readable, fast, real software.

``attnlab.load(name_or_dir)`` is the inference API (translate, generate, stream, embed, classify,
score, attention); ``build_model(config)`` builds a bare network.
"""

from .api import LoadedModel, load
from .config import PRESETS, ConfigError, TransformerConfig, get_preset, load_config
from .generate.search import GenerationConfig
from .model import DecoderOnly, EncoderDecoder, EncoderOnly, build_model

__version__ = "0.1.0"

__all__ = ["load", "LoadedModel", "GenerationConfig", "TransformerConfig", "ConfigError", "PRESETS", "get_preset",
           "load_config", "EncoderDecoder", "DecoderOnly", "EncoderOnly", "build_model", "__version__"]
