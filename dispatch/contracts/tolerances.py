"""Per-dtype tolerances, in one place: tests, ``python -m dispatch.parity`` and calibration's gate.

A backend's result ``out`` in dtype d passes against the float64 reference ``ref`` when

    max|out - ref| <= 2 * max|eager_d - ref| + ATOL[d] + RTOL[d] * max|ref|

where ``eager_d`` is the eager backend's result in the same dtype (flash-attention's rule: a fused
kernel may be at most about twice as far from the truth as PyTorch itself in that precision).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def max_error(out: Tensor, ref: Tensor) -> float:
    """max|out - ref| in float64 (0 for empty tensors); NaN anywhere in out counts as infinite."""
    if out.numel() == 0:
        return 0.0
    diff = (out.double() - ref.double()).abs()
    return float("inf") if torch.isnan(diff).any() else float(diff.max())


def allowed_error(ref: Tensor, dtype: torch.dtype, eager: Optional[Tensor] = None) -> float:
    """The largest max|out - ref| accepted for a result in ``dtype``."""
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    base = 2.0 * max_error(eager, ref) if eager is not None else 0.0
    return base + ATOL[dtype] + RTOL[dtype] * scale


def check(name: str, out: Tensor, ref: Tensor, eager: Optional[Tensor] = None) -> None:
    """Raises AssertionError naming ``name`` when ``out`` misses the tolerance for its dtype."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err, allowed = max_error(out, ref), allowed_error(ref, out.dtype, eager)
    assert err <= allowed, f"{name}: max error {err:.3g} > allowed {allowed:.3g} ({out.dtype})"
