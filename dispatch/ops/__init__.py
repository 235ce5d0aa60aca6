"""The ops, one spec per file (``dispatch.contracts.op.OpSpec``), and the registry that makes a spec known
to the dispatcher, the calibrator, the tables and the backends.

The package's ops are its files, found by name on first use (``builtin``): ``dispatch/ops/<op>.py``
holds op ``<op>`` and registers its spec as ``SPEC``; a file ``<op>_<part>.py`` beside it is a part of
that op's room (``fused_mlp_math.py``), and a file named ``_*.py`` belongs to no op. A spec module is
imported when its op is first asked for (``get``). A backend's kernels follow the same names: its
``<op>.py`` exposes the op's kernels as ``KERNELS`` (``KernelFiles``).

A spec imports only the contracts and this package: where it must reach the dispatcher (its public
function, a custom op that picks its kernels when a compiled graph runs) it goes through
``dispatcher()``, which ``dispatch.api`` installs when it is imported.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol

import torch
from torch import Tensor

from dispatch.contracts.activations import ACTIVATION_NAMES, GATED_NAMES
from dispatch.contracts.backend import Backend, Call, Kernels
from dispatch.contracts.op import OpCall, OpSpec

_specs: dict[str, OpSpec] = {}


def spec_files(folder: str) -> tuple[str, ...]:
    """The ops whose spec files are in ``folder``, sorted: each ``<op>.py`` but ``_*.py`` and the
    ``<op>_<part>.py`` of another op there."""
    stems = sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py") and not n.startswith("_"))
    return tuple(s for s in stems if not any(s.startswith(f"{op}_") for op in stems))


@functools.cache
def builtin() -> tuple[str, ...]:
    """The package's own ops: the spec files of ``dispatch/ops``."""
    return spec_files(os.path.dirname(__file__))


def register(spec: OpSpec) -> OpSpec:
    """Adds ``spec`` (replacing one of the same name: a test's toy op may be registered again)."""
    _specs[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _specs.pop(name, None)


def get(name: str) -> OpSpec:
    """The spec called ``name``, or a ValueError listing the known ops."""
    found = _specs.get(name)
    if found is None and name in builtin():
        importlib.import_module(f"{__name__}.{name}")
        found = _specs.get(name)
        if found is None:
            raise ValueError(f"dispatch/ops/{name}.py registers no spec (SPEC = ops.register(...))")
    if found is None:
        raise ValueError(f"op must be one of {', '.join(names())}; got {name!r}")
    return found


def names() -> tuple[str, ...]:
    """Every known op: the package's, then those registered since."""
    package = builtin()
    return (*package, *(n for n in _specs if n not in package))


def all_specs() -> list[OpSpec]:
    return [get(n) for n in names()]


def public_names() -> list[str]:
    """The ops' public functions' names (``fused_linear``...), in ``names()``' order (an op with several
    public functions gives each, ``OpSpec.public_names``)."""
    return [name for spec in all_specs() for name in spec.public_names]


class KernelFiles(Mapping[str, Kernels]):
    """A backend's kernels by op, read off its folder: its file ``<op>.py`` for each of the package's
    ops (``builtin``) exposes them as ``KERNELS``. Listing the folder and importing a file wait for
    the first question about them; a test may replace an op's kernels (``__setitem__``)."""

    def __init__(self, package: str) -> None:
        self._package = package
        self._loaded: dict[str, Kernels] = {}

    @functools.cached_property
    def _ops(self) -> tuple[str, ...]:
        folder = os.path.dirname(sys.modules[self._package].__file__ or "")
        return tuple(op for op in builtin() if os.path.isfile(os.path.join(folder, f"{op}.py")))

    def __getitem__(self, op: str) -> Kernels:
        found = self._loaded.get(op)
        if found is None:
            if op not in self._ops:
                raise KeyError(op)
            found = self._loaded[op] = importlib.import_module(f"{self._package}.{op}").KERNELS
        return found

    def __setitem__(self, op: str, kernels: Kernels) -> None:
        """Replaces the kernels of an op the backend has (a test's wrapped kernels)."""
        if op not in self._ops:
            raise KeyError(f"{self._package} has no file {op}.py")
        self._loaded[op] = kernels

    def __contains__(self, op: object) -> bool:
        return op in self._ops

    def __iter__(self) -> Iterator[str]:
        return iter(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def __repr__(self) -> str:
        return f"KernelFiles({self._package!r}: {', '.join(self._ops)})"


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
    order: int = 0,
) -> Backend:
    """The declaration of a backend on PyTorch's own ops that serves every op (eager, pytorch): its
    ``kernels``, else ``generic(op)`` from the op's spec; any device; float16, bfloat16, float32,
    float64; every activation and gate; deterministic where torch's ops are."""
    return Backend(
        name=name,
        kernels=kernels if kernels is not None else {},
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        activations=frozenset((*ACTIVATION_NAMES, *GATED_NAMES)),
        deterministic=True,
        summary=summary,
        generic=generic,
        torch_masks=torch_masks,
        order=order,
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
