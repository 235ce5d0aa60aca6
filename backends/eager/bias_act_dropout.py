"""The reference semantics of bias_act_dropout: Dropout(Activation(x + bias)).

``reference`` is the differentiable definition (autograd gives the reference gradients, ``upcast``
computes in float64 for checks); ``forward``/``backward`` are what the eager backend runs, with the
mask regenerated from ``rng`` in backward instead of stored.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATIONS, composed_backward
from dispatch.contracts.rng import Rng


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def reference(
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float = 0.0,
    rng: Optional[Rng] = None,
    upcast: bool = False,
) -> Tensor:
    """Differentiable reference on (..., N) inputs; float64 when ``upcast``, else x's dtype."""
    n = x.shape[-1]
    dtype = torch.float64 if upcast else x.dtype
    z = x.reshape(-1, n).to(dtype)
    if bias is not None:
        z = z + bias.to(dtype)
    y = ACTIVATIONS[activation].forward(z)
    if rng is not None:
        keep = dropout_rng.keep_mask(rng, z.shape[0], n, p, z.device)
        y = y * keep * dropout_rng.keep_scale(p)  # F.dropout's product: see _mask_scale
    return y.reshape(x.shape)


def forward(
    x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]
) -> Tensor:
    z = _pre_activation(x, bias, _compute_dtype(x.dtype))
    return _mask_scale(ACTIVATIONS[activation].forward(z), p, rng).to(x.dtype)


def traced(x: Tensor, bias: Optional[Tensor], activation: str, p: float) -> Tensor:
    """What ``torch.compile`` traces when no backend is requested: the ops a model would write for
    bias + activation + ``nn.Dropout`` in x's dtype (inductor computes a fused kernel's intermediates
    in float32 and rounds once, so explicit casts would only add graph nodes). Inductor fuses it with
    the neighbouring ops and draws the mask with its own generator, as for ``nn.Dropout``: the mask
    then follows inductor's RNG, not ``dispatch.contracts.rng``'s spec."""
    y = ACTIVATIONS[activation].forward(x if bias is None else x + bias)
    return torch.nn.functional.dropout(y, p, training=True) if p > 0.0 else y


def backward(
    grad_y: Tensor,
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Rng],
    need_x: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    dtype = _compute_dtype(x.dtype)
    z = _pre_activation(x, bias, dtype)
    # grad_y * keep * scale: F.dropout's backward (native_dropout_backward: grad * mask * scale)
    act, grad = ACTIVATIONS[activation], _mask_scale(grad_y.to(dtype), p, rng)
    # PyTorch's own backward kernel where it has one: one pass instead of the derivative's ~12
    grad_z = act.backward(grad, z) if act.backward is not None else composed_backward(act, grad, z)
    grad_x = grad_z.to(x.dtype) if need_x else None
    grad_bias = grad_z.sum(0).to(bias.dtype) if need_bias and bias is not None else None
    return grad_x, grad_bias
