"""Bad input gives a clear error naming the argument; empty, non-contiguous and stride-0 inputs work."""

from __future__ import annotations

import re

import pytest
import torch

from dispatch.ops import fused_linear as linear_spec
from dispatch import ACTIVATION_NAMES, explain, fused_bias_act_dropout, fused_linear
from dispatch import ops
from dispatch.registry import backends
from dispatch.contracts.tolerances import check
from harness import COMPILING, grads, require_call

N, K = 8, 6  # x is (4, N) for bias_act_dropout, (4, K) for fused_linear with weight (N, K)


def _x(shape=(4, N)):
    return torch.randn(shape)


ACTIVATION_LIST = re.escape(", ".join(ACTIVATION_NAMES))


def _bad_bias(other_dtype: torch.dtype) -> dict:
    """The bias cases both ops check alike (x float32 on the CPU, N outputs): not a tensor, another
    floating dtype (``other_dtype``), another device, a shape other than (N,)."""
    return {
        "bias-list": (dict(bias=[0.0] * N), TypeError, r"bias must be a torch\.Tensor, got list"),
        "bias-dtype": (
            dict(bias=torch.ones(N, dtype=other_dtype)),
            TypeError,
            rf"bias must have x's dtype torch\.float32, got {re.escape(str(other_dtype))}",
        ),
        "bias-device": (
            dict(bias=torch.ones(N, device="meta")),
            ValueError,
            r"bias must be on x's device cpu, got meta",
        ),
        "bias-2d": (
            dict(bias=torch.ones(1, N)),
            ValueError,
            rf"bias must have shape \({N},\).*got \(1, {N}\)",
        ),
        "bias-column": (
            dict(bias=torch.ones(N, 1)),
            ValueError,
            rf"bias must have shape \({N},\).*got \({N}, 1\)",
        ),
    }


BAD_BIAS_ACT_DROPOUT = {  # name: (kwargs over the valid call (x, bias, "gelu", 0.1), error, match)
    "x-list": (dict(x=[1.0, 2.0]), TypeError, r"x must be a torch\.Tensor, got list"),
    "x-int": (
        dict(x=torch.ones(4, N, dtype=torch.int64)),
        TypeError,
        r"x must have a floating dtype.*got torch\.int64",
    ),
    "x-bool": (
        dict(x=torch.ones(4, N, dtype=torch.bool)),
        TypeError,
        r"x must have a floating dtype.*got torch\.bool",
    ),
    "x-0d": (dict(x=torch.tensor(1.0)), ValueError, r"x must have at least one dimension"),
    **_bad_bias(torch.float64),
    "bias-int": (
        dict(bias=torch.ones(N, dtype=torch.int32)),
        TypeError,
        r"bias must have a floating dtype.*torch\.int32",
    ),
    "bias-long": (
        dict(bias=torch.ones(N + 1)),
        ValueError,
        rf"bias must have shape \({N},\).*got \({N + 1},\)",
    ),
    "p-negative": (dict(p=-0.1), ValueError, r"p must be a number in \[0, 1\], got -0\.1"),
    "p-above-one": (dict(p=1.0 + 1e-9), ValueError, r"p must be a number in \[0, 1\], got 1\.000000001"),
    "p-nan": (dict(p=float("nan")), ValueError, r"p must be a number in \[0, 1\], got nan"),
    "p-str": (dict(p="0.1"), ValueError, r"p must be a number in \[0, 1\], got '0\.1'"),
    "p-bool": (dict(p=True), ValueError, r"p must be a number in \[0, 1\], got True"),
    "p-tensor": (dict(p=torch.tensor(0.1)), ValueError, r"p must be a number in \[0, 1\]"),
    "activation": (
        dict(activation="swish"),
        ValueError,
        rf"activation must be one of {ACTIVATION_LIST}; got 'swish'",
    ),
    "activation-none": (
        dict(activation=None),
        ValueError,
        rf"activation must be one of {ACTIVATION_LIST}; got None",
    ),
    "training": (dict(training="yes"), TypeError, r"training must be a bool, got str"),
    "generator": (dict(generator=5), TypeError, r"generator must be a torch\.Generator or None, got int"),
    "backend-unknown": (
        dict(backend="nope"),
        ValueError,
        r"backend must be one of pytorch(, \w+)*; got 'nope'",
    ),
    "backend-type": (dict(backend=3), TypeError, r"backend must be a backend name \(str\) or None, got int"),
}


