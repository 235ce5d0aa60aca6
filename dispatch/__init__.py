"""fusedispatch: fused transformer ops, each call sent to the fastest correct backend for it.

    from dispatch import fused_bias_act_dropout, fused_linear, fused_mlp, explain, use_backend

The ops' public functions are their specs' (``dispatch/ops/<op>.py``): ``__all__`` lists them and
``__getattr__`` finds them by name.
"""

from typing import Any

from dispatch import api, nn, ops  # nn: FusedLinear, FusedBiasActDropout, FusedMLP
from dispatch.api import explain
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.patch import patch
from dispatch.select import spec_masks, use_backend

__all__ = ["ACTIVATION_NAMES", "explain", "nn", "patch", "spec_masks", "use_backend", *ops.public_names()]


def __getattr__(name: str) -> Any:
    """The ops' public functions."""
    return api.op_function(name, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *ops.public_names()})
