"""Gradient clipping by the global norm: every gradient scaled by max_norm / ‖g‖ when the norm of all of them
together, ‖g‖, exceeds max_norm. One bad batch then moves the weights a bounded step, and the direction of the
update is kept (clipping each gradient on its own, or each element, would turn it)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

_CLIP: dict = {}  # "ok" → whether attnlab::clip_grad_norm_ is built and right here (once per process)


def clip_grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` (the L2 norm of all gradients together, returned;
    each gradient times max_norm / (norm + 1e-6) where that is below 1). Where every gradient is a contiguous fp32
    CPU tensor and attnlab's kernel builds (``csrc/grad_norm.cpp``, :func:`fused_clip`), in two passes over all of
    them together instead of two operators per parameter; the same result but for the norm's last bit (its sum in
    float64, torch's in float32). A gradient given twice goes to torch, which scales it twice."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if (grads and all(type(g) is torch.Tensor and g.device.type == "cpu" and g.dtype == torch.float32
                      and g.layout == torch.strided and g.is_contiguous() for g in grads)
            and len({g.data_ptr() for g in grads}) == len(grads)  # (one gradient twice: torch scales it twice)
            and fused_clip()):
        with torch.no_grad():
            return torch.ops.attnlab.clip_grad_norm_(grads, float(max_norm))
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def fused_clip() -> bool:
    """Whether :func:`clip_grad_norm` takes attnlab's kernel (``csrc/grad_norm.cpp``): as
    ``accel.own_kernel_serves`` says (not ``ATTNLAB_OWN_KERNELS=0``, Linux, built once per process, and right on
    a check)."""
    from .. import accel
    return accel.own_kernel_serves(_CLIP, _build_fused_clip)


def _build_fused_clip() -> bool:
    def check():
        # against float64: gradients whose sizes end inside a chunk and a vector, both sides of max_norm
        g = torch.Generator().manual_seed(0)
        for max_norm in (1.0, 1e4):
            grads = [torch.randn(n, generator=g) for n in (1, 7, 16391, 40000)]
            want64 = torch.cat([x.double() for x in grads]).norm()
            scale = min(1.0, max_norm / (float(want64) + 1e-6))
            want = [(x.double() * scale) for x in grads]
            norm = torch.ops.attnlab.clip_grad_norm_(grads, max_norm)
            if not (abs(float(norm) - float(want64)) <= 1e-6 * float(want64)
                    and all(torch.allclose(x.double(), w, rtol=1e-6, atol=0) for x, w in zip(grads, want))):
                return False
        return True

    def clip_grad_norm_(grads, max_norm):
        return grads[0].new_empty(())

    from .. import accel
    from ..model.layers import _own_kernel
    suffix, cflags = accel.own_kernel_target()
    return _own_kernel("gradient-clipping kernel", "torch.nn.utils.clip_grad_norm_", "attnlab_grad_norm" + suffix,
                       "grad_norm.cpp", cflags, {"clip_grad_norm_": clip_grad_norm_}, check)
