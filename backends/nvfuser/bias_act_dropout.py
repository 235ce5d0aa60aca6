"""bias_act_dropout through memory_efficient_fusion: the eager forward and the eager backward, each
traced by AOTAutograd and compiled by TorchScript for its call signature.

Forward and backward are separate gradient-free functions, so nothing is saved between them: the
backward graph regenerates the dropout mask from ``rng`` with the same traced int64 ops as the
forward graph (``dispatch.rng``), which is why both give eager's mask bit for bit.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from backends.eager import bias_act_dropout as eager
from backends.nvfuser.compiler import run, signature


def forward(
    x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Tensor]
) -> Tensor:
    key = ("bias_act_dropout.forward", activation, p, signature(x, bias, rng))
    return run(key, lambda x, b, r: eager.forward(x, b, activation, p, r), x, bias, rng)


def backward(
    grad_y: Tensor,
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Tensor],
    need_x: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    need_bias = need_bias and bias is not None
    if not (need_x or need_bias):
        return None, None
    key = ("bias_act_dropout.backward", activation, p, need_x, need_bias, signature(grad_y, x, bias, rng))

    def grads(g, x, b, r):
        return eager.backward(g, x, b, activation, p, r, need_x, need_bias)

    return run(key, grads, grad_y, x, bias, rng)