@pytest.mark.parametrize("case", BAD_BIAS_ACT_DROPOUT)
def test_bias_act_dropout_bad_input(case):
    change, error, match = BAD_BIAS_ACT_DROPOUT[case]
    kwargs = dict(x=_x(), bias=torch.randn(N), activation="gelu", p=0.1) | change
    with pytest.raises(error, match=match):
        fused_bias_act_dropout(**kwargs)
    if "backend" not in change:  # explain() validates the same way
        with pytest.raises(error, match=match):
            explain("fused_bias_act_dropout", **kwargs)


BAD_FUSED_LINEAR = {  # name: (kwargs over the valid call (x, weight, bias, "gelu"), error, match)
    "x-list": (dict(x=[[1.0] * K]), TypeError, r"x must be a torch\.Tensor, got list"),
    "x-int": (
        dict(x=torch.ones(4, K, dtype=torch.int32)),
        TypeError,
        r"x must have a floating dtype.*torch\.int32",
    ),
    "x-0d": (dict(x=torch.tensor(1.0)), ValueError, r"x must have at least one dimension"),
    "weight-list": (dict(weight=[[1.0] * K] * N), TypeError, r"weight must be a torch\.Tensor, got list"),
    "weight-bool": (
        dict(weight=torch.ones(N, K, dtype=torch.bool)),
        TypeError,
        r"weight must have a floating dtype.*torch\.bool",
    ),
    "weight-dtype": (
        dict(weight=torch.ones(N, K, dtype=torch.bfloat16)),
        TypeError,
        r"weight must have x's dtype torch\.float32, got torch\.bfloat16",
    ),
    "weight-device": (
        dict(weight=torch.ones(N, K, device="meta")),
        ValueError,
        r"weight must be on x's device cpu, got meta",
    ),
    "weight-k": (
        dict(weight=torch.ones(N, K + 1)),
        ValueError,
        rf"weight must have shape \(out_features, {K}\).*got \({N}, {K + 1}\)",
    ),
    "weight-transposed": (
        dict(weight=torch.ones(K, N)),
        ValueError,
        rf"weight must have shape \(out_features, {K}\).*got \({K}, {N}\)",
    ),
    "weight-1d": (
        dict(weight=torch.ones(K)),
        ValueError,
        rf"weight must have shape \(out_features, {K}\).*got \({K},\)",
    ),
    "weight-3d": (
        dict(weight=torch.ones(1, N, K)),
        ValueError,
        rf"weight must have shape \(out_features, {K}\)",
    ),
    **_bad_bias(torch.float16),
    "bias-shape": (dict(bias=torch.ones(K)), ValueError, rf"bias must have shape \({N},\).*got \({K},\)"),
    "activation": (
        dict(activation="GELU"),
        ValueError,
        rf"activation must be one of {ACTIVATION_LIST}; got 'GELU'",
    ),
    "backend-unknown": (
        dict(backend="cutlass"),
        ValueError,
        r"backend must be one of pytorch(, \w+)*; got 'cutlass'",
    ),
}


@pytest.mark.parametrize("case", BAD_FUSED_LINEAR)
def test_fused_linear_bad_input(case):
    change, error, match = BAD_FUSED_LINEAR[case]
    kwargs = dict(x=_x((4, K)), weight=torch.randn(N, K), bias=torch.randn(N), activation="gelu") | change
    with pytest.raises(error, match=match):
        fused_linear(**kwargs)
    if "backend" not in change:
        with pytest.raises(error, match=match):
            explain("fused_linear", **kwargs)


