"""fused_linear through inductor: the eager forward (GEMM with the activation fused into its epilogue
or a following pointwise kernel, as inductor decides) and the eager backward, each compiled as one
graph with the token dimension dynamic."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from dispatch.backends.eager import fused_linear as eager
from dispatch.contracts.backend import Kernels
from dispatch.backends.inductor.compiler import run


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    return run(eager.forward, (x, weight, bias, activation), rows=(0,))


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
    args = (grad_y, x, weight, bias, saved, activation, needs)
    return run(eager.backward, args, rows=(0, 1, 4))


def inference(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    return forward(x, weight, bias, activation)[0]


KERNELS = Kernels(forward=forward, backward=backward, inference=inference)
