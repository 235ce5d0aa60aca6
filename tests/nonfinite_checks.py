"""The non-finite tests' inputs and checks: NaN, +-inf and huge finite values, and a check that every
backend gives what PyTorch's own composite gives.

The reference is PyTorch in the op's dtype: ``act(x + bias)`` and ``act(F.linear(x, w, b))`` with
``F.relu``, ``F.leaky_relu(z, 0.01)``, ``F.gelu``, ``F.gelu(approximate="tanh")``, ``relu(z) ** 2``,
``F.silu``, and their autograd gradients. A result passes when its NaNs sit where the reference's do,
its infinities where the reference's are with the same signs, and its finite values are within
``dispatch.contracts.tolerances``' float32 ATOL and RTOL, scaled by the magnitude of what was summed (a product's
|A| @ |B|, a column sum's sum of |terms|), so that huge finite values neither hide errors elsewhere nor
fail on the rounding of their own sums.

PyTorch disagrees with itself on some CPUs: there (AVX-512) its vectorized float32 and bfloat16 gelu
gives gelu(+inf) = NaN and gelu(3e38) = inf, its scalar path (a 1-element tensor), float64 and CUDA
kernels +inf and 3e38. So each reference is also computed with the activation (and its autograd) in
float64 on the same z, cast back to the op's dtype: a value passes the NaN/+-inf check where its class
matches either reference's there, and its finite value is held to the reference whose class it matched
(``pick_reference``). Elsewhere the two agree, but for gelu_tanh's gradient past |z| > 1.8e19 (NaN in
float32, 0 or 1 in float64).

Some of what PyTorch gives, for the record: gelu(-inf) = silu(-inf) = NaN (-inf * 0); gelu's gradient
is NaN at +-inf, gelu_tanh's wherever z * z overflows (|z| > 1.8e19, where 1 - tanh^2 = 0 meets an
infinite du/dz), silu's at +-inf; relu's gradient at a NaN z is grad_y (threshold_backward keeps
z <= 0 ? 0 : grad), and relu's and squared_relu's are 0 wherever z <= 0 even for a NaN grad_y. Dropout
is F.dropout's product y * mask * scale: a dropped NaN or inf gives NaN, not 0.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dispatch.contracts.activations import LEAKY_RELU_SLOPE
from dispatch import ops
from dispatch.registry import backends
from dispatch.contracts.tolerances import ATOL, RTOL

# The interpreter evaluates kernels in numpy, which warns on every inf * 0 these inputs are made of:
# each test file's pytestmark.
INTERPRETER_WARNINGS = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


NAN, INF = math.nan, math.inf
NONFINITE = (NAN, INF, -INF)
# huge finite values at the formulas' edges: z^3 overflows float32 past ~7e12 (gelu_tanh's tanh
# saturates), z^2 past 1.8e19 (gelu_tanh's gradient turns NaN), 3e38 is near float32's 3.4e38 (x + b
# and squared_relu overflow)
HUGE = (1e13, -1e13, 2e19, -2e19, 1e30, -1e30, 3e38, -3e38)
SPECIALS = NONFINITE + HUGE
# fused_linear's x: NaN and +-inf only. A huge finite x times a huge finite grad_pre (squared_relu's
# 2 * pre * grad_y at pre ~ 1e29) overflows inside grad_W's products, and whether inf + (that) is inf
# or NaN then depends on the instruction: an FMA (MKL, Triton's tl.dot on the GPU) adds the exact
# product, inf; a separate multiply (the interpreter's numpy) rounds it to -inf first, NaN. Both are
# IEEE. The huge finite values go into the bias, which is added once.
LINEAR_X_SPECIALS = NONFINITE
# grad_y: NaN and +-1e30. Not 3e38: times a derivative >= 1 it could overflow grad_bias's column sum
# in an order-dependent way. Not inf: inf * act'(z) is NaN or inf by whether act'(z) rounds to exactly
# 0, where PyTorch disagrees with itself (its vectorized gelu_backward gives gelu'(-7) = 0, hence
# NaN, its scalar tail -6.4e-11, hence inf); 1e30 tests the same products within tolerance.
GRAD_SPECIALS = (NAN, 1e30, -1e30)


COMPOSITE = {
    "identity": lambda z: z,
    "relu": F.relu,
    "leaky_relu": lambda z: F.leaky_relu(z, LEAKY_RELU_SLOPE),
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "squared_relu": lambda z: F.relu(z) ** 2,
    "silu": F.silu,
}


SHAPE = (7, 33)  # bias_act_dropout's (M, N): N % 8 != 0, so triton draws dropout per element
BACKENDS = tuple(backends())
ATOL32, RTOL32 = ATOL[torch.float32], RTOL[torch.float32]


def skip_unless_supported(backend: str, op: str, shape: tuple[int, ...], activation: str, dropout=False):
    spec = ops.get(op)
    traits = {"activation": activation, "dropout": dropout}
    call = spec.call(torch.device("cpu"), torch.float32, shape, True, **{t: traits[t] for t in spec.traits})
    reasons = backends()[backend].not_supported_reasons(call)
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def assert_matches(got, want, what, atol_scale=1.0, rtol_scale=None):
    """NaN exactly where ``want`` has NaN, +inf and -inf exactly where it has them; finite values
    within ATOL * atol_scale + RTOL * rtol_scale (default |want|). Magnitudes that are themselves not
    finite only loosen the bound (their elements are non-finite in ``want`` too, in the cases built here)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    for name, kind in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        differ = kind(got) != kind(want)
        if differ.any():
            where = differ.nonzero()[:6].tolist()
            raise AssertionError(
                f"{what}: {name} where the reference has none or vice versa at {where}: "
                f"got {got[differ][:6].tolist()}, PyTorch {want[differ][:6].tolist()}"
            )
    rtol_scale = want.abs() if rtol_scale is None else torch.as_tensor(rtol_scale, dtype=torch.float64)
    atol_scale = torch.as_tensor(atol_scale, dtype=torch.float64)
    bound = torch.nan_to_num(ATOL32 * atol_scale + RTOL32 * rtol_scale, nan=INF)
    finite = torch.isfinite(want)
    bad = finite & ~((got - want).abs() <= bound)
    if bad.any():
        where = bad.nonzero()[:6].tolist()
        raise AssertionError(
            f"{what}: finite values off at {where}: got {got[bad][:6].tolist()}, "
            f"PyTorch {want[bad][:6].tolist()}, allowed {bound.expand_as(want)[bad][:6].tolist()}"
        )


