"""NaN, +-inf and huge finite inputs: every backend gives what PyTorch's own composite gives.

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

Hypothesis draws where the special values go; every backend keeps one shape so that the compiled
backends compile once per activation and direction. Inductor builds a C++ kernel a graph, 3-9 s each
on a cold cache with 2 cores (~15 s with dropout), four graphs an activation: on the CPU it runs relu
(NaN through max and threshold_backward) and squared_relu (this package's composed backward); the
other activations are single PyTorch kernels, which eager and nvfuser cover here. Its fused_linear
relu and its dropout case are test_compiled_backends' graphs (K = 40, N = 24; identity, no bias,
p = 0.25, N = 40), compiled once for both files in one run, or read from inductor's on-disk cache.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from dispatch.backends.eager import bias_act_dropout as eager_bad
from dispatch import fused_bias_act_dropout, fused_linear
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATION_NAMES, LEAKY_RELU_SLOPE
from dispatch.registry import Call, backends
from dispatch.contracts.tolerances import ATOL, RTOL

# The interpreter evaluates kernels in numpy, which warns on every inf * 0 these inputs are made of.
pytestmark = [
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
LINEAR = (7, 40, 24)  # fused_linear's (M, K, N): K ends inside the interpreter's third 16-deep K block
BACKENDS = tuple(backends())
CPU_ACTIVATIONS = {"inductor": ("relu", "squared_relu")}  # see the module's docstring
CASES = [(b, a) for b in BACKENDS for a in CPU_ACTIVATIONS.get(b, ACTIVATION_NAMES)]
MAX_EXAMPLES = {"triton": 2, "inductor": 2}  # beside @example's; the interpreter is the slowest
DEFAULT_EXAMPLES = 4
# no shrinking: through the interpreter it took minutes; a failure prints its example unshrunk
PHASES = (Phase.explicit, Phase.generate)
ATOL32, RTOL32 = ATOL[torch.float32], RTOL[torch.float32]


def _skip_unless_supported(backend: str, op: str, shape: tuple[int, ...], activation: str, dropout=False):
    call = Call(op, torch.device("cpu"), torch.float32, shape, activation, dropout, True)
    reasons = backends()[backend].not_supported_reasons(call)
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")


def _spots(values: tuple[float, ...], max_size: int):
    """(flat index, value) pairs; indices wrap around the tensor they are written into."""
    return st.lists(st.tuples(st.integers(0, 2**20), st.sampled_from(values)), max_size=max_size)


def _put(t: torch.Tensor, spots) -> torch.Tensor:
    flat = t.view(-1)
    for index, value in spots:
        flat[index % flat.numel()] = value
    return t


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
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


def test_pick_reference_takes_either_class_and_holds_its_value():
    want = torch.tensor([NAN, INF, 1.0, INF, 2.0, -INF])
    want64 = torch.tensor([INF, INF, 1.0, 3e38, 2.0, NAN], dtype=torch.float64)
    for got in ([INF, INF, 1.0, 3e38, 2.0, -INF], [NAN, INF, 1.0, INF, 2.0, NAN]):
        assert_matches_either(torch.tensor(got), want, want64, "either")
    assert_matches_either(
        torch.tensor([INF, INF, 1.0, 3e38, 2.0, NAN]), want, want64, "pairs", rtol_scale=(want.abs(), 1.0)
    )
    wrong = {0: -INF, 1: NAN, 2: 1.1, 3: 3.3e38, 4: INF, 5: 0.0}
    for k, value in wrong.items():
        got = torch.tensor([INF, INF, 1.0, 3e38, 2.0, -INF])
        got[k] = value
        with pytest.raises(AssertionError):
            assert_matches_either(got, want, want64, f"wrong at {k}")


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def test_the_composites_cover_every_activation():
    assert set(COMPOSITE) == set(ACTIVATION_NAMES)


# ----------------------------------------------------------------------------- bias_act_dropout, p = 0

# every special value against a normal bias with a NaN grad_y (row 1; relu's and squared_relu's
# gradients select 0 at z <= 0 even then), the first six also against special biases (row 0), and NaN
# and huge grad_y at normal z of either sign (row 2)
_EVERY_SPECIAL = [(k, v) for k, v in enumerate(SPECIALS)] + [(39 + k, v) for k, v in enumerate(SPECIALS)]
_BIAS_SPECIALS = [(k, v) for k, v in enumerate((INF, -INF, NAN, 3e38, -3e38, 1e30))]
_GRAD_AT_BOTH_SIGNS = [(39 + k, NAN) for k in range(len(SPECIALS))] + [
    (66 + k, v) for k, v in enumerate(GRAD_SPECIALS * 3)
]


@pytest.mark.parametrize(("backend", "activation"), CASES)
def test_bias_act_nonfinite_matches_pytorch(backend, activation):
    """y = act(x + b), grad_x and grad_bias at p = 0 with special values in x, the bias and grad_y."""
    _skip_unless_supported(backend, "bias_act_dropout", SHAPE, activation)

    @settings(
        max_examples=MAX_EXAMPLES.get(backend, DEFAULT_EXAMPLES),
        deadline=None,
        database=None,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        seed=st.integers(0, 2**31 - 1),
        x_spots=_spots(SPECIALS, 40),
        b_spots=_spots(SPECIALS, 4),
        g_spots=_spots(GRAD_SPECIALS, 6),
    )
    @example(seed=0, x_spots=_EVERY_SPECIAL, b_spots=_BIAS_SPECIALS, g_spots=_GRAD_AT_BOTH_SIGNS)
    def check(seed, x_spots, b_spots, g_spots):
        gen = torch.Generator().manual_seed(seed)
        m, n = SHAPE
        x = _put(_randn(gen, m, n, scale=3.0), x_spots)
        b = _put(_randn(gen, n), b_spots)
        g = _put(_randn(gen, m, n), g_spots)

        xr, br = _leaves(x, b)
        z = xr + br
        want = COMPOSITE[activation](z)
        want64 = COMPOSITE[activation](z.double()).float()  # the same z, the activation in float64
        want_gx, want_gb = torch.autograd.grad(want, (xr, br), g, retain_graph=True)
        want64_gx, want64_gb = torch.autograd.grad(want64, (xr, br), g)

        xb, bb = _leaves(x, b)
        got = fused_bias_act_dropout(xb, bb, activation, 0.0, backend=backend)
        got_gx, got_gb = torch.autograd.grad(got, (xb, bb), g)

        what = f"{backend} {activation}"
        assert_matches_either(got, want, want64, f"{what} y")
        # a derivative's absolute error scales with |grad_y|
        g_scale = g.double().abs().clamp(min=1.0)
        assert_matches_either(got_gx, want_gx, want64_gx, f"{what} grad_x", atol_scale=g_scale)
        gb_terms = (want_gx.double().abs().sum(0), want64_gx.double().abs().sum(0))
        assert_matches_either(
            got_gb, want_gb, want64_gb, f"{what} grad_bias", atol_scale=g_scale.sum(0), rtol_scale=gb_terms
        )

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_huge_bias_column_sums_its_rows_only(backend):
    """grad_bias where act'(bias) overflows (squared_relu's 2 * 3e38 = inf): the rows past M in a
    kernel's last block (x and grad_y 0, z = bias) must add nothing, not inf * 0 = NaN. With every
    grad_y of that column negative, PyTorch gives -inf there and finite sums elsewhere."""
    _skip_unless_supported(backend, "bias_act_dropout", SHAPE, "squared_relu")
    gen = torch.Generator().manual_seed(7)
    m, n = SHAPE
    x, b, g = _randn(gen, m, n), _randn(gen, n), _randn(gen, m, n)
    b[6], g[:, 6] = 3e38, -g[:, 6].abs() - 0.5
    xr, br = _leaves(x, b)
    want_gb = torch.autograd.grad(COMPOSITE["squared_relu"](xr + br), br, g)[0]
    xb, bb = _leaves(x, b)
    got = fused_bias_act_dropout(xb, bb, "squared_relu", 0.0, backend=backend)
    got_gb = torch.autograd.grad(got, bb, g)[0]
    assert torch.isneginf(want_gb[6]) and torch.isneginf(got_gb[6]), (want_gb[6], got_gb[6])
    assert_matches(got_gb, want_gb, f"{backend} grad_bias", atol_scale=g.abs().sum(0))


# ----------------------------------------------------------------------------- fused_linear

_X_EVERY_SPECIAL = [(k * (LINEAR[1] + 1), v) for k, v in enumerate(LINEAR_X_SPECIALS * 2)]  # (k, k)
_LINEAR_BIAS_SPECIALS = [(k, v) for k, v in enumerate(SPECIALS)]


@pytest.mark.parametrize(("backend", "activation"), CASES)
def test_fused_linear_nonfinite_matches_pytorch(backend, activation):
    """act(x @ W^T + b) and its three gradients: NaN/inf in x reach whole rows of y through the
    product (NaN where +inf and -inf terms meet), huge finite and non-finite values in the bias whole
    columns."""
    m, k, n = LINEAR
    _skip_unless_supported(backend, "fused_linear", (m, n, k), activation)

    @settings(
        max_examples=MAX_EXAMPLES.get(backend, DEFAULT_EXAMPLES),
        deadline=None,
        database=None,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(seed=st.integers(0, 2**31 - 1), x_spots=_spots(LINEAR_X_SPECIALS, 6), b_spots=_spots(SPECIALS, 6))
    @example(seed=0, x_spots=_X_EVERY_SPECIAL, b_spots=_LINEAR_BIAS_SPECIALS)
    def check(seed, x_spots, b_spots):
        gen = torch.Generator().manual_seed(seed)
        x = _put(_randn(gen, m, k), x_spots)
        w = _randn(gen, n, k, scale=k**-0.5)
        b = _put(_randn(gen, n), b_spots)
        g = _randn(gen, m, n)

        xr, wr, br = _leaves(x, w, b)
        pre = F.linear(xr, wr, br)
        want = COMPOSITE[activation](pre)
        want64 = COMPOSITE[activation](pre.double()).float()  # the same pre, the activation in float64
        leaves = (xr, wr, br, pre)
        want_gx, want_gw, want_gb, want_gpre = torch.autograd.grad(want, leaves, g, retain_graph=True)
        want64_gx, want64_gw, want64_gb, want64_gpre = torch.autograd.grad(want64, leaves, g)
        # act' for the bounds, in float64: finite where float32's overflows (gelu_tanh's past 1.8e19)
        z = pre.detach().double().requires_grad_()
        (slope,) = torch.autograd.grad(COMPOSITE[activation](z), z, torch.ones_like(z))
        # relu's and leaky_relu's derivative jumps at 0: a pre-activation within rounding of 0 may
        # land on either side in another summation order
        assume(not (torch.isfinite(pre) & (pre.abs() < 1e-4)).any())

        xb, wb, bb = _leaves(x, w, b)
        got = fused_linear(xb, wb, bb, activation, backend=backend)
        got_gx, got_gw, got_gb = torch.autograd.grad(got, (xb, wb, bb), g)

        # Bounds: the product's rounding is relative to the sum of |terms|; the activation carries the
        # pre-activation's error by |act'|, its derivative by |act''| <= 2 (squared_relu's). A non-finite
        # pre-activation is exact (its row or column holds the special value itself).
        x64, w64, g64 = x.double().abs(), w.double().abs(), g.double().abs()
        pre_terms = x64 @ w64.t() + b.double().abs()
        pre_terms = torch.where(torch.isfinite(pre.detach()), pre_terms, 0.0)
        # each of the two references with its own grad_pre's terms (pick_reference picks them with it)
        gpre_terms = [
            torch.nan_to_num(gpre.double().abs() + 2.0 * g64 * pre_terms, nan=INF)
            for gpre in (want_gpre, want64_gpre)
        ]
        what = f"{backend} {activation}"
        y_terms = tuple(y.double().abs() + slope.abs() * pre_terms for y in (want, want64))
        assert_matches_either(got, want, want64, f"{what} y", rtol_scale=y_terms)
        gx_terms = tuple(torch.nan_to_num(t @ w64, nan=INF) for t in gpre_terms)
        assert_matches_either(got_gx, want_gx, want64_gx, f"{what} grad_x", 1.0 + g64 @ w64, gx_terms)
        gw_terms = tuple(torch.nan_to_num(t.t() @ x64, nan=INF) for t in gpre_terms)
        assert_matches_either(
            got_gw, want_gw, want64_gw, f"{what} grad_weight", 1.0 + g64.t() @ x64, gw_terms
        )
        gb_terms = tuple(t.sum(0) for t in gpre_terms)
        assert_matches_either(got_gb, want_gb, want64_gb, f"{what} grad_bias", 1.0 + g64.sum(0), gb_terms)

    check()


# ----------------------------------------------------------------------------- dropout


def _dropout_case(backend, activation, x, b, g, p, seed):
    """(y, grad_x, grad_bias or None) of the public op, its rng drawn right after manual_seed(seed)."""
    xb = x.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    torch.manual_seed(seed)
    y = fused_bias_act_dropout(xb, bb, activation, p, backend=backend)
    grads = torch.autograd.grad(y, [t for t in (xb, bb) if t is not None], g)
    return y.detach(), grads[0], grads[1] if bb is not None else None


def _assert_identical(got, want, what):
    """Bit for bit, NaNs included (NaN == NaN here, and -0 == 0 as in torch.equal)."""
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    where = (~same).nonzero()[:6].tolist()
    assert same.all(), f"{what}: differs at {where}: {got[~same][:6]} vs {want[~same][:6]}"


# (backend, activation, with bias, p, N): eager and triton run several activations with a bias; the
# compiled backends run test_compiled_backends' dropout graph (identity, no bias, p = 0.25, N = 40).
# Backends whose masks are torch's (pytorch: F.dropout itself) are F.dropout's rule by construction.
_DROPOUT_CASES = [
    (backend, activation, True, 0.5, 33)
    for backend in ("eager", "triton")
    for activation in ("identity", "relu", "gelu", "silu")
] + [
    (backend, "identity", False, 0.25, 40)
    for backend in BACKENDS
    if backend not in ("eager", "triton") and not backends()[backend].torch_masks
]


@pytest.mark.parametrize(("backend", "activation", "has_bias", "p", "n"), _DROPOUT_CASES)
def test_dropout_keeps_nan_like_f_dropout(backend, activation, has_bias, p, n):
    """y = act(x + b) * keep * scale: F.dropout's product, so a NaN or inf that is dropped gives NaN
    (NaN * 0, inf * 0), a finite one 0; backward is grad_y * keep * scale * act'(z), autograd's
    gradient of that product. Eager follows the rule bit for bit (same dispatch.contracts.rng mask, drawn after
    the same manual_seed); the other backends follow eager: bit for bit where the activation is exact
    in float32 (identity, relu), within tolerance with the same NaN/inf pattern otherwise."""
    m, seed = SHAPE[0], 20261130
    _skip_unless_supported(backend, "bias_act_dropout", (m, n), activation, dropout=True)
    gen = torch.Generator().manual_seed(1)
    x = _randn(gen, m, n, scale=3.0)
    x.view(-1)[::3] = torch.tensor(SPECIALS).repeat(m * n)[: len(x.view(-1)[::3])]
    b = _randn(gen, n) if has_bias else None
    g = _randn(gen, m, n)

    # the rule, with the mask the op draws: dispatch.contracts.rng's draw right after the same manual_seed
    torch.manual_seed(seed)
    keep = dropout_rng.keep_mask(dropout_rng.draw(torch.device("cpu")), m, n, p)
    scale = dropout_rng.keep_scale(p)
    xr = x.clone().requires_grad_()
    br = None if b is None else b.clone().requires_grad_()
    act = COMPOSITE[activation](xr if br is None else xr + br)
    rule = act * keep * scale
    rule_grads = torch.autograd.grad(rule, [t for t in (xr, br) if t is not None], g)
    act = act.detach()
    dropped_special = ~keep & ~torch.isfinite(act)
    assert dropped_special.any() and (keep & ~torch.isfinite(act)).any()
    assert torch.isnan(rule[dropped_special]).all()  # F.dropout's: NaN * 0 and inf * 0 are NaN
    # F.dropout itself treats them so (its own mask): every non-finite input it drops comes out NaN
    fd = F.dropout(act, p, training=True)
    assert torch.isnan(fd[~torch.isfinite(act) & ~torch.isinf(fd)]).all()

    y, gx, gb = _dropout_case("eager", activation, x, b, g, p, seed)
    _assert_identical(y, rule.detach(), f"eager {activation} y vs act(z) * keep * scale")
    _assert_identical(gx, rule_grads[0], f"eager {activation} grad_x vs autograd of the rule")
    if b is not None:
        gb_terms = gx.double().abs().sum(0)
        assert_matches(gb, rule_grads[1], f"eager {activation} grad_bias", rtol_scale=gb_terms)
    if backend == "eager":
        return

    # the other reference (see the module's docstring): eager on float64 copies, with the same mask (its
    # rng spec's, whatever the dtype): nonzero exactly where kept, wherever act(z) is finite and nonzero
    # in float64 (float32's gelu(-7.6) is already 0, float64's -2e-13)
    x64, b64 = x.double(), None if b is None else b.double()
    y64, gx64, gb64 = _dropout_case("eager", activation, x64, b64, g.double(), p, seed)
    act64 = COMPOSITE[activation](x64 if b64 is None else x64 + b64)
    live = torch.isfinite(act64) & (act64 != 0)
    assert (live & keep).any() and (live & ~keep).any() and torch.equal((y64 != 0)[live], keep[live])

    got_y, got_gx, got_gb = _dropout_case(backend, activation, x, b, g, p, seed)
    what = f"{backend} {activation} p={p}"
    if activation in ("identity", "relu"):
        _assert_identical(got_y, y, f"{what} y vs eager")
        _assert_identical(got_gx, gx, f"{what} grad_x vs eager")
    else:
        assert_matches_either(got_y, y, y64, f"{what} y vs eager")
        g_scale = g.double().abs().clamp(min=1.0)
        assert_matches_either(got_gx, gx, gx64, f"{what} grad_x vs eager", atol_scale=g_scale)
    if b is not None:
        gb_terms = (gx.double().abs().sum(0) + 1.0, gx64.abs().sum(0) + 1.0)
        assert_matches_either(got_gb, gb, gb64, f"{what} grad_bias vs eager", rtol_scale=gb_terms)


def test_dropout_rows_kernel_keeps_nan(monkeypatch):
    """The 16-bit rows kernel (dropout past 64 rows) multiplies by the mask as the tile kernel does:
    bfloat16 y bit for bit the tile kernel's, NaN wherever a non-finite value is dropped, with eager's
    NaN/inf pattern. (Not bit for bit eager's here: the interpreter rounds float32 to bfloat16 its own
    way, at p = 0 too; the GPU test compares with eager bit for bit.) gelu: NaN from -inf as well."""
    activation = "gelu"
    _skip_unless_supported("triton", "bias_act_dropout", (72, 16), activation, dropout=True)
    from dispatch.backends.triton import bias_act_dropout as triton_bad

    m, n, p = 72, 16, 0.5
    gen = torch.Generator().manual_seed(2)
    x = _randn(gen, m, n, scale=3.0)
    x.view(-1)[::5] = torch.tensor(NONFINITE + (3e38, -3e38)).repeat(m * n)[: len(x.view(-1)[::5])]
    x, b = x.to(torch.bfloat16), _randn(gen, n).to(torch.bfloat16)
    rng = dropout_rng.draw(torch.device("cpu"))
    assert triton_bad._rows_kernel_fits(x, b, rng, m, n)
    got = triton_bad.forward(x, b, activation, p, rng)
    with monkeypatch.context() as patched:
        patched.setattr(triton_bad, "_rows_kernel_fits", lambda *args: False)
        tiled = triton_bad.forward(x, b, activation, p, rng)
    assert torch.equal(got.view(torch.int16), tiled.view(torch.int16))
    # eager's float32 math and, for the other reference (module docstring), eager on float64 copies
    want32 = eager_bad.forward(x, b, activation, p, rng)
    want64 = eager_bad.forward(x.double(), b.double(), activation, p, rng)
    keep = dropout_rng.keep_mask(rng, m, n, p)
    z = x.float() + b.float()
    act32, act64 = COMPOSITE[activation](z), COMPOSITE[activation](z.double())
    dropped_special = ~keep & ~torch.isfinite(act32) & ~torch.isfinite(act64)
    assert dropped_special.any() and torch.isnan(got[dropped_special]).all()
    (want,) = pick_reference(got, want32, want64)
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(got), kind(want)), f"rows kernel {activation}: {kind.__name__} pattern"
    dropped_finite = ~keep & torch.isfinite(want)
    assert torch.equal(got[dropped_finite], torch.zeros_like(got[dropped_finite]))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=RTOL[torch.bfloat16], atol=ATOL[torch.bfloat16])


# ----------------------------------------------------------------------------- GPU


def _gpu_bias_act_case(activation, dtype, gen):
    m, n = 512, 1024
    x = torch.randn(m, n, generator=gen) * 3.0
    flat = x.view(-1)
    positions = torch.randperm(m * n, generator=gen)[: m * n // 16]
    flat[positions] = torch.tensor(SPECIALS).repeat(len(positions))[: len(positions)]
    b = torch.randn(n, generator=gen)
    b[: len(SPECIALS)] = torch.tensor(SPECIALS)
    g = torch.randn(m, n, generator=gen)
    g.view(-1)[positions[::7]] = torch.tensor(GRAD_SPECIALS).repeat(m * n)[: len(positions[::7])]
    return [t.to("cuda", dtype) for t in (x, b, g)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_gpu_triton_nonfinite(dtype):
    """triton on CUDA, every activation, both ops, at model sizes (bias_act 512 x 1024, fused_linear
    M, N, K = 256, 512, 256), NaN/inf/huge values as above. The reference is PyTorch's composite in
    float32 on the same GPU from the same (rounded) inputs, rounded once to the dtype, the way the
    kernels compute: float32 math, one rounding. Also dropout on the tile kernel (float32) and the
    rows kernel (bfloat16, M > 64) against eager, which must follow the same mask."""
    gen = torch.Generator().manual_seed(3)
    atol, rtol = ATOL[dtype], RTOL[dtype]

    def close(got, want, what, scale=None):
        want = want.to(dtype)
        for kind in (torch.isnan, torch.isposinf, torch.isneginf):
            differ = kind(got) != kind(want)
            assert not differ.any(), f"{what}: {kind.__name__} differs at {differ.nonzero()[:6].tolist()}"
        fin = torch.isfinite(want)
        s = want.double().abs() if scale is None else scale.double()
        err = (got.double() - want.double()).abs()
        bound = torch.nan_to_num(atol + rtol * s, nan=INF)
        assert (err <= bound)[fin].all(), f"{what}: max excess {((err - bound)[fin]).max().item():.3g}"

    for activation in ACTIVATION_NAMES:
        x, b, g = _gpu_bias_act_case(activation, dtype, gen)
        xr, br = _leaves(x.float(), b.float())
        want = COMPOSITE[activation](xr + br)
        want_gx, want_gb = torch.autograd.grad(want, (xr, br), g.float())
        xb, bb = _leaves(x, b)
        got = fused_bias_act_dropout(xb, bb, activation, 0.0, backend="triton")
        got_gx, got_gb = torch.autograd.grad(got, (xb, bb), g)
        close(got, want, f"bias_act {activation} y")
        close(got_gx, want_gx, f"bias_act {activation} grad_x", want_gx.abs() + g.float().abs())
        gb_terms = want_gx.abs().sum(0) + g.float().abs().sum(0)
        close(got_gb, want_gb, f"bias_act {activation} grad_bias", gb_terms)

        m, n, k = 256, 512, 256
        x = torch.randn(m, k, generator=gen)
        x.view(-1)[torch.randperm(m * k, generator=gen)[:24]] = torch.tensor(LINEAR_X_SPECIALS).repeat(8)[:24]
        w = torch.randn(n, k, generator=gen) * k**-0.5
        b = torch.randn(n, generator=gen)
        b[: len(SPECIALS)] = torch.tensor(SPECIALS)
        g = torch.randn(m, n, generator=gen)
        x, w, b, g = (t.to("cuda", dtype) for t in (x, w, b, g))
        xr, wr, br = _leaves(x.float(), w.float(), b.float())
        pre = F.linear(xr, wr, br)
        want = COMPOSITE[activation](pre)
        want_gx, want_gw, want_gb = torch.autograd.grad(want, (xr, wr, br), g.float())
        xb, wb, bb = _leaves(x, w, b)
        got = fused_linear(xb, wb, bb, activation, backend="triton")
        got_gx, got_gw, got_gb = torch.autograd.grad(got, (xb, wb, bb), g)
        terms = (xr.detach().abs() @ wr.detach().abs().t() + br.detach().abs()).nan_to_num(posinf=0.0)
        slope_bound = 1 + 2 * pre.detach().abs().nan_to_num(posinf=0.0)  # |act'| <= 1 + 2 |pre|
        close(got, want, f"fused_linear {activation} y", want.abs() + terms * slope_bound)
        # the gradients' NaN/inf patterns only: their finite values at this size are
        # test_triton_fused_linear's (bf16 products rounded at other points than the float32 reference's)
        close(got_gx, want_gx, f"fused_linear {activation} grad_x", torch.full_like(want_gx, INF))
        close(got_gw, want_gw, f"fused_linear {activation} grad_weight", torch.full_like(want_gw, INF))
        close(got_gb, want_gb, f"fused_linear {activation} grad_bias", torch.full_like(want_gb, INF))

    # dropout: triton equals eager for identity (bit for bit) with the same rng, NaN where dropped
    x, b, g = _gpu_bias_act_case("identity", dtype, gen)
    rng = dropout_rng.draw(torch.device("cuda"))
    from dispatch.backends.triton import bias_act_dropout as triton_bad

    got = triton_bad.forward(x, b, "identity", 0.1, rng)
    want = eager_bad.forward(x, b, "identity", 0.1, rng)
    _assert_identical(got, want, f"dropout {dtype} y")
    keep = dropout_rng.keep_mask(rng, *x.shape, 0.1)
    special = ~torch.isfinite(x.float() + b.float())
    assert (~keep & special).any() and torch.isnan(got[~keep & special]).all()
    got_gx, _ = triton_bad.backward(g, x, b, "identity", 0.1, rng, True, False)
    want_gx, _ = eager_bad.backward(g, x, b, "identity", 0.1, rng, True, False)
    _assert_identical(got_gx, want_gx, f"dropout {dtype} grad_x")
