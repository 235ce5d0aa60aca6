"""add_norm through inductor: the reference's inference (its forward too) and its explicit backward
(``dispatch/ops/add_norm_math.py``, the eager backend's kernels), each compiled as one graph with the
token dimension dynamic; the backward recomputes the rows' statistics from h, as eager's does.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from dispatch.backends.inductor.compiler import run
from dispatch.contracts.backend import Kernels
from dispatch.ops import add_norm_math as eager


def inference(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float,
              norm: str, offset: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    if residual is None:  # h is x itself, outside the graph
        return run(eager.inference, (x, None, weight, bias, eps, norm, offset), rows=(0,))[0], x
    return run(eager.inference, (x, residual, weight, bias, eps, norm, offset), rows=(0, 1))


def backward(dy: Optional[Tensor], dh: Optional[Tensor], h: Tensor, rstd: Optional[Tensor],
             mean: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float, norm: str,
             offset: float, needs: tuple[bool, bool, bool]) -> tuple[Optional[Tensor], ...]:  # fmt: skip
    if dy is None:  # only h was used: nothing to compute
        return eager.backward(dy, dh, h, None, None, weight, bias, eps, norm, offset, needs)
    args = (dy, dh, h, None, None, weight, bias, eps, norm, offset, needs)
    return run(eager.backward, args, rows=(0, 1, 2))


KERNELS = Kernels(forward=eager.forward_of(inference), backward=backward, inference=inference)
