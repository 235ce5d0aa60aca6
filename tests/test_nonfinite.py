"""NaN, +-inf and huge finite inputs at p = 0: every backend gives what PyTorch's own composite gives,
bias_act_dropout's and fused_linear's outputs and every gradient, and triton on the GPU at model sizes.
The references and their tolerances: nonfinite_checks.py; dropout: test_nonfinite_dropout.py.

Hypothesis draws where the special values go; every backend keeps one shape so that the compiled
backends compile once per activation and direction. Inductor builds a C++ kernel a graph, 3-9 s each
on a cold cache with 2 cores (~15 s with dropout), four graphs an activation: on the CPU it runs relu
(NaN through max and threshold_backward) and squared_relu (this package's composed backward); the
other activations are single PyTorch kernels, which eager and nvfuser cover here. Its fused_linear
relu and its dropout case (test_nonfinite_dropout.py) are test_compiled_backends' graphs (K = 40,
N = 24; identity, no bias, p = 0.25, N = 40), compiled once for these files in one run, or read from
inductor's on-disk cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from dispatch.backends.eager import bias_act_dropout as eager_bad
from dispatch import fused_bias_act_dropout, fused_linear
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.contracts.tolerances import ATOL, RTOL
from nonfinite_checks import (
    BACKENDS, COMPOSITE, GRAD_SPECIALS, INF, INTERPRETER_WARNINGS, LINEAR_X_SPECIALS, NAN, SHAPE, SPECIALS,
    assert_identical, assert_matches, assert_matches_either, randn, skip_unless_supported,
)  # fmt: skip

pytestmark = INTERPRETER_WARNINGS

LINEAR = (7, 40, 24)  # fused_linear's (M, K, N): K ends inside the interpreter's third 16-deep K block
CPU_ACTIVATIONS = {"inductor": ("relu", "squared_relu")}  # see the module's docstring
CASES = [(b, a) for b in BACKENDS for a in CPU_ACTIVATIONS.get(b, ACTIVATION_NAMES)]
MAX_EXAMPLES = {"triton": 2, "inductor": 2}  # beside @example's; the interpreter is the slowest
DEFAULT_EXAMPLES = 4
# no shrinking: through the interpreter it took minutes; a failure prints its example unshrunk
PHASES = (Phase.explicit, Phase.generate)


def _spots(values: tuple[float, ...], max_size: int):
    """(flat index, value) pairs; indices wrap around the tensor they are written into."""
    return st.lists(st.tuples(st.integers(0, 2**20), st.sampled_from(values)), max_size=max_size)


def _put(t: torch.Tensor, spots) -> torch.Tensor:
    flat = t.view(-1)
    for index, value in spots:
        flat[index % flat.numel()] = value
    return t


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


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
    skip_unless_supported(backend, "bias_act_dropout", SHAPE, activation)

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
        x = _put(randn(gen, m, n, scale=3.0), x_spots)
        b = _put(randn(gen, n), b_spots)
        g = _put(randn(gen, m, n), g_spots)

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
    skip_unless_supported(backend, "bias_act_dropout", SHAPE, "squared_relu")
    gen = torch.Generator().manual_seed(7)
    m, n = SHAPE
    x, b, g = randn(gen, m, n), randn(gen, n), randn(gen, m, n)
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
    skip_unless_supported(backend, "fused_linear", (m, n, k), activation)

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
        x = _put(randn(gen, m, k), x_spots)
        w = randn(gen, n, k, scale=k**-0.5)
        b = _put(randn(gen, n), b_spots)
        g = randn(gen, m, n)

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
    assert_identical(got, want, f"dropout {dtype} y")
    keep = dropout_rng.keep_mask(rng, *x.shape, 0.1)
    special = ~torch.isfinite(x.float() + b.float())
    assert (~keep & special).any() and torch.isnan(got[~keep & special]).all()
    got_gx, _ = triton_bad.backward(g, x, b, "identity", 0.1, rng, True, False)
    want_gx, _ = eager_bad.backward(g, x, b, "identity", 0.1, rng, True, False)
    assert_identical(got_gx, want_gx, f"dropout {dtype} grad_x")
