"""pytorch: the composite a user would write (``F.dropout(act(x + b), p)``, ``act(F.linear(x, w, b))``),
each op's spec ``baseline_kernels``: PyTorch's own kernels under torch's own autograd, dropout from
torch's RNG (the mask of ``nn.Dropout``, kept by autograd as PyTorch keeps it). The floor under every
decision: what runs where no table answers, and a contender in every calibration.

Supports: every op; any device; float16, bfloat16, float32, float64; every activation; deterministic
where torch's ops are. Masks differ from the other backends' (``dispatch.spec_masks()`` keeps
dropout calls off it).
"""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.contracts.activations import ACTIVATION_NAMES, GATED_NAMES
from dispatch.contracts.backend import Backend

BACKEND = Backend(
    name="pytorch",
    kernels={},
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    activations=frozenset((*ACTIVATION_NAMES, *GATED_NAMES)),
    deterministic=True,
    summary="the plain PyTorch composite a user writes (torch's dropout RNG)",
    generic=ops.baseline_kernels,
    torch_masks=True,
)
