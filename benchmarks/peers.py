"""Loading the peers that the benchmarks (and the oracle tests) set attnlab against."""
from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock


def transformers_from_gguf(path: Path, dtype=None):
    """transformers' own model of the GGUF file ``path`` (``AutoModelForCausalLM.from_pretrained(gguf_file=...)``,
    dequantised to ``dtype``, fp32 by default), in eval mode.

    Load time only: transformers builds gguf's name map of the whole model (``gguf.get_tensor_name_map``) once for
    each of the model's modules, ~400 times for SmolLM2-135M, 8.9 s of a 33.6 s load under cProfile on a 2-core AVX2
    EPYC. The map depends only on the architecture and the layer count, so here one map serves every module; the
    weights and what they are converted with are transformers' and gguf's own."""
    import gguf
    import torch
    import transformers
    path = Path(path)
    with mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map)):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=dtype or torch.float32)
    return model.eval()
