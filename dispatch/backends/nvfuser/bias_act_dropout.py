"""bias_act_dropout through memory_efficient_fusion: the eager forward and the eager backward, each
traced by AOTAutograd and compiled by TorchScript for its call signature.

Forward and backward are separate gradient-free functions with nothing saved between them: the
backward graph regenerates the dropout mask from ``rng`` with the same traced int64 ops as the
forward graph (``dispatch.contracts.rng``), so both give eager's mask bit for bit.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from dispatch.backends.eager import bias_act_dropout as eager
from dispatch.backends.nvfuser.compiler import run, signature
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.backend import Kernels
from dispatch.contracts.rng import Rng


def _traced(rng: Optional[Rng], x: Tensor) -> Optional[Tensor]:
    """The graph takes the rng as a tensor input: host integers would be traced in as constants."""
    return None if rng is None else dropout_rng.as_tensor(rng, x.device)


def forward(x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]) -> Tensor:
    r = _traced(rng, x)
    key = ("bias_act_dropout.forward", activation, p, signature(x, bias, r))
    return run(key, lambda x, b, r: eager.forward(x, b, activation, p, r), x, bias, r)


def backward(grad_y: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng],
        need_x: bool, need_bias: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    r = _traced(rng, x)
    key = ("bias_act_dropout.backward", activation, p, need_x, need_bias, signature(grad_y, x, bias, r))

    def grads(g, x, b, r):
        return eager.backward(g, x, b, activation, p, r, need_x, need_bias)

    return run(key, grads, grad_y, x, bias, r)


KERNELS = Kernels(forward=forward, backward=backward, inference=forward)
