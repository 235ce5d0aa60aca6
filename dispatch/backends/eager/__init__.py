"""eager: the spec's reference math on PyTorch ops, the parity reference every other backend is checked
against; dropout by ``dispatch.contracts.rng``'s spec (its integer tensor ops), never stored.

Supports: every op, forward and backward (an op without a kernel file here runs its spec's
``reference_kernels``); any device; float16, bfloat16, float32, float64; every activation;
deterministic wherever the underlying torch ops are.
"""

from __future__ import annotations

from dispatch import ops

BACKEND = ops.every_op_backend(
    name="eager",
    kernels=ops.KernelFiles(__name__),
    summary="the spec's reference on PyTorch ops",
    generic=ops.reference_kernels,
    order=10,
)
