"""One path for every op: validate (the spec's ``parse``, which the public function ran) -> decide
(``dispatch.select``, cached per call signature) -> run (the spec's runner over the chosen backend's
kernels). Under ``torch.compile`` an op traces as plain PyTorch, or as its custom op when a backend
is requested (``dispatch.compiling``). Installed as the ops' dispatcher on import.

The ops' public functions (``fused_linear``...) are each spec's (``OpSpec.function``): ``__all__``
lists them and ``__getattr__`` finds them by name.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from dispatch import ops, select
from dispatch.contracts.backend import Call, Kernels
from dispatch.contracts.checks import check_backend
from dispatch.contracts.op import OpCall, OpSpec
from dispatch.select import Decision

_compiling = torch.compiler.is_compiling  # dynamo knows the function itself: an alias traces alike


class _Dispatcher:
    def run(self, spec: OpSpec, c: OpCall, backend: Optional[str]) -> Tensor:
        if backend is not None:
            check_backend(backend)
        if c.special:
            return spec.special(c, backend)
        if _compiling():
            from dispatch import compiling

            return compiling.traced(spec, c, backend)
        return select.runner(select.key(c.call, backend), spec)(c)

    def run_by_table(self, spec: OpSpec, c: OpCall) -> Tensor:
        if c.special:
            return spec.special(c, None)
        if _compiling():
            return self.run(spec, c, None)
        return select.runner(select.table_key(c.call), spec)(c)

    def kernels(self, call: Call, backend: Optional[str]) -> Kernels:
        return select.kernels(call, backend)


ops.install(_Dispatcher())


def explain(op_name: str, *args: Any, **kwargs: Any) -> Decision:
    """Which backend the op ``op_name`` (a public function's name, e.g. ``"fused_linear"``, whose
    arguments follow, or the op's table name) would use for these arguments, by which rule, and why each
    other backend was rejected. Print it."""
    backend = check_backend(kwargs.pop("backend", None))
    spec, public = _spec(op_name)
    return select.explain_call(spec.parse_for(public, *args, **kwargs).call, backend)


def _spec(op_name: object) -> tuple[OpSpec, str]:
    """The op ``op_name`` names and the public function whose arguments follow (its first for a table
    name)."""
    for spec in ops.all_specs():
        if op_name in spec.public_names:
            return spec, op_name  # type: ignore[return-value]
        if op_name == spec.name:
            return spec, spec.public_name
    names = ", ".join(map(repr, ops.public_names()))
    raise ValueError(f"op_name must be one of {names}; got {op_name!r}")


def __getattr__(name: str) -> Any:
    """An op's public function (``fused_linear``...)."""
    return op_function(name, globals())


def op_function(name: str, namespace: dict[str, Any]) -> Callable[..., Tensor]:
    """The public function ``name`` of an op, for a module's ``__getattr__`` (``namespace``: its
    globals); an AttributeError for any other name. The package's own ops' are kept in the namespace
    once found, so that the next lookup is a plain one."""
    spec = next((s for s in ops.all_specs() if name in s.public_names), None)
    if spec is None:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    function = spec.function(name)
    if spec.name in ops.builtin():
        namespace[name] = function
    return function


__all__ = ["explain", *ops.public_names()]
