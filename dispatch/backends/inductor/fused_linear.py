"""fused_linear through inductor: the eager forward (GEMM with the activation fused into its epilogue
or a following pointwise kernel, as inductor decides) and the eager backward, each compiled as one
graph with the token dimension dynamic."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from dispatch.backends.eager import fused_linear as eager
from dispatch.backends.inductor.compiler import run
from dispatch.contracts.backend import Kernels
from dispatch.ops.fused_linear import Grads, Needs, inference_of


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    return run(eager.forward, (x, weight, bias, activation), rows=(0,))


def backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], saved: Optional[Tensor],
             activation: str, needs: Needs) -> Grads:  # fmt: skip
    args = (grad_y, x, weight, bias, saved, activation, needs)
    return run(eager.backward, args, rows=(0, 1, 4))


KERNELS = Kernels(forward=forward, backward=backward, inference=inference_of(forward))
