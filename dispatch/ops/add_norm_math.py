"""add_norm's math, the op's definition: the kernels' signatures, the reference (float64 when asked),
the baseline a user writes, and the reference as a forward and an explicit backward in torch ops (the
eager backend's kernels, which inductor compiles). ``dispatch.ops.add_norm`` builds the op on them.

With h = x + residual (PyTorch's add in x's dtype; h = x without a residual), per row of N:
    rms     hat = h * rstd,            rstd = 1 / sqrt(mean(h^2) + eps)
    layer   hat = (h - mu) * rstd,     rstd = 1 / sqrt(mean((h - mu)^2) + eps)   (biased variance)
    y = hat * (weight + offset) (+ bias)
and backward, with g = dy * (weight + offset):
    dh = dh_out + rstd * (g - hat * mean(g * hat) [- mean(g)])     (the gradient of x and of residual)
    dweight = sum over rows of dy * hat,  dbias = sum over rows of dy
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch.contracts.backend import Kernels, composite_kernels
from dispatch.contracts.op import compute_dtype

NORMS = ("rms", "layer")  # the values of the op's trait "norm"

# A backend's ``Kernels`` (dispatch.contracts.backend) for this op. x and residual (M, N), any strides
# (residual None: h is x itself), weight and bias (N,) of x's dtype (bias None for rms); y and h are
# (M, N) in x's dtype. ``rstd`` and ``mean`` are the rows' float32 statistics a kernel keeps for its
# backward (M,), or None where its backward recomputes them from h (mean None for rms).
#   forward(x, residual, weight, bias, eps, norm, offset) -> (y, h, rstd, mean)     a call with autograd
#   inference(x, residual, weight, bias, eps, norm, offset) -> (y, h)               a call without
#   backward(dy, dh, h, rstd, mean, weight, bias, eps, norm, offset, needs) -> (dh_in, dweight, dbias)
# backward: dy and dh the upstream gradients of y and h, either None where unused (not both); needs
# (h, weight, bias) says which gradients to return (None elsewhere; never an absent bias's). dh_in is
# the gradient of x and of residual both.


def _hat(h: Tensor, eps: float, norm: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hat, rstd (..., 1)) of h's rows in ``dtype``."""
    hc = h.to(dtype)
    if norm == "layer":
        hc = hc - hc.mean(-1, keepdim=True)
    rstd = torch.rsqrt(hc.pow(2).mean(-1, keepdim=True) + eps)
    return hc * rstd, rstd


def _scaled(hat: Tensor, weight: Tensor, bias: Optional[Tensor], offset: float) -> Tensor:
    y = hat * (weight.to(hat.dtype) + offset)
    return y if bias is None else y + bias.to(hat.dtype)


def reference(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float,
              norm: str, offset: float = 0.0, upcast: bool = False) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(y, h), the definition, differentiable, on (..., N) inputs: h = x + residual in x's dtype, the
    norm in float64 when ``upcast`` (y float64), else in float32 for half inputs (PyTorch's opmath) with
    y in x's dtype."""
    h = x if residual is None else x + residual
    hat, _ = _hat(h, eps, norm, torch.float64 if upcast else compute_dtype(x.dtype))
    y = _scaled(hat, weight, bias, offset)
    return (y if upcast else y.to(x.dtype)), h


def forward_of(inference: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple]:
    """A kernels' forward that keeps no statistics (its backward recomputes them from h): its
    inference's (y, h), then None, None."""

    def forward(*args: Any) -> tuple[Tensor, Tensor, None, None]:
        return (*inference(*args), None, None)

    return forward


def inference(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float,
              norm: str, offset: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The reference as kernels' inference (and forward, ``forward_of``)."""
    return reference(x, residual, weight, bias, eps, norm, offset)


def backward(dy: Optional[Tensor], dh: Optional[Tensor], h: Tensor, rstd: Optional[Tensor],
             mean: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float, norm: str,
             offset: float, needs: tuple[bool, bool, bool]) -> tuple[Optional[Tensor], ...]:  # fmt: skip
    """The module docstring's backward in torch ops, float32 math for half inputs, on (M, N) rows; the
    statistics recomputed from h (``rstd`` and ``mean`` are not read). Differentiable: a backward
    building a graph runs it on the h the forward kept."""
    if dy is None:  # only h was used: its gradient passes to x and residual
        return (dh if needs[0] else None), None, None
    dtype = compute_dtype(h.dtype)
    hat, rstd_ = _hat(h, eps, norm, dtype)
    g = dy.to(dtype)
    dweight = (g * hat).sum(0).to(weight.dtype) if needs[1] else None
    dbias = g.sum(0).to(bias.dtype) if needs[2] and bias is not None else None
    if not needs[0]:
        return None, dweight, dbias
    gw = g * (weight.to(dtype) + offset)
    dhat = gw - hat * (gw * hat).mean(-1, keepdim=True)
    if norm == "layer":
        dhat = dhat - gw.mean(-1, keepdim=True)
    dh_in = dhat * rstd_ if dh is None else dhat * rstd_ + dh.to(dtype)
    return dh_in.to(h.dtype), dweight, dbias


REFERENCE_KERNELS = Kernels(forward=forward_of(inference), backward=backward, inference=inference)


def baseline(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float,
             norm: str, offset: float = 0.0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(y, h) as a user writes them: h = x + residual, then Hugging Face's LlamaRMSNorm (float32 math,
    the normalized rows cast to x's dtype before the weight), Gemma's with an ``offset`` (weight + offset
    and the product in float32, then cast), or ``F.layer_norm``; float64 inputs keep their own precision.
    What torch.compile traces; the pytorch backend's kernels."""
    h = x if residual is None else x + residual
    if norm == "layer":
        return F.layer_norm(h, h.shape[-1:], weight + offset if offset else weight, bias, eps), h
    hf = h.to(compute_dtype(h.dtype))
    hat = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (hat * (offset + weight.to(hf.dtype))).to(h.dtype), h
    return weight * hat.to(h.dtype), h


# torch's autograd differentiates the composite; its backward as a separate call is the reference's
BASELINE_KERNELS = composite_kernels(forward_of(baseline), backward, baseline, any_shape=True)