def _value_class(t: torch.Tensor) -> torch.Tensor:
    """Per element: 0 finite, 1 NaN, 2 +inf, 3 -inf."""
    t = t.detach()
    c = torch.zeros(t.shape, dtype=torch.int8)
    c[torch.isnan(t)], c[torch.isposinf(t)], c[torch.isneginf(t)] = 1, 2, 3
    return c


def pick_reference(got, want, want64, *pairs):
    """Element by element, ``want`` (PyTorch's composite in the op's dtype) where ``got``'s class
    (finite, NaN, +inf, -inf) is want's, else ``want64`` (the activation in float64, cast to want's
    dtype); each (for want, for want64) pair of tolerance scales in ``pairs`` picked the same way."""
    want, want64 = want.detach(), want64.detach().to(want.dtype)
    use_want = _value_class(got) == _value_class(want)
    picked = [torch.where(use_want, torch.as_tensor(a), torch.as_tensor(b)) for a, b in pairs]
    return (torch.where(use_want, want, want64), *picked)


def assert_matches_either(got, want, want64, what, atol_scale=1.0, rtol_scale=None):
    """``assert_matches`` against ``pick_reference``'s per-element reference: NaN/+-inf where either
    reference has them there, finite values within tolerance of the reference whose class they have.
    ``rtol_scale``: None (|reference|) or a pair (for want, for want64)."""
    want64 = want64.detach().to(want.dtype)
    neither = (_value_class(got) != _value_class(want)) & (_value_class(got) != _value_class(want64))
    if neither.any():
        where = neither.nonzero()[:6].tolist()
        raise AssertionError(
            f"{what}: NaN/inf where neither reference has it or vice versa at {where}: got "
            f"{got.detach()[neither][:6].tolist()}, PyTorch {want.detach()[neither][:6].tolist()}, "
            f"in float64 {want64[neither][:6].tolist()}"
        )
    ref, *scale = pick_reference(got, want, want64, *(() if rtol_scale is None else (rtol_scale,)))
    assert_matches(got, ref, what, atol_scale, scale[0] if scale else None)


def assert_identical(got, want, what):
    """Bit for bit, NaNs included (NaN == NaN here, and -0 == 0 as in torch.equal)."""
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    where = (~same).nonzero()[:6].tolist()
    assert same.all(), f"{what}: differs at {where}: {got[~same][:6]} vs {want[~same][:6]}"
