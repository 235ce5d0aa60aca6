"""``dispatch.patch``'s norms: Hugging Face RMSNorm modules become ``dispatch.nn.FusedRMSNorm`` in place.

Which: the RMSNorm classes whose forward is known (``_HF_NORMS``), recognized by class name and module
(transformers is never imported): LLaMA's, Mistral's, Qwen2's and Qwen3's compute
``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`` with h in float32, Gemma's 1-3 ``(h * rsqrt(...)
* (1 + weight.float())).type_as(x)``, i.e. ``offset=1.0``. The ``FusedRMSNorm`` adopts the module's
``weight`` Parameter under the same name (state_dict keys and optimizers' references unchanged) and
takes its place in every parent that holds it. Its eps is the module's (``variance_epsilon`` or
``eps``).

The residual add before each norm is in the decoder layer's forward (``residual + hidden_states``),
not a module: a patch cannot see it, so each norm runs alone (``residual=None``), one kernel for the
module's seven; the report says so. ``nn.LayerNorm`` is left as it is: without its residual add,
torch's layer_norm is one kernel already.
"""

from __future__ import annotations

from typing import Optional, Union

from torch import nn

from dispatch.nn import FusedRMSNorm

# Hugging Face RMSNorm class -> the offset its forward adds to the weight (checked against transformers
# 4.x-5.x sources: the classes of one offset compute alike)
_HF_NORMS: dict[str, float] = {
    "LlamaRMSNorm": 0.0, "MistralRMSNorm": 0.0, "Qwen2RMSNorm": 0.0, "Qwen3RMSNorm": 0.0,
    "GemmaRMSNorm": 1.0, "Gemma2RMSNorm": 1.0, "Gemma3RMSNorm": 1.0,
}  # fmt: skip
NO_RESIDUAL = "the norm alone (a residual add before it is in its layer's forward, out of patch's sight)"


def offset_of(module: nn.Module) -> Optional[float]:
    """The offset of a Hugging Face RMSNorm ``patch`` replaces, None for any other module."""
    kind = type(module)
    return _HF_NORMS.get(kind.__name__) if kind.__module__.startswith("transformers.") else None


def fuse(module: nn.Module, places: list[tuple[nn.Module, str]]) -> Union[tuple[str, str], str]:
    """Puts one FusedRMSNorm over ``module``'s weight in each of its ``places`` (parent, attribute);
    returns (before, after) for the report, or why it left the module alone."""
    offset = offset_of(module)
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if offset is None or not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
        return f"{type(module).__name__} without the weight (N,) and eps of a known RMSNorm"
    if not places:
        return "the model is this norm: no parent to hold a FusedRMSNorm"
    fused = FusedRMSNorm(weight.shape[0], eps, offset, device="meta", dtype=weight.dtype)
    fused.weight = weight
    fused.train(module.training)
    for parent, name in places:
        setattr(parent, name, fused)
    after = f"FusedRMSNorm({fused.extra_repr()}): {NO_RESIDUAL}"
    return f"{type(module).__name__}({weight.shape[0]}, eps={eps})", after
