"""The per-op modules: ``FusedLinear`` (a linear layer with its activation, and dropout) and
``FusedBiasActDropout``, and what every module of ``dispatch.nn`` shares (autocast's cast, checks)."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor, nn

from dispatch.api import fused_bias_act_dropout, fused_linear
from dispatch.contracts.activations import get_activation

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)  # autocast never casts float64


def _device_type(x: Tensor) -> str:
    """x.device.type without ``x.device`` for CUDA and CPU tensors: in a host-bound training step the
    device object and its type string cost ~4 us a call (2-core CPU, a 4-token MLP step)."""
    return "cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type


def device_key(x: Tensor) -> object:
    """Which device x is on, as cheaply as ``_device_type``: a CUDA index, -1 for the CPU, else the device."""
    return x.get_device() if x.is_cuda else -1 if x.is_cpu else x.device


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast would give a linear layer on x's device, or None outside autocast."""
    if not _any_autocast():
        return None
    device_type = _device_type(x)
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in _AUTOCAST_DTYPES else None


def _cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    if t is None or t.dtype == dtype or t.dtype not in _CASTABLE:
        return t
    return t.to(dtype)


def _check_p(name: str, p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {p!r}")
    return float(p)


class FusedLinear(nn.Module):
    """Activation(x @ weight.T + bias): ``nn.Linear`` plus an activation, fused in the matmul epilogue.

    Equivalent PyTorch::

        nn.Dropout(dropout)(act(nn.Linear(in_features, out_features, bias)(x)))

    ``dropout`` (default 0): in training mode with ``dropout > 0`` bias, activation and dropout run in
    one ``fused_bias_act_dropout`` pass after the GEMM (the mask regenerated in backward, never
    stored); otherwise, as with no dropout, bias and activation are the GEMM's epilogue.
    ``transposed``: ``weight`` is stored (in_features, out_features), Hugging Face ``Conv1D``'s layout
    (``dispatch.patch`` reuses a Conv1D's parameter this way); the function is the same.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "identity",
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        dropout: float = 0.0,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        get_activation(activation)
        if type(transposed) is not bool:
            raise TypeError(f"transposed must be a bool, got {transposed!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.dropout = _check_p("dropout", dropout)
        self.transposed = transposed
        factory = {"device": device, "dtype": dtype}
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization: weight U(-1/sqrt(in), 1/sqrt(in)) via kaiming_uniform(a=sqrt(5)),
        bias U(-1/sqrt(in), 1/sqrt(in))."""
        weight = self.weight.t() if self.transposed else self.weight  # (out, in): fan_in = in_features
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"x's last dimension must be in_features={self.in_features} of this FusedLinear, "
                f"got x of shape {tuple(x.shape)}"
            )
        weight, bias = self.weight, self.bias
        dtype = _autocast_dtype(x)
        if dtype is not None:
            x, weight, bias = _cast(x, dtype), _cast(weight, dtype), _cast(bias, dtype)
        if self.transposed:
            # after the cast, which then writes the stored layout: inductor lays a cast of the transposed
            # view out (out, in) and feeds the GEMM that copy: 48 extra transposing copy kernels a step
            # in compiled patched GPT-2
            weight = weight.t()
        if not self.training or self.dropout == 0.0:
            return fused_linear(x, weight, bias, self.activation)
        y = fused_linear(x, weight, None)
        return fused_bias_act_dropout(y, bias, self.activation, self.dropout, True)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation!r}"
            + (f", dropout={self.dropout}" if self.dropout else "")
            + (", transposed=True" if self.transposed else "")
        )


class FusedBiasActDropout(nn.Module):
    """Dropout(Activation(x + bias)) in one pass; the module owns the bias (N,), initialized to zero.

    Dropout runs in training mode only (``module.training``) and follows ``dispatch.contracts.rng``'s
    spec: the mask is regenerated in backward, never stored.

    Equivalent PyTorch::

        nn.Dropout(p)(act(x + bias))   # up to the choice of random bits
    """

    def __init__(
        self,
        features: int,
        activation: str = "gelu",
        p: float = 0.0,
        bias: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        get_activation(activation)
        self.features = features
        self.activation = activation
        self.p = _check_p("p", p)
        if bias:
            self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return fused_bias_act_dropout(x, bias, self.activation, self.p, self.training)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"features={self.features}, activation={self.activation!r}, p={self.p}, bias={bias}"


def is_conv1d(module: object) -> bool:
    """Hugging Face's Conv1D, known by name (transformers is never imported): weight stored (in, out)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def linear_layout(module: object) -> Optional[bool]:
    """True for a linear layer storing its weight (in, out) (Hugging Face's Conv1D, FusedLinear with
    ``transposed=True``), False for (out, in) (nn.Linear, FusedLinear), None for anything else (a
    FusedLinear with an activation or dropout included)."""
    if type(module) is nn.Linear:
        return False
    if type(module) is FusedLinear and module.activation == "identity" and module.dropout == 0.0:
        return module.transposed
    return True if is_conv1d(module) else None


