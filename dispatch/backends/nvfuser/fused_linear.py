"""fused_linear through memory_efficient_fusion: the GEMM with its bias, then the activation compiled
by TorchScript (its fuser merges the pointwise ops into one kernel); the eager backward compiled the
same way, for each call signature.

The GEMM and bias stay outside the traced graph: AOTAutograd decomposes ``F.linear`` into ``mm`` then
``add``, which rounds a half-precision pre-activation twice (the product, then the sum) where cuBLAS
adds the bias in its epilogue and rounds once. Near zero the double rounding can flip the sign, hence
relu's derivative: bf16/fp16 training gradients up to 178x the parity tolerance. TorchScript does not
fuse GEMMs, so nothing is lost by calling it eagerly.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from dispatch.backends.eager import fused_linear as eager
from dispatch.backends.nvfuser.compiler import run, signature
from dispatch.contracts.activations import ACTIVATIONS
from dispatch.contracts.backend import Kernels
from dispatch.contracts.op import compute_dtype
from dispatch.ops.fused_linear import Grads, Needs, inference_of


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    pre = F.linear(x, weight, bias)  # (M, N), rounded once
    if activation == "identity":
        return pre, None
    act = ACTIVATIONS[activation].forward
    dtype = compute_dtype(pre.dtype)
    key = ("fused_linear.activation", activation, signature(pre))
    return run(key, lambda p: act(p.to(dtype)).to(p.dtype), pre), pre


def backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], saved: Optional[Tensor],
             activation: str, needs: Needs) -> Grads:  # fmt: skip
    if saved is None and activation != "identity":
        saved = F.linear(x, weight, bias)  # the forward's pre-activation, rounded as it was
    key = ("fused_linear.backward", activation, needs, signature(grad_y, x, weight, bias, saved))

    def grads(g, x, w, b, s):
        return eager.backward(g, x, w, b, s, activation, needs)

    return run(key, grads, grad_y, x, weight, bias, saved)


KERNELS = Kernels(forward=forward, backward=backward, inference=inference_of(forward))
