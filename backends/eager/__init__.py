"""eager: the spec's reference math on PyTorch ops, the parity reference every other backend is checked
against; dropout by ``dispatch.contracts.rng``'s spec (its integer tensor ops), never stored.

Supports: every op, forward and backward (an op without a kernel file here runs its spec's
``reference_kernels``); any device; float16, bfloat16, float32, float64; every activation;
deterministic wherever the underlying torch ops are.
"""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.backends.eager import bias_act_dropout, fused_linear, fused_mlp
from dispatch.contracts.activations import ACTIVATION_NAMES, GATED_NAMES
from dispatch.contracts.backend import Backend

BACKEND = Backend(
    name="eager",
    kernels={
        "bias_act_dropout": bias_act_dropout.KERNELS,
        "fused_linear": fused_linear.KERNELS,
        "fused_mlp": fused_mlp.KERNELS,
    },
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    activations=frozenset((*ACTIVATION_NAMES, *GATED_NAMES)),
    deterministic=True,
    summary="the spec's reference on PyTorch ops",
    generic=ops.reference_kernels,
)
