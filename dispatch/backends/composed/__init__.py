"""composed: an op served by the package's other ops chained as a model calls them, each sub-call
dispatched on its own by the table (``fused_mlp.py`` says which calls), so the calibrator times the
chain against the fused kernels; differentiated by torch's autograd through the sub-ops.

Supports: fused_mlp, forward and backward; any device; float16, bfloat16, float32, float64; every
activation and gate. Dropout masks are the spec's (``dispatch.contracts.rng``), each drawn by its
dropout sub-call from the caller's generator, which never runs on torch's RNG (pytorch) whatever
``spec_masks()`` says. Its sub-calls go where the table sends them, whatever ``use_backend()`` or
``DISPATCH_BACKEND`` name; a calibration times them as routed by the table loaded when it started
(the chain the run's own new entries would pick is timed by the next run). Not declared deterministic: a sub-call may land on a backend that is not
(inductor). Under torch.compile it traces as the block's math, as the ops it chains do.
"""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.contracts.activations import ACTIVATION_NAMES, GATED_NAMES
from dispatch.contracts.backend import Backend

BACKEND = Backend(
    name="composed",
    kernels=ops.KernelFiles(__name__),
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    activations=frozenset((*ACTIVATION_NAMES, *GATED_NAMES)),
    deterministic=False,
    summary="the package's ops chained (fused_linear, fused_bias_act_dropout), each dispatched by the table",
    order=40,
)
