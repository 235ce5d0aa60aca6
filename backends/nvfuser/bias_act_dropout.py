"""bias_act_dropout through memory_efficient_fusion: the forward and the backward math, each traced
by AOTAutograd and compiled by TorchScript for its call signature.

The dropout mask is NOT computed inside the TorchScript graph: on the H200 (torch 2.11, 2026-11-30)
NNC's CUDA code for the int64 Philox arithmetic gave the backward graph a different mask than the
forward graph (tests/test_compiled_backends.py::test_compiled_dropout_masks_gpu). So both passes draw
the mask with ``dispatch.rng``'s plain torch ops (bit-identical to eager) and the fused graph takes it
as an input; nothing is saved between forward and backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


from backends.nvfuser.compiler import run, signature
from dispatch import rng as dropout_rng
from dispatch.rng import Rng
from dispatch.activations import ACTIVATIONS


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pre_activation(x: Tensor, bias: Optional[Tensor]) -> Tensor:
    z = x.to(_compute_dtype(x.dtype))
    return z if bias is None else z + bias.to(z.dtype)


def _keep(x: Tensor, p: float, rng: Optional[Rng]) -> Optional[Tensor]:
    return None if rng is None else dropout_rng.keep_mask(rng, x.shape[0], x.shape[1], p, x.device)


def forward(
    x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]
) -> Tensor:
    keep = _keep(x, p, rng)
    scale = dropout_rng.keep_scale(p)
    act = ACTIVATIONS[activation].forward

    def math(x, b, keep):
        y = act(_pre_activation(x, b))
        if keep is not None:
            y = torch.where(keep, y * scale, 0.0)
        return y.to(x.dtype).contiguous()

    key = ("bias_act_dropout.forward", activation, p, signature(x, bias, keep))
    return run(key, math, x, bias, keep)


def backward(
    grad_y: Tensor,
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Rng],
    need_x: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    need_bias = need_bias and bias is not None
    if not (need_x or need_bias):
        return None, None
    keep = _keep(x, p, rng)
    scale = dropout_rng.keep_scale(p)
    derivative = ACTIVATIONS[activation].derivative

    def grads(g, x, b, keep):
        g = g.to(_compute_dtype(x.dtype))
        if keep is not None:
            g = torch.where(keep, g * scale, 0.0)
        grad_z = g * derivative(_pre_activation(x, b))
        grad_x = grad_z.to(x.dtype) if need_x else None
        grad_b = grad_z.sum(0).to(b.dtype) if need_bias else None
        return grad_x, grad_b

    key = ("bias_act_dropout.backward", activation, p, need_x, need_bias, signature(grad_y, x, bias, keep))
    return run(key, grads, grad_y, x, bias, keep)
