"""The ops under torch.compile: plain math where no backend is requested, or where the one requested
traces as math, so inductor fuses it with its neighbours; else the spec's custom op. A backend traces
as math where its kernels cannot take the spec's masks the graph draws: torch's RNG (pytorch), or
ops it chains that draw their own (composed). Imported on the first compiled call only:
torch._dynamo imports triton."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dispatch import heuristics, registry, select
from dispatch.contracts.activations import GATES
from dispatch.contracts.backend import Call
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


def opaque_mlp(device: torch.device, dtype: torch.dtype, activation: str, h: int, f: int,
               hidden_dropout: bool) -> Optional[str]:  # fmt: skip
    """The backend a ``FusedMLP`` call runs on as one custom op under torch.compile, or None: its math,
    which inductor fuses with its neighbours. The measured rule: opaque (triton) for a training call
    with hidden dropout of a plain activation, where the table picks triton for the block's family at
    large M (the GPU-bound end; M itself may be symbolic when the graph is traced): compile with
    mlp/triton inside ran 0.87x compile's own graph on ViT-B and BERT-L (H100, 8192 tokens: the op
    regenerates the mask inductor's graph stores), 0.99x without hidden dropout (GPT-2), 0.99-1.04x
    gated. A backend requested (use_backend, DISPATCH_BACKEND) decides as for every op."""
    if not hidden_dropout or activation in GATES or _requested_at_trace_time() is not None:
        return None
    return _triton_at_scale(device, dtype, activation, h, f)


@torch._dynamo.assume_constant_result
def _triton_at_scale(
    device: torch.device, dtype: torch.dtype, activation: str, h: int, f: int
) -> Optional[str]:
    """The name triton where the table's cell for fused_mlp training with dropout at features (h, f)
    picks it at its largest M and triton can serve such calls, else None."""
    traits = ("activation", "dropout")
    call = Call("fused_mlp", device, dtype, (1 << 20, h, f), True, traits, (activation, True))
    choice = heuristics.lookup(call)
    triton = registry.backends().get("triton")
    if choice is None or choice.backend != "triton" or triton is None:
        return None
    return None if triton.not_supported_reasons(call, explicit=True) else "triton"
