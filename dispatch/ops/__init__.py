"""The ops, one spec per file (``dispatch.contracts.op.OpSpec``), and the registry that makes a spec known
to the dispatcher, the calibrator, the tables and the backends that serve every op (eager, pytorch).

A spec imports only the contracts: where it must reach the dispatcher (its public function, a custom
op that picks its kernels when a compiled graph runs) it goes through ``dispatcher()``, which the
dispatcher installs when ``dispatch`` is imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
from torch import Tensor

from dispatch.contracts.activations import ACTIVATION_NAMES, GATED_NAMES
from dispatch.contracts.backend import Backend, Call, Kernels
from dispatch.contracts.op import OpCall, OpSpec

# The package's own ops, imported on first use (importing dispatch loads no spec it does not call).
BUILTIN = ("bias_act_dropout", "fused_linear", "fused_mlp")

_specs: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Adds ``spec`` (replacing one of the same name: a test's toy op may be registered again)."""
    _specs[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _specs.pop(name, None)


def get(name: str) -> OpSpec:
    """The spec called ``name``, or a ValueError listing the known ops."""
    found = _specs.get(name)
    if found is None and name in BUILTIN:
        importlib.import_module(f"dispatch.ops.{name}")
        found = _specs.get(name)
    if found is None:
        raise ValueError(f"op must be one of {', '.join(names())}; got {name!r}")
    return found


def names() -> tuple[str, ...]:
    """Every known op: the package's, then those registered since."""
    return (*BUILTIN, *(n for n in _specs if n not in BUILTIN))


def all_specs() -> list[OpSpec]:
    return [get(n) for n in names()]


def baseline_kernels(op: str) -> Optional[Kernels]:
    """The spec's baseline as kernels (the pytorch backend serves every op so), None for no such op."""
    return get(op).baseline_kernels() if op in names() else None


def reference_kernels(op: str) -> Optional[Kernels]:
    """The spec's reference as kernels, for the eager backend where it has no kernel file of the op."""
    return get(op).reference_kernels() if op in names() else None


def every_op_backend(
    name: str,
    summary: str,
    generic: Callable[[str], Optional[Kernels]],
    kernels: Optional[Mapping[str, Kernels]] = None,
    torch_masks: bool = False,
) -> Backend:
    """The declaration of a backend on PyTorch's own ops that serves every op (eager, pytorch): its
    ``kernels``, else ``generic(op)`` from the op's spec; any device; float16, bfloat16, float32,
    float64; every activation and gate; deterministic where torch's ops are."""
    return Backend(
        name=name,
        kernels=dict(kernels or {}),
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        activations=frozenset((*ACTIVATION_NAMES, *GATED_NAMES)),
        deterministic=True,
        summary=summary,
        generic=generic,
        torch_masks=torch_masks,
    )


class Dispatcher(Protocol):
    """What a spec, or a backend that chains the ops (composed), asks of the dispatcher."""

    def run(self, spec: OpSpec, c: OpCall, backend: Optional[str]) -> Tensor: ...

    def run_by_table(self, spec: OpSpec, c: OpCall) -> Tensor:
        """``run`` with the backend the table picks, whatever ``use_backend()`` or ``DISPATCH_BACKEND``
        name (they named the chaining backend), and dropout on the spec's masks, as under
        ``spec_masks()``: the call of an op that another op's backend makes. Under torch.compile it
        traces as ``run`` with no backend does (math, inductor's RNG)."""
        ...

    def kernels(self, call: Call, backend: Optional[str]) -> Any: ...


_dispatcher: Optional[Dispatcher] = None


def install(dispatcher: Dispatcher) -> None:
    global _dispatcher
    _dispatcher = dispatcher


def dispatcher() -> Dispatcher:
    assert _dispatcher is not None, "dispatch.api installs the dispatcher when dispatch is imported"
    return _dispatcher
