"""The ops under torch.compile: plain math where no backend is requested, or where the one requested
traces as math, so inductor fuses it with its neighbours; else the spec's custom op. A backend traces
as math where its kernels cannot take the spec's masks the graph draws: torch's RNG (pytorch), or
ops it chains that draw their own (composed). Imported on the first compiled call only:
torch._dynamo imports triton."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dispatch import registry, select
from dispatch.contracts.op import OpCall, OpSpec


@torch._dynamo.assume_constant_result
def _requested_at_trace_time() -> Optional[str]:
    """The backend ``use_backend`` or ``DISPATCH_BACKEND`` names when a graph is traced (a compiled
    graph keeps the choice it was traced with)."""
    return select._requested.get() or select.env_backend()


@torch._dynamo.assume_constant_result
def _traces_as_math(name: str, op: str) -> bool:
    backend = registry.get(name)
    kernels = backend.kernels_for(op)
    return backend.torch_masks or (kernels is not None and kernels.masks != "spec")


def traced(spec: OpSpec, c: OpCall, backend: Optional[str]) -> Tensor:
    requested = backend or _requested_at_trace_time()
    inline = requested is None or _traces_as_math(requested, c.call.op)
    return spec.traced(c, backend, inline)
