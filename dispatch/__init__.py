"""fusedispatch: fused transformer ops, each call sent to the fastest correct backend for it.

    from dispatch import fused_bias_act_dropout, fused_linear, fused_mlp, explain, use_backend
"""

from dispatch import nn  # FusedLinear, FusedBiasActDropout, FusedMLP
from dispatch.api import explain, fused_bias_act_dropout, fused_linear, fused_mlp
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.patch import patch
from dispatch.select import spec_masks, use_backend

__all__ = [
    "ACTIVATION_NAMES", "explain", "fused_bias_act_dropout", "fused_linear", "fused_mlp", "nn", "patch",
    "spec_masks", "use_backend",
]  # fmt: skip
