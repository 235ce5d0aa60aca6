"""The norm modules over ``fused_add_rms_norm`` / ``fused_add_layer_norm``: ``FusedRMSNorm`` and
``FusedLayerNorm``, each a norm that may take the residual add before it.

``forward(x)`` is the norm of x; ``forward(x, residual)`` computes h = x + residual and returns
(norm(h), h), h the next residual stream, in one pass each way. Parameters are named as Hugging Face's
RMSNorm (``weight``) and ``nn.LayerNorm`` (``weight``, ``bias``) name theirs, so their state_dicts
load unchanged. ``offset``: the norm multiplies by (weight + offset), Gemma's (1 + w) at 1.0; the
weight starts at 1 - offset (a unit scale, as LLaMA's ones and Gemma's zeros).

Where the dispatcher picks plain PyTorch (no table, no cell) a module computes the op's baseline
directly, for the cost of one cached decision and no argument checks.

Dtypes: the op takes x, residual and the parameters in one dtype; where they differ (float32 norms in
a bfloat16 model, or under autocast) the module computes the op's baseline on them as they are, which
is the Hugging Face module's formula (LLaMA's product promotes to the weight's dtype, Gemma's and
F.layer_norm's do not). In float64 the RMSNorm computes in float64, where Hugging Face's compute in
float32 whatever x is: a patched float64 model differs from the original by float32's rounding there.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from dispatch import select
from dispatch.api import explain, fused_add_layer_norm, fused_add_rms_norm
from dispatch.memo import Memo
from dispatch.ops.add_norm import baseline, module_call
from dispatch.nn.layers import device_key
from dispatch.select import Decision

_compiling = torch.compiler.is_compiling
_requested = select._requested.get  # the use_backend() request, None outside one


def _one_dtype(x: Tensor, residual: Optional[Tensor], *params: Optional[Tensor]) -> bool:
    return all(t is None or t.dtype == x.dtype for t in (residual, *params))


class _Norm(nn.Module):
    """What the two share: the parameters' shape and start, the dtype rule, repr."""

    norm: str

    def __init__(self, hidden_size: int, eps: float, offset: float, bias: bool,
                 device: Optional[torch.device | str], dtype: Optional[torch.dtype]) -> None:  # fmt: skip
        super().__init__()
        self.hidden_size, self.eps, self.offset = hidden_size, float(eps), float(offset)
        self._memo = Memo()  # the last call's decision
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - self.offset, **factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, **factory))
        else:
            self.register_parameter("bias", None)

    def _run(self, x: Tensor, residual: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001  (nn.Module's signature)
        """Moving or casting the parameters drops the memo's plain token and span: the next call decides
        again."""
        self._memo.token = self._memo.span = None
        return super()._apply(fn, recurse)

    def _needs_grad(self, x: Tensor, residual: Optional[Tensor]) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, residual, self.weight, self.bias)
        )

    def _picks_plain(self, x: Tensor, residual: Optional[Tensor]) -> bool:
        """Whether a call on x runs plain PyTorch: x's size in the span of the memo's last plain decision
        (``memo.plain_span``), else the memo's decision."""
        grad = self._needs_grad(x, residual)
        state = (x.dtype, device_key(x), grad)  # device_key: no device object (nn.layers)
        memo = self._memo
        return memo.spans(x, state) or memo.plain(x.shape, state, lambda: module_call(x, self.norm, grad))

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x), or with a residual (norm(x + residual), x + residual)."""
        if x.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"x's last dimension must be hidden_size={self.hidden_size} of this "
                             f"{type(self).__name__}, got x of shape {tuple(x.shape)}")  # fmt: skip
        if not _compiling() and self._memo.token is select._plain_token and _requested() is None:
            y, h = baseline(x, residual, self.weight, self.bias, self.eps, self.norm, self.offset)
        elif not _one_dtype(x, residual, self.weight, self.bias) or (
                not _compiling() and self._picks_plain(x, residual)):  # fmt: skip
            y, h = baseline(x, residual, self.weight, self.bias, self.eps, self.norm, self.offset)
        else:
            y, h = self._run(x, residual)
        return y if residual is None else (y, h)

    def explain(self, x: Tensor, residual: Optional[Tensor] = None) -> Decision:
        """Which backend a call on x (and residual) runs on, by which rule, and why (print it)."""
        name = "fused_add_rms_norm" if self.norm == "rms" else "fused_add_layer_norm"
        params = (self.weight,) if self.norm == "rms" else (self.weight, self.bias)
        return explain(name, x, residual, *params, self.eps, offset=self.offset)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        bias = ", bias=False" if self.norm == "layer" and self.bias is None else ""
        return f"{self.hidden_size}, eps={self.eps}{offset}{bias}"


class FusedRMSNorm(_Norm):
    """Hugging Face's LlamaRMSNorm (``offset=0``) or GemmaRMSNorm (``offset=1``), with the residual add
    before it fused in when ``forward`` is given one.

    Equivalent PyTorch (LLaMA's; Gemma's multiplies by (1 + weight) in float32, then casts)::

        h = x + residual
        hf = h.float()
        y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    """

    norm = "rms"

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None,
                 ) -> None:  # fmt: skip
        super().__init__(hidden_size, eps, offset, False, device, dtype)

    def _run(self, x: Tensor, residual: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return fused_add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset)


class FusedLayerNorm(_Norm):
    """``nn.LayerNorm(hidden_size, eps, bias=bias)`` over the last dimension, with the residual add
    before it fused in when ``forward`` is given one.

    Equivalent PyTorch::

        h = x + residual
        y = F.layer_norm(h, (hidden_size,), weight, bias, eps)
    """

    norm = "layer"

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, offset: float = 0.0,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None,
                 ) -> None:  # fmt: skip
        super().__init__(hidden_size, eps, offset, bias, device, dtype)

    def _run(self, x: Tensor, residual: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps, offset=self.offset)
