"""fused_linear with the bias and the activation in cuBLASLt's GEMM epilogue, through
``torch._addmm_activation(bias, x, W^T, use_gelu)``.

PyTorch takes the cuBLASLt path when the bias is 1-D and contiguous, the dtype is float16, bfloat16,
float32 or float64, and M, N, K are all > 1; otherwise (or if cuBLASLt declines) it runs a plain GEMM
followed by ``relu_`` / ``gelu_(approximate="tanh")``: the same function, unfused. On CUDA ``use_gelu``
means the tanh approximation (the epilogue's GELU); on CPU the same op computes erf GELU, one reason
this backend is CUDA only.

The epilogue returns only the activated output. relu's backward needs no more (y > 0 exactly where
the pre-activation is > 0): forward keeps y, as torch.relu keeps its result. GELU's needs the
pre-activation, which the epilogue does not return: forward keeps nothing and backward recomputes it
with one GEMM (bias again in the epilogue), a third GEMM against eager's two plus pointwise passes,
which the calibration tables weigh. (cuBLASLt's GELU_AUX_BIAS epilogue returns it, through
nvmath-python, the optional ``cuda`` extra that triton fused_mlp's first product uses, but for one
linear layer a forward costs 174 us of host time rebinding its operands against _addmm_activation's
22, for 2% of GPU time.)
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from dispatch.contracts.backend import Kernels
from dispatch.ops.fused_linear import Grads, Needs, backward_from_pre, inference_of

USE_GELU = {"relu": False, "gelu_tanh": True}


@functools.lru_cache(maxsize=16)
def _zero_bias(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    # The epilogue needs a bias vector to stay on the cuBLASLt path; a shared zero one is read-only.
    return torch.zeros(n, dtype=dtype, device=device)


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    if bias is None:
        bias = _zero_bias(weight.shape[0], x.dtype, x.device)
    y = torch._addmm_activation(bias.contiguous(), x, weight.t(), use_gelu=USE_GELU[activation])  # (M, N)
    # relu's backward needs only where y > 0 (where the pre-activation is > 0): keep y, no recompute
    return y, y if activation == "relu" else None


def backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], saved: Optional[Tensor],
             activation: str, needs: Needs) -> Grads:  # fmt: skip
    """PyTorch defines no derivative for ``_addmm_activation``. With z = x W^T + b recomputed (unless
    another backend's forward saved it): grad_z = grad_y * act'(z) from the one activation table,
    grad_x = grad_z W, grad_W = grad_z^T x, grad_b = sum_rows grad_z; the eager backward computes
    exactly this."""
    return backward_from_pre(grad_y, x, weight, bias, saved, activation, needs)


KERNELS = Kernels(forward=forward, backward=backward, inference=inference_of(forward))
