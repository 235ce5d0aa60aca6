"""inductor: ``torch.compile`` (fullgraph, inductor) of the eager forward and backward functions.

Supports: every op with a file here, ``<op>.py`` (``BACKEND.kernels``; ``python -m dispatch.info``
lists them), forward and backward, compiled separately (dropout masks are regenerated in backward from
the traced ``dispatch.contracts.rng`` int64 ops, identical to eager's); cpu (C++ kernels, needs a C++
compiler) and cuda (Triton kernels, compute capability >= 7.0); float16, bfloat16, float32; every
activation, and fused_mlp's gates. The token dimension is dynamic: one compile per kind of call (op,
direction, activation, p, dtype, feature sizes, which gradients), not per token count. On a 2-core CPU
a compile takes ~5 s, ~30 s with dropout (inductor's analysis of the Philox int64 ops), plus ~25 s
once per process. Not declared deterministic: Triton reduction kernels (grad_bias) are autotuned on
first run, and the winning configuration, hence the summation order, can differ between processes.
"""

from __future__ import annotations

from dispatch import ops
from dispatch.contracts import compiled
from dispatch.contracts.activations import ACTIVATION_NAMES, GATED_NAMES
from dispatch.contracts.backend import Call


def _extra_reasons(call: Call, explicit: bool) -> list[str]:
    if call.device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return ["inductor needs triton to compile CUDA kernels, and triton is not importable"]
    return []


def _label() -> str:
    return "torch.compile, dynamic tokens"


BACKEND = compiled.backend(
    name="inductor",
    kernels=ops.KernelFiles(__name__),
    activations=frozenset((*ACTIVATION_NAMES, *GATED_NAMES)),
    deterministic=False,
    summary="torch.compile (inductor) of the eager functions, dynamic in the token dimension",
    min_capability=(7, 0),
    extra_reasons=_extra_reasons,
    label=_label,
    order=50,
)
