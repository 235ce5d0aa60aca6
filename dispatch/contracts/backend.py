"""What a backend is, as the dispatcher and every backend agree on it: the call (``Call``) and the
backend's declaration of what it supports (``Backend``). Imports nothing of ours but the other
contracts.

A backend is one folder under ``dispatch/backends/`` whose ``__init__`` builds a :class:`Backend` named
``BACKEND``; ``dispatch.registry`` finds and collects them. For each op it implements it gives one
kernels object, of the protocol the op's spec defines (``dispatch/ops/<op>.py``: ``Kernels``), in its
own ``<op>.py`` (``dispatch.ops.KernelFiles``); a backend that serves every op (eager: the spec's
reference; pytorch: its baseline) builds them from the spec where it has no such file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

# The traits the calibrator's cases carry (``dispatch.contracts.op.Case``), whatever their op declares.
ACTIVATION_DROPOUT = ("activation", "dropout")


class _CallFields(NamedTuple):
    op: str
    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, ...]  # the op's decision dims, M first: (M, N), (M, N, K), ...
    training: bool  # autograd will need a backward
    traits: tuple[str, ...] = ()  # the names of the traits the op declares (``OpSpec.traits``)
    values: tuple[Any, ...] = ()  # their values, in that order: "gelu", True (p > 0 and training)...


_new = tuple.__new__


class Call(_CallFields):
    """What the dispatcher knows of one call: the key of its decision. Past the op, device, dtype,
    decision shape and mode it holds the traits its op declares (``OpSpec.traits``: bias_act_dropout's
    activation and dropout, fused_linear's activation) and no other: an op may declare none.

    ``Call(op, device, dtype, shape, activation, dropout, training)``, the form from before traits,
    still builds a call with those two (for callers not moved yet)."""

    __slots__ = ()

    def __new__(cls, op: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...],
                training: bool, traits: tuple[str, ...] = (), values: tuple = ()) -> Call:  # fmt: skip
        if type(values) is bool:  # the former (..., shape, activation, dropout, training)
            training, traits, values = values, ACTIVATION_DROPOUT, (training, traits)  # type: ignore
        return _new(cls, (op, device, dtype, shape, training, traits, values))

    def trait(self, name: str, default: Any = None) -> Any:
        """The value of the trait ``name``, or ``default`` where the op declares no such trait."""
        return self.values[self.traits.index(name)] if name in self.traits else default

    @property
    def activation(self) -> Optional[str]:
        return self.trait("activation")

    @property
    def dropout(self) -> bool:
        """p > 0 in training (False for an op without dropout)."""
        return bool(self.trait("dropout", False))

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        dtype = str(self.dtype).removeprefix("torch.")
        traits = [
            (name if value else "") if type(value) is bool else str(value)
            for name, value in zip(self.traits, self.values)
        ]
        mode = "training" if self.training else "inference"
        return f"{self.op}({', '.join(p for p in (dims, dtype, *traits, mode) if p)}) on {self.device}"


# A Call from its seven fields as one tuple, unchecked, without a Python frame: for a spec's ``parse``,
# which runs on every call (~0.1 us less than ``Call(...)``).
new_call: Callable[[tuple], Call] = functools.partial(_new, Call)


def _never(activation: str) -> bool:
    return False


@dataclass(frozen=True)
class Kernels:
    """One backend's implementation of one op; the signatures are the op's (its spec's docstring).
    ``autograd(activation)``: forward is plain torch ops that torch's autograd differentiates itself
    (no Function around it; ``activation`` the call's, None for an op without one); ``masks``: "spec"
    regenerates dropout masks from ``dispatch.contracts.rng`` in backward, "torch" draws them from
    torch's RNG as nn.Dropout does, "generator" takes the caller's generator and draws the spec's
    masks through the ops it chains (composed). Kernels take x as rows, (M, features), unless
    ``any_shape``."""

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    inference: Callable[..., Any]
    autograd: Callable[[Optional[str]], bool] = _never
    masks: str = "spec"
    any_shape: bool = False  # forward and inference take x (..., features) as the caller gave it
    # prepare(call): work done outside a CUDA-graph capture for calls of this kind that the backend will
    # first see inside one (the dispatcher calls it where a decision names the backend for capture)
    prepare: Optional[Callable[["Call"], None]] = None


def _always(activation: str) -> bool:
    return True


def composite_kernels(
    forward: Callable[..., Any],
    backward: Callable[..., Any],
    inference: Callable[..., Any],
    any_shape: bool = False,
) -> Kernels:
    """An op's baseline as kernels: the composite a user writes, plain torch ops under torch's own
    autograd for every activation, dropout masks from torch's RNG as nn.Dropout draws them."""
    return Kernels(forward, backward, inference, autograd=_always, masks="torch", any_shape=any_shape)


def _always_available() -> Optional[str]:
    return None


def _no_extra_reasons(call: Call, explicit: bool) -> list[str]:
    return []


def _no_generic(op: str) -> Optional["Kernels"]:
    return None


@dataclass(frozen=True)
class Backend:
    """What one backend supports. ``unavailable()`` returns why it cannot run here at all (or None);
    ``extra_reasons(call, explicit)`` adds backend-specific refusals (``explicit`` is False when the
    dispatcher picks on its own, e.g. Triton's CPU interpreter serves only explicit requests).
    ``kernels`` maps op names to kernels objects; ``generic(op)`` builds them for ops not listed
    (a backend that serves every op from its spec), or returns None."""

    name: str
    kernels: Mapping[str, Kernels]
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
    generic: Callable[[str], Optional[Kernels]] = _no_generic
    # Dropout masks from torch's RNG (as nn.Dropout), not dispatch.contracts.rng's spec.
    torch_masks: bool = False
    # The backend's place in the one order of backends (``dispatch.backends``), lowest first.
    order: int = 1000

    def display_name(self) -> str:
        detail = self.label()
        return f"{self.name} ({detail})" if detail else self.name

    def kernels_for(self, op: str) -> Optional[Kernels]:
        """The kernels serving ``op``, or None."""
        found = self.kernels.get(op)
        return found if found is not None else self.generic(op)

    def implements(self, op: str) -> bool:
        return op in self.kernels or self.generic(op) is not None

    def not_supported_reasons(self, call: Call, explicit: bool = True) -> list[str]:
        if not self.implements(call.op):  # first: no device would change that
            return [f"{self.name} does not implement {call.op}"]
        why = self.unavailable()
        if why:
            return [why]
        reasons = []
        if call.device.type not in self.devices:
            reasons.append(
                f"{self.name} needs a {' or '.join(sorted(self.devices))} device; x is on {call.device}"
            )
        if call.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(f"{self.name} supports dtypes {names}; x is {call.dtype}")
        if "activation" in call.traits and call.activation not in self.activations:
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
