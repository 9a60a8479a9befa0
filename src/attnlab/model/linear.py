"""The linear layer of every projection in attnlab, with a faster CPU path for inference.

Why a subclass of ``nn.Linear`` at all: on CPU, PyTorch's ``F.linear`` goes to MKL, which reads the
(out, in) weight in its stored layout at every call. oneDNN can instead *pre-pack* the weight once
into the blocked layout its kernels stream best (what ``torch.compile`` does on CPU when it freezes
weights). Measured side by side on a 2-core AVX-512 machine (``benchmarks/linear_kernels.py``):
SmolLM2's 211 decode-step matrix-vector products 2.2–3.0× faster in fp32 and 1.3–2.1× in bf16; the
64–256-row products of batched translation 2.4–2.8× in fp32, 1.1–1.7× in bf16.

The packed weight is a cache, never state: it is made on the first call that can use it and made
again whenever the weight changes (PyTorch bumps a tensor's version counter on every in-place
update, e.g. an optimizer step; ``.to()`` and ``load_state_dict`` give new storage or a new
version), so training and reloading stay correct. It is used only where nothing needs gradients
(``torch.no_grad()`` / ``inference_mode``), on CPU, in fp32 or bf16, outside autocast (which must keep
choosing the compute dtype) and outside ``torch.compile`` (which packs weights itself when it freezes
them). It costs one extra copy of the weights in memory; ``ATTNLAB_PACKED_LINEAR=0`` (or
``attnlab.model.linear.PACKED = False``) turns it off.

Whether this CPU can pack a dtype at all is a capability, probed once (``attnlab.accel``): oneDNN's
bf16 packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, so on an AVX2-only CPU bf16 inputs take the
plain ``F.linear`` path, with identical results.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..accel import onednn_linear_ops, packed_linear_ok

PACKED = True  # programmatic switch; the environment's ATTNLAB_PACKED_LINEAR=0 is checked in accel
_PACK_ROWS_HINT = 64  # packing for 64 rows serves 1…256-row inputs well (measured); 1 does not
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module → (source, key, packed)


_ONEDNN = onednn_linear_ops()
if _ONEDNN:
    _REORDER = torch.ops.mkldnn._reorder_linear_weight.default
    _LINEAR = torch.ops.mkldnn._linear_pointwise.default


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) with the pre-packed CPU inference path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (PACKED and _ONEDNN and x.device.type == "cpu" and x.dtype == w.dtype
                and x.dim() >= 2 and x.numel()
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
                and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
                and packed_linear_ok(w.dtype)):
            try:
                # In-place updates bump the version; .to() and .data = swap the storage.
                key = (w._version, w.data_ptr(), w.dtype)
            except RuntimeError:  # an inference-mode tensor has no version counter: no cache
                return F.linear(x, w, self.bias)
            entry = _packed.get(self)
            # The entry holds the storage it was packed from, so no new weight can reuse its address.
            if entry is None or entry[1] != key:
                entry = (w.detach(), key, _REORDER(w.detach(), _PACK_ROWS_HINT))
                _packed[self] = entry
            return _LINEAR(x, entry[2], None if self.bias is None else self.bias.detach(), "none", [], "")
        return F.linear(x, w, self.bias)
