"""fused_mlp on every registered backend that serves it, against the float64 reference: the output and
every gradient, for plain and gated activations, stacked and paired gate weights, with and without
biases and both dropouts; plus its argument checks, its masks and its second derivative."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dispatch import explain, fused_mlp
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS, GATED_NAMES, GATES
from dispatch.contracts.tolerances import check
from dispatch.ops import fused_mlp as mlp_spec
from dispatch.registry import Call, backends
from harness import DTYPES, cpu_budget, grads, require_call, torch_masks

GEN_SEED = 20261204
SHAPES = ((7, 5, 6), (1, 9, 17), (2, 3, 4, 8))  # x's shape ..., then H, F: (M.., H, F)


def _id(*parts) -> str:
    return "-".join(str(p).removeprefix("torch.") for p in parts)


def _case_list(backend: str) -> list:
    """(dtype, activation, layout, bias, p, p_out, shape): every activation in float32 with both dropouts,
    the gated ones paired too, each dtype once, no bias and no dropout once each."""
    f32, bf16, f16 = DTYPES
    cases = [(f32, a, "stacked", True, 0.3, 0.2, SHAPES[0]) for a in (*ACTIVATION_NAMES, *GATED_NAMES)]
    cases += [(f32, a, "pair", True, 0.3, 0.0, SHAPES[1]) for a in GATED_NAMES]
    cases += [(d, "gelu_tanh", "stacked", True, 0.1, 0.1, SHAPES[2]) for d in (bf16, f16)]
    cases += [
        (bf16, "swiglu", "pair", False, 0.0, 0.0, SHAPES[1]),
        (f32, "relu", "stacked", False, 0.0, 0.0, SHAPES[2]),
    ]
    ids = [_id(backend, *c[:6], "x".join(map(str, c[6]))) for c in cases]
    marks = [cpu_budget(backend, c in ON_CPU) for c in cases]
    return [pytest.param(backend, *c, id=i, marks=mk) for c, i, mk in zip(cases, ids, marks)]


# A compiling backend's cases on CPU (10-40 s a compile there): plain and gated, with and without dropout,
# float32 and bfloat16, the gate stacked and paired
ON_CPU = (
    (DTYPES[0], "gelu", "stacked", True, 0.3, 0.2, SHAPES[0]),
    (DTYPES[0], "geglu", "pair", True, 0.3, 0.0, SHAPES[1]),
    (DTYPES[1], "swiglu", "pair", False, 0.0, 0.0, SHAPES[1]),
)


def _inputs(dtype, activation, layout, bias, shape, device):
    *lead, h, f = shape
    gated = activation in GATED_NAMES
    g = torch.Generator(device=device).manual_seed(hash((activation, layout, shape)) % 2**31)

    def leaf(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=device) * scale).to(dtype).requires_grad_()

    x = leaf(*lead, h)
    if gated and layout == "pair":
        w_in = (leaf(f, h, scale=h**-0.5), leaf(f, h, scale=h**-0.5))
        b_in = (leaf(f, scale=0.5), leaf(f, scale=0.5)) if bias else None
    else:
        rows = 2 * f if gated else f
        w_in, b_in = leaf(rows, h, scale=h**-0.5), (leaf(rows, scale=0.5) if bias else None)
    w_out, b_out = leaf(h + 1, f, scale=f**-0.5), (leaf(h + 1, scale=0.5) if bias else None)
    return x, w_in, b_in, w_out, b_out


def _flat(x, w_in, b_in, w_out, b_out) -> list:
    pair = lambda t: list(t) if isinstance(t, tuple) else [t]  # noqa: E731
    return [x, *pair(w_in), *pair(b_in), w_out, b_out]


def _reference(args, activation, p, p_out, upcast, device, keeps=(None, None)):
    """The reference with the masks the op draws from a generator seeded GEN_SEED (hidden, then output)."""
    x, w_in, b_in, w_out, b_out = args
    m, f, h_out = math.prod(x.shape[:-1]), w_out.shape[1], w_out.shape[0]
    gen = torch.Generator(device=device).manual_seed(GEN_SEED)
    rngs = (
        dropout_rng.draw_for(x, gen, m * f) if p > 0 else None,
        dropout_rng.draw_for(x, gen, m * h_out) if p_out > 0 else None,
    )
    w_up = w_in[1] if isinstance(w_in, tuple) else None
    b_up = b_in[1] if isinstance(b_in, tuple) else None
    w0, b0 = (w_in[0] if w_up is not None else w_in), (b_in[0] if isinstance(b_in, tuple) else b_in)
    rows = x.reshape(m, x.shape[-1])
    block = mlp_spec.MLPOperands(rows, w0, w_up, b0, b_up, w_out, b_out, activation, p, p_out)
    return mlp_spec.reference(block, rngs, upcast=upcast, keeps=keeps).view(*x.shape[:-1], h_out)


def _run(backend, args, activation, p, p_out, device):
    gen = torch.Generator(device=device).manual_seed(GEN_SEED)
    return fused_mlp(*args, activation, p, p_out, generator=gen, backend=backend)


@pytest.mark.parametrize(
    "backend, dtype, activation, layout, bias, p, p_out, shape",
    [c for b in backends() for c in _case_list(b)],
)
def test_matches_reference(backend, dtype, activation, layout, bias, p, p_out, shape, device):
    args = _inputs(dtype, activation, layout, bias, shape, device)
    x = args[0]
    call = Call(
        "fused_mlp", x.device, dtype, (math.prod(shape[:-2]), *shape[-2:]), activation, p + p_out > 0, True
    )
    require_call(backend, call)
    if torch_masks(backend) and p + p_out > 0:
        p, p_out = 0.0, 0.0  # its masks are torch's: test_torch_masks_drop_at_rate_p checks those
    leaves = [t for t in _flat(*args) if t is not None]
    grad_y = torch.randn(*shape[:-2], shape[-2] + 1, device=device).to(dtype)
    y = _run(backend, args, activation, p, p_out, device)
    got = [y, *grads(y, leaves, grad_y)]
    ref_y = _reference(args, activation, p, p_out, True, device)
    ref = [ref_y, *grads(ref_y, leaves, grad_y.double())]
    same_y = _reference(args, activation, p, p_out, False, device)
    same = [same_y, *grads(same_y, leaves, grad_y)]
    assert y.shape == (*shape[:-2], shape[-2] + 1) and y.dtype == dtype
    for i, (out, r, s) in enumerate(zip(got, ref, same)):
        check(f"output {i}", out.detach(), r.detach(), s.detach())


def test_eager_keeps_only_x_and_the_pre_activation(device):
    """What a forward keeps for backward, parameters aside: x and the first projection's output, never a
    mask or the hidden activation (masks and activation are regenerated in backward)."""
    args = _inputs(torch.float32, "swiglu", "stacked", True, (64, 16, 32), device)
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_mlp(*args, "swiglu", 0.3, 0.3, backend="eager")
    params = {id(t) for t in _flat(*args)[1:] if t is not None}
    shapes = sorted(tuple(t.shape) for t in kept if id(t) not in params)
    assert shapes == [(64, 16), (64, 64)], shapes  # x, pre = [gate; up]


@pytest.mark.parametrize("p, p_out", ((0.25, 0.0), (0.0, 0.25)))
def test_torch_masks_drop_at_rate_p(p, p_out, device):
    """The pytorch backend's masks are torch's: the output's drop rate is p_out within a binomial bound,
    and with p the hidden drop shows as a scaled-down mean only (a second mask cannot be read back)."""
    x = torch.randn(512, 32, device=device)
    w_in, w_out = torch.randn(64, 32, device=device) / 6, torch.randn(48, 64, device=device) / 8
    b_out = torch.rand(48, device=device) + 1.0  # nonzero outputs: every dropped one reads as 0
    y = fused_mlp(x, w_in, None, w_out, b_out, "relu", p, p_out, backend="pytorch")
    if p_out:
        rate, n = float((y == 0).float().mean()), y.numel()
        assert abs(rate - p_out) <= 6 * math.sqrt(p_out * (1 - p_out) / n), rate
    else:
        assert not (y == 0).any()


@pytest.mark.parametrize("backend", ("eager", "composed"))
def test_gradcheck_with_both_dropouts(backend, device):
    """Masks regenerated in backward (composed's by its sub-calls): the gradient is the derivative of the
    same masked function, and differentiable again."""
    args = [
        t.double() if t is not None else None
        for t in _inputs(torch.float64, "geglu", "stacked", True, (3, 4, 5), device)
    ]
    args = [t.detach().requires_grad_() for t in args]

    def op(*tensors):
        gen = torch.Generator(device=device).manual_seed(GEN_SEED)
        return fused_mlp(*tensors, "geglu", 0.4, 0.3, generator=gen, backend=backend)

    assert torch.autograd.gradcheck(op, tuple(args))
    assert torch.autograd.gradgradcheck(op, tuple(args))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(w_in=torch.randn(6, 4)), r"w_in must have shape \(hidden, 5\) to match x.s last dim"),
        (dict(w_out=torch.randn(5, 7)), r"w_out must have shape \(out_features, 6\)"),
        (dict(activation="swish"), r"activation must be one of identity, .*swiglu, geglu, geglu_tanh, reglu"),
        (dict(p_out=1.5), r"p_out must be a number in \[0, 1\], got 1.5"),
        (dict(b_in=torch.randn(5)), r"b_in must have shape \(6,\)"),
        (dict(activation="swiglu", w_in=torch.randn(7, 5)), r"w_in must stack \[gate; up\] for .swiglu."),
        (
            dict(w_in=(torch.randn(6, 5), torch.randn(6, 5))),
            r"w_in may be a \(gate, up\) pair only for a gated",
        ),
        # a bias pair with one half missing would drop that half's bias and gradient silently
        (dict(b_in=(None, torch.randn(6))), r"b_in as a \(gate, up\) pair must hold two tensors"),
        (
            dict(activation="swiglu", w_in=(torch.randn(6, 5),) * 2, b_in=(torch.randn(6), None)),
            r"b_in as a \(gate, up\) pair must hold two tensors",
        ),
        (
            dict(activation="swiglu", w_in=(torch.randn(6, 5),) * 2, b_in=torch.randn(12)),
            r"b_in must be a \(gate, up\) pair exactly when w_in is",
        ),
        (
            dict(activation="swiglu", w_in=torch.randn(12, 5), b_in=(torch.randn(6),) * 2),
            r"b_in must be a \(gate, up\) pair exactly when w_in is",
        ),
    ],
)
def test_bad_input_names_the_argument(change, message):
    args = dict(x=torch.randn(3, 5), w_in=torch.randn(6, 5), b_in=torch.randn(6), w_out=torch.randn(5, 6),
                b_out=None, activation="gelu", p=0.0, p_out=0.0)  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=message):
        fused_mlp(**args)


def test_explain_names_the_block():
    x = torch.randn(2, 3, 8)
    decision = explain("fused_mlp", x, torch.randn(32, 8), None, torch.randn(8, 16), None, "swiglu", 0.1)
    assert str(decision).startswith("fused_mlp(6x8x16, float32, swiglu, dropout, inference) on cpu")
    assert decision.backend.name == "pytorch"


def test_p_one_drops_everything(device):
    x, w_in, w_out = (
        torch.randn(4, 5, device=device),
        torch.randn(6, 5, device=device),
        torch.randn(5, 6, device=device),
    )
    for p, p_out in ((1.0, 0.0), (0.0, 1.0)):
        y = fused_mlp(x, w_in, None, w_out, None, "relu", p, p_out, backend="eager")
        assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize(
    "activation, layout", [("gelu", "stacked"), ("swiglu", "stacked"), ("swiglu", "pair")]
)
def test_pytorch_backend_is_the_composite_a_user_writes(activation, layout):
    """The pytorch backend's runner (its own fast path) and the module a user writes draw the same
    torch RNG in the same order: bit for bit the same output under one seed, forward and gradient."""
    x = torch.randn(2, 7, 8, requires_grad=True)
    gated = activation in GATES
    w_in, b_in = torch.randn(24 if gated else 12, 8), torch.randn(24 if gated else 12)
    w_out, b_out = torch.randn(8, 12), torch.randn(8)
    act = ACTIVATIONS[GATES.get(activation, activation)].forward

    def written(x):
        pre = F.linear(x, w_in, b_in)
        gate, up = pre.chunk(2, dim=-1) if gated else (pre, None)
        a = act(gate) if up is None else act(gate) * up
        return F.dropout(F.linear(F.dropout(a, 0.3), w_out, b_out), 0.2)

    w = (w_in[:12], w_in[12:]) if layout == "pair" else w_in
    b = (b_in[:12], b_in[12:]) if layout == "pair" else b_in
    torch.manual_seed(5)
    y = fused_mlp(x, w, b, w_out, b_out, activation, 0.3, 0.2, backend="pytorch")
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.manual_seed(5)
    want = written(x)
    (grad_want,) = torch.autograd.grad(want.sum(), x)
    if layout == "stacked":
        assert torch.equal(y, want) and torch.equal(grad, grad_want)
    else:  # a pair: two products concatenated, the same values to rounding
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(grad, grad_want)
