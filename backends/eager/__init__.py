"""eager: plain PyTorch ops, the reference every other backend is checked against.

Supports: both ops, forward and backward; any device; float16, bfloat16, float32, float64; every
activation; deterministic wherever the underlying torch ops are.
"""

import torch

from dispatch.backends.eager import bias_act_dropout, fused_linear
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.contracts.backend import Backend

BACKEND = (
    Backend(
        name="eager",
        ops={"bias_act_dropout": bias_act_dropout, "fused_linear": fused_linear},
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        activations=frozenset(ACTIVATION_NAMES),
        deterministic=True,
        summary="PyTorch eager ops (the reference)",
    )
)
