"""bias_act_dropout through inductor: the eager forward and the eager backward, each compiled as one
graph with the token dimension dynamic.

Forward and backward are separate compiled functions with nothing saved between them: the backward
graph regenerates the dropout mask from ``rng`` with the same int64 ops as the forward graph
(``dispatch.contracts.rng``; there is no random op for inductor to replace with its own), so both give eager's
mask bit for bit.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from dispatch.backends.eager import bias_act_dropout as eager
from dispatch.backends.inductor.compiler import run
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.backend import Kernels
from dispatch.contracts.rng import Rng


def _traced(rng: Optional[Rng], x: Tensor) -> Optional[Tensor]:
    """Host integers would be baked into the graph as constants (a recompile per call): a tensor."""
    return None if rng is None else dropout_rng.as_tensor(rng, x.device)


def forward(
    x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]
) -> Tensor:
    return run(eager.forward, (x, bias, activation, p, _traced(rng, x)), rows=(0,))


def backward(grad_y: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng],
        need_x: bool, need_bias: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    args = (grad_y, x, bias, activation, p, _traced(rng, x), need_x, need_bias)
    return run(eager.backward, args, rows=(0, 1))


KERNELS = Kernels(forward=forward, backward=backward, inference=forward)
