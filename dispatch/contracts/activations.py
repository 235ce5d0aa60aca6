"""The one table of activations: names, forward functions and derivatives.

Every backend uses these names; the eager reference uses these torch functions. The Triton
backend keeps jitted twins of each pair in ``dispatch/backends/triton/activations.py`` under the same names.
Half-precision inputs are computed in float32 by the callers and rounded once to the output dtype.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

LEAKY_RELU_SLOPE = 0.01
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715


class Activation(NamedTuple):
    name: str
    forward: Callable[[Tensor], Tensor]
    derivative: Callable[[Tensor], Tensor]  # d act / d z, evaluated at the pre-activation z
    # PyTorch's own kernels, where it has them: ``forward`` is one then (``native``), and ``backward``
    # (grad_y, z) -> grad_y * act'(z) is its backward kernel. Each is one pass over the tensor whose
    # math runs in float32 for half inputs, rounded once (PyTorch's opmath), so callers need no
    # float32 copies around them; None: compose ``derivative`` in float32 instead.
    native: bool = False
    backward: Optional[Callable[[Tensor, Tensor], Tensor]] = None


def _relu_grad(z: Tensor) -> Tensor:
    # 1 at NaN: threshold_backward (z <= 0 ? 0 : grad), relu's autograd, passes a NaN z's grad
    return (z <= 0).logical_not_().to(z.dtype)


def _leaky_relu_grad(z: Tensor) -> Tensor:
    return torch.where(z > 0, 1.0, torch.full_like(z, LEAKY_RELU_SLOPE))  # two scalars would give float32


def _gelu_grad(z: Tensor) -> Tensor:
    # d/dz z * Phi(z) = Phi(z) + z * phi(z)
    cdf = 0.5 * (1.0 + torch.erf(z * _INV_SQRT_2))
    pdf = torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return cdf + z * pdf


def _gelu_tanh_grad(z: Tensor) -> Tensor:
    # gelu_tanh(z) = 0.5 z (1 + tanh(u)), u = sqrt(2/pi) (z + 0.044715 z^3)
    # d/dz = 0.5 (1 + tanh(u)) + 0.5 z (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2)
    t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_C * z * z * z))
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * z * z)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du


def _squared_relu(z: Tensor) -> Tensor:
    r = torch.relu(z)
    return r * r


def _silu_grad(z: Tensor) -> Tensor:
    # d/dz z * s(z) = s(z) (1 + z (1 - s(z)))
    s = torch.sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


_aten = torch.ops.aten

ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("identity", lambda z: z, torch.ones_like, True, lambda g, z: g),
        Activation("relu", torch.relu, _relu_grad, True, lambda g, z: _aten.threshold_backward(g, z, 0)),
        Activation(
            "leaky_relu",
            lambda z: torch.nn.functional.leaky_relu(z, LEAKY_RELU_SLOPE),
            _leaky_relu_grad,
            True,
            lambda g, z: _aten.leaky_relu_backward(g, z, LEAKY_RELU_SLOPE, False),
        ),
        Activation(
            "gelu",
            torch.nn.functional.gelu,
            _gelu_grad,
            True,
            lambda g, z: _aten.gelu_backward(g, z, approximate="none"),
        ),
        Activation(
            "gelu_tanh",
            lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
            _gelu_tanh_grad,
            True,
            lambda g, z: _aten.gelu_backward(g, z, approximate="tanh"),
        ),
        Activation("squared_relu", _squared_relu, lambda z: 2.0 * torch.relu(z)),
        Activation("silu", torch.nn.functional.silu, _silu_grad, True, _aten.silu_backward),
    )
}

ACTIVATION_NAMES: tuple[str, ...] = tuple(ACTIVATIONS)


def composed_backward(act: Activation, grad: Tensor, z: Tensor) -> Tensor:
    """grad * act'(z) for an activation without a PyTorch backward kernel (``act.backward`` None), on
    float32 or float64 tensors, with the non-finite values autograd of its composite gives.

    squared_relu: autograd of relu(z) ** 2 ends in relu's threshold_backward, a select: 0 wherever
    z <= 0 even for a NaN or inf grad, where grad * 2 relu(z) would give NaN * 0 = NaN. z + z equals
    2 relu(z) wherever the select keeps it, so this stays three passes, as grad * (2 * relu(z)).
    """
    if act.name == "squared_relu":
        return _aten.threshold_backward(grad * (z + z), z, 0)
    return grad * act.derivative(z)


def get_activation(name: object) -> Activation:
    """The table entry for ``name``; a ValueError listing the valid names otherwise."""
    act = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if act is None:
        raise ValueError(
            f"activation must be one of {', '.join(ACTIVATION_NAMES)}; got {name!r}"
        )
    return act


# Gated activations of an MLP block's first projection (fused_mlp): act(gate) * up, where the projection
# yields [gate; up] (gate rows first, as Phi-3's gate_up_proj) -> the activation applied to the gate.
GATES: dict[str, str] = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "reglu": "relu"}
GATED_NAMES: tuple[str, ...] = tuple(GATES)
