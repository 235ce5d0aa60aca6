"""Jitted twins of ``dispatch.activations``: the same names, forward and derivative, in float32.

Kernels take the activation as a ``tl.constexpr`` string and call :func:`apply` / :func:`derivative`;
the branches are resolved at compile time, so each activation compiles to straight-line code.
"""

import triton
import triton.language as tl

LEAKY_RELU_SLOPE = tl.constexpr(0.01)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
GELU_TANH_C = tl.constexpr(0.044715)
# constexpr globals go on the right of tensor products: the interpreter mishandles constexpr * tensor


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _tanh(u):
    # tanh(u) = 1 - 2 / (exp(2u) + 1): tl has no tanh on every supported release; saturates to +-1
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def apply(z, ACTIVATION: tl.constexpr):
    """act(z) for float32 z."""
    if ACTIVATION == "identity":
        y = z
    elif ACTIVATION == "relu":
        y = tl.maximum(z, 0.0)
    elif ACTIVATION == "leaky_relu":
        y = tl.where(z > 0.0, z, z * LEAKY_RELU_SLOPE)
    elif ACTIVATION == "gelu":
        y = 0.5 * z * (1.0 + tl.math.erf(z * INV_SQRT_2))
    elif ACTIVATION == "gelu_tanh":
        y = 0.5 * z * (1.0 + _tanh((z + z * z * z * GELU_TANH_C) * SQRT_2_OVER_PI))
    elif ACTIVATION == "squared_relu":
        r = tl.maximum(z, 0.0)
        y = r * r
    else:
        tl.static_assert(ACTIVATION == "silu", "unknown activation")
        y = z * _sigmoid(z)
    return y


@triton.jit
def derivative(z, ACTIVATION: tl.constexpr):
    """d act / dz at float32 z (the same formulas as dispatch.activations)."""
    if ACTIVATION == "identity":
        d = tl.full(z.shape, 1.0, tl.float32)
    elif ACTIVATION == "relu":
        d = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == "leaky_relu":
        d = tl.where(z > 0.0, 1.0, LEAKY_RELU_SLOPE)
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(z * INV_SQRT_2))
        d = cdf + z * tl.exp(-0.5 * z * z) * INV_SQRT_2PI
    elif ACTIVATION == "gelu_tanh":
        t = _tanh((z + z * z * z * GELU_TANH_C) * SQRT_2_OVER_PI)
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * (1.0 + z * z * (3.0 * GELU_TANH_C)) * SQRT_2_OVER_PI
    elif ACTIVATION == "squared_relu":
        d = 2.0 * tl.maximum(z, 0.0)
    else:
        tl.static_assert(ACTIVATION == "silu", "unknown activation")
        s = _sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    return d
