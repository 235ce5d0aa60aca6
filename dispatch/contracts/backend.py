"""What a backend is, as the dispatcher and every backend agree on it: the call (``Call``), the
backend's declaration of what it supports (``Backend``), and the functions each op module provides
(``BiasActDropoutImpl``, ``FusedLinearImpl``). Imports nothing of ours but the other contracts.

A backend is one folder under ``backends/`` whose ``__init__`` builds a :class:`Backend` named
``BACKEND``; ``dispatch.registry`` collects them. Each op a backend implements is a module (or any
object) with the functions of :class:`BiasActDropoutImpl` or :class:`FusedLinearImpl`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol

import torch
from torch import Tensor

from dispatch.contracts.rng import Rng

OPS = ("bias_act_dropout", "fused_linear")


class BiasActDropoutImpl(Protocol):
    """x is (M, N) with any strides, bias (N,) contiguous or None; rng is ``dispatch.contracts.rng``'s (seed,
    offset), an int64 tensor or a ``HostRng``, or None (no dropout, p == 0). forward returns a new
    contiguous (M, N) tensor of x's dtype. Optional: ``trusted``, an object with the same forward and
    backward minus the op's own argument checks, which the dispatcher calls once it has validated the
    call (``trusted``)."""

    def forward(
        self, x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]
    ) -> Tensor: ...

    def backward(
        self,
        grad_y: Tensor,
        x: Tensor,
        bias: Optional[Tensor],
        activation: str,
        p: float,
        rng: Optional[Rng],
        need_x: bool,
        need_bias: bool,
    ) -> tuple[Optional[Tensor], Optional[Tensor]]: ...


def trusted(impl: object) -> object:
    """The op as the dispatcher calls it, after validating the call itself: ``impl.trusted`` where the
    op offers one (the same functions without the op's own argument checks, which repeat the
    dispatcher's), else ``impl``. Resolved once per decision."""
    return getattr(impl, "trusted", impl)


class FusedLinearImpl(Protocol):
    """x is (M, K) and weight (N, K) with any strides, bias (N,) contiguous or None. forward returns the
    contiguous (M, N) output and ``saved``, what its backward needs beyond the inputs (the
    pre-activation x @ W^T + b in x's dtype, or for relu the output y itself, as torch.relu keeps it:
    y > 0 exactly where the pre-activation is; None for identity); backward receives that same
    ``saved``: the two halves of a call always run on one backend. Optional: ``infer(x, weight, bias, activation) -> y``, used for calls without
    autograd by a backend whose forward would keep something for backward (triton's pre-activation);
    without it those calls take forward's y. Optional: ``differentiable(activation)``, a function of
    (x, weight, bias, activation) that torch's own autograd differentiates, or None; calls with autograd
    use it where it is given (eager: no Python autograd.Function around PyTorch's own kernels), else
    forward and backward wrapped in the dispatcher's Function (``dispatch.api.fused_linear_training``)."""

    def forward(
        self, x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
    ) -> tuple[Tensor, Optional[Tensor]]: ...


    def backward(
        self,
        grad_y: Tensor,
        x: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        saved: Optional[Tensor],
        activation: str,
        needs: tuple[bool, bool, bool],
    ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]: ...


def fused_linear_inference(
    impl: FusedLinearImpl,
) -> Callable[[Tensor, Tensor, Optional[Tensor], str], Tensor]:
    """How a fused_linear call without autograd runs on ``impl``: ``impl.infer`` where the backend has
    one, else forward's y; a function of (x, weight, bias, activation). The dispatcher resolves it once
    per decision: getattr of a module's missing attribute raises and catches an AttributeError, ~1.7 us
    per call on Python 3.11."""
    infer = getattr(impl, "infer", None)
    if infer is not None:
        return infer
    forward = impl.forward

    def forward_y(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
        return forward(x, weight, bias, activation)[0]

    return forward_y


@dataclass(frozen=True)
class Call:
    """What the dispatcher knows of one call: the key of its decision."""

    op: str
    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, ...]  # (M, N) for bias_act_dropout, (M, N, K) for fused_linear
    activation: str
    dropout: bool  # p > 0 and training
    training: bool  # autograd will need a backward

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        mode = "training" if self.training else "inference"
        drop = ", dropout" if self.dropout else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.op}({dims}, {dtype}, {self.activation}{drop}, {mode}) on {self.device}"


def _always_available() -> Optional[str]:
    return None


def _no_extra_reasons(call: Call, explicit: bool) -> list[str]:
    return []


@dataclass(frozen=True)
class Backend:
    """What one backend supports. ``unavailable()`` returns why it cannot run here at all (or None);
    ``extra_reasons(call, explicit)`` adds backend-specific refusals (``explicit`` is False when the
    dispatcher picks on its own, e.g. Triton's CPU interpreter serves only explicit requests)."""

    name: str
    ops: Mapping[str, object]
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    activations: frozenset[str]
    deterministic: bool
    summary: str
    min_capability: Optional[tuple[int, int]] = None  # CUDA devices only
    unavailable: Callable[[], Optional[str]] = _always_available
    extra_reasons: Callable[[Call, bool], list[str]] = _no_extra_reasons
    label: Callable[[], str] = field(default=lambda: "")
    # Traces and compiles a graph for each new kind of call (seconds on a first call, with work of its
    # own on the GPU): never given a call for the first time inside a CUDA-graph capture.
    compiles: bool = False

    def display_name(self) -> str:
        detail = self.label()
        return f"{self.name} ({detail})" if detail else self.name

    def not_supported_reasons(self, call: Call, explicit: bool = True) -> list[str]:
        why = self.unavailable()
        if why:
            return [why]
        reasons = []
        if call.op not in self.ops:
            reasons.append(f"{self.name} does not implement {call.op}")
        if call.device.type not in self.devices:
            reasons.append(
                f"{self.name} needs a {' or '.join(sorted(self.devices))} device; x is on {call.device}"
            )
        if call.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(f"{self.name} supports dtypes {names}; x is {call.dtype}")
        if call.activation not in self.activations:
            reasons.append(
                f"{self.name} supports activations {', '.join(sorted(self.activations))}; "
                f"got {call.activation!r}"
            )
        if self.min_capability and call.device.type == "cuda" and not reasons:
            cap = torch.cuda.get_device_capability(call.device)
            if cap < self.min_capability:
                need = ".".join(map(str, self.min_capability))
                reasons.append(
                    f"{self.name} needs compute capability >= {need}; {call.device} has {cap[0]}.{cap[1]}"
                )
        if not reasons:
            reasons.extend(self.extra_reasons(call, explicit))
        return reasons

    def impl(self, op: str) -> object:
        return self.ops[op]
