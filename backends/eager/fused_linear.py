"""The reference semantics of fused_linear: Activation(x @ W^T + b).

``reference`` is the differentiable definition (``upcast`` computes in float64); ``forward`` and
``backward`` are what the eager backend runs: cuBLAS/CPU BLAS for the products (the bias in the
forward product's epilogue), the activation and its gradient from the one table, in float32 for half
inputs: PyTorch's own activation kernels where it has them (one pass each way, float32 math inside),
else the table's derivative on float32 copies. (The derivative for every activation cost ~12 float32
passes over M x N for gelu_tanh's gradient, 1.07 ms against triton's 0.65 ms at 4096 x 3072 x 768 in
bf16 training on the H200, where PyTorch's own linear + gelu takes ~0.2 ms.)

Double backward: ``differentiable``'s path is torch's autograd over PyTorch's kernels, whose backward
ops have derivatives of their own; the rest (squared_relu) runs ``forward``/``backward`` in the
dispatcher's autograd.Function, whose backward under ``create_graph=True`` differentiates
``reference`` instead: ``backward`` here builds on the saved pre-activation, which has no graph.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch.contracts.activations import ACTIVATIONS, composed_backward


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    activation: str,
    upcast: bool = False,
) -> Tensor:
    """Differentiable reference on (..., K) inputs; float64 when ``upcast``, else x's dtype."""
    dtype = torch.float64 if upcast else x.dtype
    b = None if bias is None else bias.to(dtype)
    return ACTIVATIONS[activation].forward(F.linear(x.to(dtype), weight.to(dtype), b))


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    pre = F.linear(x, weight, bias)  # (M, N)
    if activation == "identity":
        return pre, None
    act = ACTIVATIONS[activation]
    if act.native:
        return act.forward(pre), pre
    return act.forward(pre.to(_compute_dtype(x.dtype))).to(x.dtype), pre


def traced(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    """What ``torch.compile`` traces when no backend is requested: ``nn.Linear`` + activation as a
    model writes them, in x's dtype (inductor rounds its fused epilogue once; explicit float32 casts
    would only add graph nodes)."""
    return ACTIVATIONS[activation].forward(F.linear(x, weight, bias))


def differentiable(activation: str) -> Optional[Callable[[Tensor, Tensor, Optional[Tensor], str], Tensor]]:
    """How a call with autograd runs here: ``traced`` under torch's own autograd where ``activation``
    has PyTorch kernels both ways (the kernels ``forward`` and ``backward`` launch, so the same
    numbers and saved tensors), None otherwise (the dispatcher wraps ``forward``/``backward`` in its
    autograd.Function). That Function's Python cost 100-120 us of host time per GPT-2 MLP block (two
    calls, forward and backward) on the H200's host (2026-11-30; benchmarks/PERF.md), where patched
    GPT-2 sends every bf16 training fused_linear call."""
    return traced if ACTIVATIONS[activation].native and ACTIVATIONS[activation].backward else None


def backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    saved: Optional[Tensor],
    activation: str,
    needs: tuple[bool, bool, bool],
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    act = ACTIVATIONS[activation]
    if activation == "identity":
        grad_pre = grad_y
    else:
        pre = saved if saved is not None else F.linear(x, weight, bias)
        if act.backward is not None:
            grad_pre = act.backward(grad_y, pre)
        else:
            dtype = _compute_dtype(x.dtype)
            grad_pre = composed_backward(act, grad_y.to(dtype), pre.to(dtype)).to(x.dtype)
    grad_x = grad_pre @ weight if needs[0] else None  # (M, K)
    grad_w = grad_pre.t() @ x if needs[1] else None  # (N, K)
    grad_b = None
    if needs[2] and bias is not None:
        grad_b = grad_pre.sum(0, dtype=_compute_dtype(x.dtype)).to(bias.dtype)
    return grad_x, grad_w, grad_b