@pytest.mark.gpu
def test_device_mismatch_on_gpu():
    x = torch.randn(4, N, device="cuda")
    with pytest.raises(ValueError, match=r"bias must be on x's device cuda:0, got cpu"):
        fused_bias_act_dropout(x, torch.randn(N))
    with pytest.raises(ValueError, match=r"weight must be on x's device cuda:0, got cpu"):
        fused_linear(torch.randn(4, K, device="cuda"), torch.randn(N, K))
    with pytest.raises(ValueError, match=r"generator must be on x's device type cuda, got cpu"):
        fused_bias_act_dropout(x, None, "gelu", 0.1, generator=torch.Generator())


# ----------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("p", (0.0, 0.3))
@pytest.mark.parametrize("shape", ((0, 5), (3, 0), (2, 0, 5), (0,)), ids=str)
def test_bias_act_dropout_empty(shape, p, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    bias = torch.randn(shape[-1], device=device, requires_grad=True)
    y = fused_bias_act_dropout(x, bias, "gelu", p)
    assert y.shape == shape and y.numel() == 0
    grad_x, grad_bias = grads(y, (x, bias), torch.randn(shape, device=device), allow_unused=True)
    assert grad_x.shape == shape
    assert torch.equal(grad_bias, torch.zeros_like(bias))


@pytest.mark.parametrize("activation", ("identity", "gelu"))
@pytest.mark.parametrize("x_shape, n", (((0, 4), 3), ((3, 0), 2), ((3, 4), 0), ((2, 0, 4), 3)), ids=str)
def test_fused_linear_empty(x_shape, n, activation, device):
    """A zero-sized M or N gives empty results; K == 0 gives act(bias) in every row."""
    x = torch.randn(x_shape, device=device, requires_grad=True)
    weight = torch.randn(n, x_shape[-1], device=device, requires_grad=True)
    bias = torch.randn(n, device=device, requires_grad=True)
    y = fused_linear(x, weight, bias, activation)
    grad_y = torch.randn(y.shape, device=device)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    ref = linear_spec.reference(*leaves, activation, upcast=True)
    check("y", y.detach(), ref.detach())
    for name, g, r in zip(
        ("grad_x", "grad_weight", "grad_bias"),
        grads(y, (x, weight, bias), grad_y, allow_unused=True),
        grads(ref, leaves, grad_y, allow_unused=True),
    ):
        check(name, g, torch.zeros_like(r) if r is None else r)


# ----------------------------------------------------------------------------- strides


def _grad_through(layout, grad_layout, op, leaves, grad_shape):
    """Output and leaf gradients of op(layout(leaves)) for an upstream gradient laid out by grad_layout."""
    gen = torch.Generator(leaves[0].device).manual_seed(5)
    grad_y = grad_layout(torch.randn(grad_shape, device=leaves[0].device, generator=gen))
    y = op(*layout(leaves))
    return y, torch.autograd.grad(y, leaves, grad_y)


M = 6
X_LAYOUTS = {  # (how to build x (M, N) from a leaf, the leaf's shape)
    "transposed": (lambda t: t.t(), lambda n: (n, M)),
    "sliced": (lambda t: t[:, ::2], lambda n: (M, 2 * n)),
    "expanded": (lambda t: t.expand(M, -1), lambda n: (1, n)),
    "permuted-3d": (lambda t: t.permute(1, 0, 2), lambda n: (3, 2, n)),  # (2, 3, n): 6 rows
}
GRAD_LAYOUTS = {
    "contiguous": lambda g: g,
    "expanded": lambda g: g[..., :1, :].expand_as(g),
    "transposed": lambda g: g.transpose(-1, -2).contiguous().transpose(-1, -2),
}


def _layout_cases(*axes: tuple) -> list:
    """backend x the product of ``axes``; a compiling backend runs the first combination only (every
    layout is a new compile: 1-10 s on a small CPU)."""
    combos = [()]
    for axis in axes:
        combos = [c + (v,) for c in combos for v in axis]
    return [
        pytest.param(b, *c, id="-".join((b, *c)))
        for b in backends()
        for c in (combos[:1] if b in COMPILING else combos)
    ]


@pytest.mark.parametrize(
    "backend, x_layout, grad_layout",
    _layout_cases(tuple(X_LAYOUTS), ("expanded", "contiguous", "transposed")),
)
def test_bias_act_dropout_strides(backend, x_layout, grad_layout, device):
    """Any strides of x, bias and the upstream gradient give the contiguous results, dropout mask
    included: the mask follows the logical (M, N) index, not the memory layout."""
    make_x, leaf_shape = X_LAYOUTS[x_layout]
    x_leaf = torch.randn(leaf_shape(N), device=device, requires_grad=True)
    bias_leaf = torch.randn(2 * N, device=device, requires_grad=True)
    x_shape = make_x(x_leaf).shape
    require_call(
        backend,
        ops.get("bias_act_dropout").call(
            x_leaf.device, torch.float32, (x_shape.numel() // N, N), True, activation="gelu", dropout=True
        ),
    )
    to_grad = GRAD_LAYOUTS[grad_layout]

    def op(backend):
        def run(x, bias):
            gen = torch.Generator(device=device).manual_seed(11)
            return fused_bias_act_dropout(x, bias, "gelu", 0.3, generator=gen, backend=backend)
        return run

    def strided(leaves):
        return make_x(leaves[0]), leaves[1][::2]

    def contiguous(leaves):
        return make_x(leaves[0]).contiguous(), leaves[1][::2].contiguous()

    # A compiling backend's contiguous twin is eager's (same mask, same draw): another layout is another
    # pair of dropout graphs, ~6 s each to compile on a 2-core CPU.
    y, grads = _grad_through(strided, to_grad, op(backend), [x_leaf, bias_leaf], x_shape)
    y_c, grads_c = _grad_through(
        contiguous, lambda g: to_grad(g).contiguous(), op("eager" if backend in COMPILING else backend),
        [x_leaf, bias_leaf], x_shape,
    )
    torch.testing.assert_close(y, y_c)
    for g, g_c in zip(grads, grads_c):
        torch.testing.assert_close(g, g_c)


W_LAYOUTS = {  # weight (N, K) from a leaf
    "transposed": (lambda t: t.t(), (K, N)),
    "sliced": (lambda t: t[:, 1::2], (N, 2 * K)),
    "expanded": (lambda t: t.expand(N, -1), (1, K)),
}


@pytest.mark.parametrize(
    "backend, x_layout, w_layout, grad_layout",
    _layout_cases(("transposed", "expanded"), tuple(W_LAYOUTS), ("expanded", "transposed")),
)
def test_fused_linear_strides(backend, x_layout, w_layout, grad_layout, device):
    make_x, leaf_shape = X_LAYOUTS[x_layout]
    make_w, w_shape = W_LAYOUTS[w_layout]
    leaves = [
        torch.randn(leaf_shape(K), device=device, requires_grad=True),
        torch.randn(w_shape, device=device, requires_grad=True),
        torch.randn(1, device=device, requires_grad=True),  # bias: stride 0
    ]
    require_call(backend, linear_spec.SPEC.call(leaves[0].device, torch.float32, (M, N, K), True, activation="gelu"))

    def op(x, weight, bias):
        return fused_linear(x, weight, bias, "gelu", backend=backend)

    def strided(ls):
        return make_x(ls[0]), make_w(ls[1]), ls[2].expand(N)

    def contiguous(ls):
        return tuple(t.contiguous() for t in strided(ls))

    to_grad = GRAD_LAYOUTS[grad_layout]
    y, grads = _grad_through(strided, to_grad, op, leaves, (M, N))
    y_c, grads_c = _grad_through(contiguous, lambda g: to_grad(g).contiguous(), op, leaves, (M, N))
    torch.testing.assert_close(y, y_c)
    for g, g_c in zip(grads, grads_c):
        torch.testing.assert_close(g, g_c)
