"""fused_mlp through inductor: the eager forward (which keeps pre) and the eager backward (which
regenerates both masks and the hidden activation from pre), each compiled as one graph with the token
dimension dynamic (x, grad_y and pre's dim 0).

The compiler keys a kind of call per argument, so the wrappers take the block flat, tensors then
settings, and rebuild the ``MLPOperands`` inside the graph. Both rngs travel as int64 tensors, as
bias_act_dropout's: the masks come from the traced ``dispatch.contracts.rng`` ops, eager's bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from dispatch.backends.eager import fused_mlp as eager
from dispatch.backends.inductor.compiler import run
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.backend import Kernels
from dispatch.ops.fused_mlp_math import MLPOperands


def _forward(x, w_in, w_up, b_in, b_up, w_out, b_out, activation, p, p_out, rng_hidden, rng_out):
    return eager.forward(
        MLPOperands(x, w_in, w_up, b_in, b_up, w_out, b_out, activation, p, p_out), (rng_hidden, rng_out)
    )


def _backward(
    grad_y, x, w_in, w_up, b_in, b_up, w_out, b_out, pre, activation, p, p_out, rng_hidden, rng_out, needs
):
    b = MLPOperands(x, w_in, w_up, b_in, b_up, w_out, b_out, activation, p, p_out)
    return eager.backward(grad_y, b, (rng_hidden, rng_out), (pre,), needs)


def _traced(rngs: tuple, b: MLPOperands) -> tuple[Optional[Tensor], ...]:
    """Host integers would be baked into the graph as constants (a recompile per call): tensors."""
    return tuple(None if r is None or p == 0.0 else dropout_rng.as_tensor(r, b.x.device)
                 for r, p in zip(rngs, (b.p, b.p_out)))  # fmt: skip


def forward(b: MLPOperands, rngs: tuple) -> tuple[Tensor, Any]:
    return run(_forward, (*b, *_traced(rngs, b)), rows=(0,))


def inference(b: MLPOperands, rngs: tuple) -> Tensor:
    return forward(b, rngs)[0]


def backward(
    grad_y: Tensor, b: MLPOperands, rngs: tuple, saved: tuple, needs: tuple
) -> tuple[Optional[Tensor], ...]:
    (pre,) = saved
    args = (grad_y, *b.tensors, pre, *b[7:], *_traced(rngs, b), tuple(needs))
    return run(_backward, args, rows=(0, 1, 8))


KERNELS = Kernels(forward=forward, backward=backward, inference=inference)
