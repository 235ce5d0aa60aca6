"""pytorch: the composite a user would write (``F.dropout(act(x + b), p)``, ``act(F.linear(x, w, b))``),
each op's spec ``baseline_kernels``: PyTorch's own kernels under torch's own autograd, dropout from
torch's RNG (the mask of ``nn.Dropout``, kept by autograd as PyTorch keeps it). The floor under every
decision: what runs where no table answers, and a contender in every calibration.

Supports: every op; any device; float16, bfloat16, float32, float64; every activation; deterministic
where torch's ops are. Masks differ from the other backends' (``dispatch.spec_masks()`` keeps
dropout calls off it).
"""

from __future__ import annotations

from dispatch import ops

BACKEND = ops.every_op_backend(
    name="pytorch",
    summary="the plain PyTorch composite a user writes (torch's dropout RNG)",
    generic=ops.baseline_kernels,
    torch_masks=True,
    order=0,
)
