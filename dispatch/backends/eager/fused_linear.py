"""fused_linear on PyTorch ops, the spec's reference (``dispatch.ops.fused_linear``) as kernels:
cuBLAS/CPU BLAS for the products (the bias in the forward product's epilogue), the activation and its
gradient from the one table, PyTorch's own activation kernels where it has them (one pass each way,
float32 math inside), else the table's derivative on float32 copies (~12 float32 passes: 1.6x
triton's time in bf16 training).

Double backward: ``autograd``'s path is torch's autograd over PyTorch's kernels, whose backward ops
have derivatives of their own; the rest (squared_relu) runs in ``dispatch.contracts.running``'s
autograd node, whose backward under ``create_graph=True`` differentiates the reference instead.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from dispatch.contracts.activations import ACTIVATIONS
from dispatch.contracts.backend import Kernels
from dispatch.contracts.op import compute_dtype
from dispatch.ops.fused_linear import Grads, Needs, backward_from_pre, inference_of


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    pre = F.linear(x, weight, bias)  # (M, N)
    if activation == "identity":
        return pre, None
    act = ACTIVATIONS[activation]
    if act.native:
        return act.forward(pre), pre
    return act.forward(pre.to(compute_dtype(x.dtype))).to(x.dtype), pre


def backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], saved: Optional[Tensor],
             activation: str, needs: Needs) -> Grads:  # fmt: skip
    return backward_from_pre(grad_y, x, weight, bias, saved, activation, needs)


def autograd(activation: str) -> bool:
    """Where ``activation`` has PyTorch kernels both ways, a call with autograd runs ``forward`` under
    torch's own autograd (the same kernels): a Python autograd node costs host time, 100-120 us per
    GPT-2 MLP block (two calls, forward and backward)."""
    act = ACTIVATIONS[activation]
    return act.native and act.backward is not None


KERNELS = Kernels(forward=forward, backward=backward, inference=inference_of(forward), autograd=autograd)
