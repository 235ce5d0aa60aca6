"""Checks of fused_linear calls without autograd, which run the Triton matmul: the inputs, y against
the float64 reference, and one launch a call (counted by conftest.py's ``launches``)."""

import math

import torch

from dispatch.ops.fused_linear import reference
from dispatch import fused_linear
from dispatch.contracts.tolerances import check


def linear_inputs(x_shape, n, dtype, device, bias=True):
    """x (..., K), weight (N, K) scaled by 1/sqrt(K), and bias (N) or None, in ``dtype``."""
    k = x_shape[-1]
    x = torch.randn(x_shape, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, weight, b


def check_y(name, y, x, weight, bias, activation):
    """y alone vs the float64 reference, with the tolerance set by eager PyTorch in the same dtype."""
    assert y.dtype == x.dtype
    ref, eager = reference(x, weight, bias, activation, upcast=True), reference(x, weight, bias, activation)
    check(name, y, ref, eager)


def assert_infer_matches(launches, x, weight, bias, activation, name="y (infer)"):
    """A call without autograd (``infer``) launches the Triton matmul once, and its y matches the
    reference. Returns y."""
    before = len(launches)
    with torch.no_grad():
        y = fused_linear(x, weight, bias, activation, backend="triton")
    assert len(launches) == before + 1, f"{name}: {len(launches) - before} Triton matmul launches, not 1"
    check_y(name, y, x, weight, bias, activation)
    return y
