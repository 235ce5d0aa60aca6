"""fused_linear through memory_efficient_fusion: the eager forward (GEMM, then the activation that
TorchScript's fuser can merge into one pointwise kernel) and the eager backward, each compiled for
its call signature."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from backends.eager import fused_linear as eager
from backends.nvfuser.compiler import run, signature


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    key = ("fused_linear.forward", activation, signature(x, weight, bias))
    return run(key, lambda x, w, b: eager.forward(x, w, b, activation), x, weight, bias)


def backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    saved: Optional[Tensor],
    activation: str,
    needs: tuple[bool, bool, bool],
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    needs = (needs[0], needs[1], needs[2] and bias is not None)
    if not any(needs):
        return None, None, None
    key = ("fused_linear.backward", activation, needs, signature(grad_y, x, weight, bias, saved))

    def grads(g, x, w, b, s):
        return eager.backward(g, x, w, b, s, activation, needs)

    return run(key, grads, grad_y, x, weight, bias, saved)
