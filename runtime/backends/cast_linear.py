"""Linear layers under bf16 autocast that keep the fp32 weight, not its bf16 copy, for the backward pass.

Under autocast, ``F.linear`` casts the fp32 weight to bf16 and autograd saves that copy for the input's gradient:
a forward whose activations are kept (not checkpointed) holds a bf16 copy of every weight until its backward, 0.27
GiB for SmolLM2-135M on top of the fp32 weights. ``CastLinear`` saves the weight itself and casts it again in the
backward (one cast per layer, a few milliseconds for the whole model); the matmuls are the ones autocast runs, on
the same bf16 values, so outputs and gradients are the same (``tests/test_learning.py``). The output projection
does the same in ``runtime.backends.logprobs``. Layers whose activations are checkpointed keep the stock path
(``set_recast``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class CastLinear(torch.autograd.Function):
    """``F.linear(x.to(dtype), weight.to(dtype))`` (no bias) saving ``x``'s cast and ``weight`` for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        xc = x.to(dtype)
        ctx.save_for_backward(xc, weight)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        return F.linear(xc, weight.to(dtype))

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        xc, weight = ctx.saved_tensors
        gy = gy.to(ctx.dtype)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = gy.matmul(weight.to(ctx.dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gw = gy.reshape(-1, gy.shape[-1]).t().mm(xc.reshape(-1, xc.shape[-1])).to(weight.dtype)
        return gx, gw, None


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    device = x.device.type
    if (self.recast and self.bias is None and torch.is_grad_enabled() and self.weight.requires_grad
            and self.weight.dtype == torch.float32 and torch.is_autocast_enabled(device)):
        return CastLinear.apply(x, self.weight, torch.get_autocast_dtype(device))
    return F.linear(x, self.weight, self.bias)


def use_cast_linears(model: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> int:
    """Route ``model``'s bias-free ``nn.Linear`` layers (but ``skip``) through ``CastLinear`` whenever they run under
    autocast with gradients on; elsewhere (no autocast, no grad, a bias) they run as before. Returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m.bias is None and not any(m is s for s in skip):
            m.forward = types.MethodType(_forward, m)
            m.recast = True
            n += 1
    return n


def set_recast(module: torch.nn.Module, on: bool) -> None:
    """Switch ``CastLinear`` on or off for the routed linear layers inside ``module``. Off where the layer's
    activations are checkpointed: its recomputation in the backward saves one layer's bf16 weights at a time
    anyway, and the stock path casts each weight twice per micro-batch (forward, recomputation) where ``CastLinear``
    casts it three times (and the backward's cast of 135M weights costs ~0.1 s on 2 cores)."""
    for m in module.modules():
        if hasattr(m, "recast"):
            m.recast = on
