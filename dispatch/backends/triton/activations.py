"""Jitted twins of ``dispatch.contracts.activations``: the same names, forward and derivative, in float32.

Kernels take the activation as a ``tl.constexpr`` string and call :func:`apply` / :func:`derivative`;
the branches are resolved at compile time, so each activation compiles to straight-line code.

Non-finite inputs give what PyTorch's own kernels give (``tests/test_nonfinite.py``): NaN stays NaN,
+-inf and huge finite values take the same limits, and where PyTorch's formula meets inf * 0 (gelu at
-inf, silu at -inf, gelu's gradient at +-inf, gelu_tanh's gradient once z * z overflows, |z| > 1.8e19)
these formulas meet it too and give NaN. ``tl.maximum`` defaults to maxnum, which returns the non-NaN
operand (relu(NaN) = 0 on the GPU and in the interpreter); relu's uses propagate NaN instead, the
same single max.NaN.f32 on sm_80+. Comparisons are written so that NaN falls on PyTorch's side.
"""

import triton
import triton.language as tl

LEAKY_RELU_SLOPE = tl.constexpr(0.01)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
GELU_TANH_C = tl.constexpr(0.044715)
# gelu's Phi(-t) = 2^(Q(t) - t^2 / (2 ln 2)), t = |z|; Q: degree 7 on [0, 5.5], least squares weighted
# by Phi(-t) (the error Phi sees) iterated toward minimax. |error| in Phi 1.1e-7 in float32 (libdevice
# erff: ~1 ulp), but branch-free: 7 FFMA + 1 EX2 with immediate coefficients, where erff selects
# between two polynomials (gelu forward 21 instead of 40 sm_90 instructions an element). Past 5.5, Q
# is frozen and the Gaussian factor alone drives Phi(-t) to 0.
PHI_T_MAX = tl.constexpr(5.5)
HALF_LOG2E = tl.constexpr(0.7213475204444817)
PHI_Q = (
    -0.9999998807907104,
    -1.1511108875274658,
    0.26219436526298523,
    -0.052691128104925156,
    0.007389293983578682,
    -0.00042124890023842454,
    -5.390010483097285e-05,
    8.469786735076923e-06,
)
Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7 = (tl.constexpr(c) for c in PHI_Q)
# constexpr globals go on the right of tensor products: the interpreter mishandles constexpr * tensor


@triton.jit
def _recip_ge1(d):
    """1 / d for float32 d >= 1 (inf included): rsqrt(d * d), two instructions (FMUL, MUFU.RSQ; relative
    error ~2**-23) where ``/`` is IEEE division, div.rn.f32, ~10 with a slow-path branch. The
    epilogues of the matmul are issue-bound on this (gelu_tanh's at 0.85x torch.mm, relu's 0.97x).
    d * d overflows to inf past ~1.8e19,
    whose reciprocal 0 is then within 6e-20 of the true one; d = inf gives 0 = 1 / inf, NaN gives NaN."""
    return tl.math.rsqrt(d * d)


@triton.jit
def _relu(z):
    """max(z, 0) with relu(NaN) = NaN, as torch.relu."""
    return tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _sigmoid(z):
    return _recip_ge1(1.0 + tl.exp(-z))


@triton.jit
def _tanh(u):
    # tanh(u) = 1 - 2 / (exp(2u) + 1): tl has no tanh on every supported release; saturates to +-1
    return 1.0 - 2.0 * _recip_ge1(tl.exp(2.0 * u) + 1.0)


@triton.jit
def _normal_tail(z):
    """Phi(-|z|) for float32 z, the standard normal's tail: one exp2, no branches. NaN: the minimum
    returns PHI_T_MAX, but z * z carries the NaN into the exponent; +-inf: exp2(-inf) = 0."""
    t = tl.minimum(tl.abs(z), PHI_T_MAX)
    q = ((((((t * Q7 + Q6) * t + Q5) * t + Q4) * t + Q3) * t + Q2) * t + Q1) * t + Q0
    return tl.exp2(q - z * z * HALF_LOG2E)


@triton.jit
def apply(z, ACTIVATION: tl.constexpr):
    """act(z) for float32 z."""
    if ACTIVATION == "identity":
        y = z
    elif ACTIVATION == "relu":
        y = _relu(z)
    elif ACTIVATION == "leaky_relu":  # NaN > 0 is false: NaN * slope, NaN
        y = tl.where(z > 0.0, z, z * LEAKY_RELU_SLOPE)
    elif ACTIVATION == "gelu":  # z * Phi(z)
        tail = _normal_tail(z)
        y = z * tl.where(z >= 0.0, 1.0 - tail, tail)
    elif ACTIVATION == "gelu_tanh":
        y = 0.5 * z * (1.0 + _tanh((z + z * z * z * GELU_TANH_C) * SQRT_2_OVER_PI))
    elif ACTIVATION == "squared_relu":
        r = _relu(z)
        y = r * r
    else:
        tl.static_assert(ACTIVATION == "silu", "unknown activation")
        y = z * _sigmoid(z)
    return y


@triton.jit
def derivative(z, ACTIVATION: tl.constexpr):
    """d act / dz at float32 z (the same formulas as dispatch.contracts.activations)."""
    if ACTIVATION == "identity":
        d = tl.full(z.shape, 1.0, tl.float32)
    elif ACTIVATION == "relu":  # 1 at NaN, as threshold_backward's z <= 0 ? 0 : grad passes NaN's grad
        d = tl.where(z <= 0.0, 0.0, 1.0)
    elif ACTIVATION == "leaky_relu":  # slope at NaN, as leaky_relu_backward's z > 0 ? grad : grad * slope
        d = tl.where(z > 0.0, 1.0, LEAKY_RELU_SLOPE)
    elif ACTIVATION == "gelu":  # Phi(z) + z * phi(z)
        tail = _normal_tail(z)
        cdf = tl.where(z >= 0.0, 1.0 - tail, tail)
        d = cdf + z * tl.exp2(z * z * -HALF_LOG2E) * INV_SQRT_2PI
    elif ACTIVATION == "gelu_tanh":
        t = _tanh((z + z * z * z * GELU_TANH_C) * SQRT_2_OVER_PI)
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * (1.0 + z * z * (3.0 * GELU_TANH_C)) * SQRT_2_OVER_PI
    elif ACTIVATION == "squared_relu":  # NaN at NaN, as autograd of relu(z) ** 2
        d = 2.0 * _relu(z)
    else:
        tl.static_assert(ACTIVATION == "silu", "unknown activation")
        s = _sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    return d


@triton.jit
def grad(gy, z, ACTIVATION: tl.constexpr):
    """gy * act'(z) at float32 z, with the non-finite values PyTorch's backward gives: relu's
    threshold_backward and autograd of relu(z) ** 2 select, 0 wherever z <= 0 even for a NaN or inf
    gy (gy * 0 would be NaN); the other activations' kernels multiply, as here. relu's select is one
    instruction fewer than the product with its 0/1 derivative."""
    if ACTIVATION == "relu":
        g = tl.where(z <= 0.0, 0.0, gy)
    elif ACTIVATION == "squared_relu":
        g = tl.where(z <= 0.0, 0.0, gy * (z + z))  # z + z = 2 relu(z) where kept
    else:
        g = gy * derivative(z, ACTIVATION)
    return g
