"""bias_act_dropout on PyTorch ops: the spec's reference (``dispatch.ops.bias_act_dropout``) as a
forward and a backward, the math in float32 for half inputs, the spec's mask regenerated from ``rng``
in backward instead of stored. nvfuser and inductor compile these two functions.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATIONS, composed_backward
from dispatch.contracts.backend import Kernels
from dispatch.contracts.op import compute_dtype
from dispatch.contracts.rng import Rng


def _pre_activation(x: Tensor, bias: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    z = x.to(dtype, memory_format=torch.contiguous_format, copy=True)  # (M, N)
    if bias is not None:
        z += bias.to(dtype)
    return z


def _mask_scale(y: Tensor, p: float, rng: Optional[Rng]) -> Tensor:
    """y * keep * scale, as F.dropout computes it (input * mask * scale): a dropped NaN or inf gives
    NaN (NaN * 0, inf * 0), a dropped finite value 0 (-0 if negative); a select would give 0 for all.
    The mask multiplies first: (y * scale) * 0 would turn a dropped 3e38 into inf * 0 = NaN. Out of
    place: ``y`` may be the caller's grad_y. Two passes, as the select's y * scale and where."""
    if rng is None:
        return y
    keep = dropout_rng.keep_mask(rng, y.shape[0], y.shape[1], p, y.device)
    return y * keep * dropout_rng.keep_scale(p)


def forward(
    x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]
) -> Tensor:
    z = _pre_activation(x, bias, compute_dtype(x.dtype))
    return _mask_scale(ACTIVATIONS[activation].forward(z), p, rng).to(x.dtype)


def backward(grad_y: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng],
        need_x: bool, need_bias: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    dtype = compute_dtype(x.dtype)
    z = _pre_activation(x, bias, dtype)
    # grad_y * keep * scale: F.dropout's backward (native_dropout_backward: grad * mask * scale)
    act, grad = ACTIVATIONS[activation], _mask_scale(grad_y.to(dtype), p, rng)
    # PyTorch's own backward kernel where it has one: one pass instead of the derivative's ~12
    grad_z = act.backward(grad, z) if act.backward is not None else composed_backward(act, grad, z)
    grad_x = grad_z.to(x.dtype) if need_x else None
    grad_bias = grad_z.sum(0).to(bias.dtype) if need_bias and bias is not None else None
    return grad_x, grad_bias


KERNELS = Kernels(forward=forward, backward=backward, inference=forward)
