"""One path for every op: validate (the spec's ``parse``, which the public function ran) -> decide
(``dispatch.select``, cached per call signature) -> run (the spec's runner over the chosen backend's
kernels). Under ``torch.compile`` an op traces as plain PyTorch, or as its custom op when a backend
is requested. Installed as the ops' dispatcher on import.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from dispatch import ops, registry, select
from dispatch.contracts.backend import Call, Kernels
from dispatch.contracts.checks import check_backend
from dispatch.contracts.op import OpCall, OpSpec
from dispatch.ops.bias_act_dropout import fused_bias_act_dropout
from dispatch.ops.fused_linear import fused_linear
from dispatch.ops.fused_mlp import fused_mlp
from dispatch.select import Decision


@torch._dynamo.assume_constant_result
def _requested_at_trace_time() -> Optional[str]:
    """The backend ``use_backend`` or ``DISPATCH_BACKEND`` names when a graph is traced (a compiled
    graph keeps the choice it was traced with)."""
    return select._requested.get() or select.env_backend()


def _traced(spec: OpSpec, c: OpCall, backend: Optional[str]) -> Tensor:
    """Plain math where no backend is requested, or where the one requested traces as math (pytorch):
    inductor fuses it with its neighbours; else the spec's custom op."""
    requested = backend or _requested_at_trace_time()
    inline = requested is None or registry.get(requested).torch_masks
    return spec.traced(c, backend, inline)


class _Dispatcher:
    def run(self, spec: OpSpec, c: OpCall, backend: Optional[str]) -> Tensor:
        if backend is not None:
            check_backend(backend)
        done = spec.special(c, backend)
        if done is not None:
            return done
        if torch.compiler.is_compiling():
            return _traced(spec, c, backend)
        return select.runner(select.key(c.call, backend), spec)(c)

    def kernels(self, call: Call, backend: Optional[str]) -> Kernels:
        return select.kernels(call, backend)


ops.install(_Dispatcher())


def explain(op_name: str, *args: Any, **kwargs: Any) -> Decision:
    """Which backend the op ``op_name`` (its public name, e.g. ``"fused_linear"``, or its table name)
    would use for these arguments, by which rule, and why each other backend was rejected. Print it."""
    backend = check_backend(kwargs.pop("backend", None))
    return select.explain_call(_spec(op_name).parse(*args, **kwargs).call, backend)


def _spec(op_name: object) -> OpSpec:
    for spec in ops.all_specs():
        if op_name in (spec.name, spec.public_name):
            return spec
    names = ", ".join(repr(s.public_name) for s in ops.all_specs())
    raise ValueError(f"op_name must be one of {names}; got {op_name!r}")


__all__ = ["explain", "fused_bias_act_dropout", "fused_linear", "fused_mlp"]
