"""nvfuser: the design's "nvFuser via functorch/TorchScript" path, i.e. functorch's
``memory_efficient_fusion`` (AOTAutograd with functorch's decompositions) compiled by TorchScript.

What really fuses: nvFuser left TorchScript in PyTorch 2.2, so TorchScript's fuser is NNC (TensorExpr)
on CUDA, and nothing on CPU unless NNC's CPU fusion is switched on (it is off by default). The label
reports the configured fuser, then the fusion groups actually found in the graphs that ran, e.g.
``nvfuser (functorch+TorchScript, fuser: NNC (fused 4 of 4 graphs) on cuda, none on cpu)``.

Supports: every op with a file here, ``<op>.py`` (bias_act_dropout and fused_linear), forward and
backward, as the eager functions compiled separately (the dropout mask is regenerated in backward from
the traced ``dispatch.contracts.rng`` int64 ops, identical to eager's); cpu and cuda; float16,
bfloat16, float32; every activation; deterministic.
Each call signature (shapes, strides, dtypes, activation, p, which gradients) compiles once: about
0.3 s, 2-3 s with dropout (tracing the Philox rounds), on a 2-core CPU; the last
``compiler.CACHE_LIMIT`` compiled functions are kept.
"""

from __future__ import annotations

from typing import Optional

import torch

from dispatch import ops
from dispatch.contracts import compiled


def _unavailable() -> Optional[str]:
    try:
        import functorch.compile  # noqa: F401
    except ImportError as err:
        return f"nvfuser needs functorch.compile (part of torch): {err}"
    if not hasattr(torch.jit, "script"):
        return "nvfuser needs TorchScript (torch.jit.script), which this torch build lacks"
    return None


def _label() -> str:
    from dispatch.backends.nvfuser.compiler import fuser_summary

    devices = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
    return "functorch+TorchScript, fuser: " + ", ".join(f"{fuser_summary(d)} on {d}" for d in devices)


BACKEND = compiled.backend(
    name="nvfuser",
    kernels=ops.KernelFiles(__name__),
    deterministic=True,
    summary="functorch memory_efficient_fusion compiled by TorchScript (NNC fuser on CUDA)",
    unavailable=_unavailable,
    label=_label,
    order=60,
)
