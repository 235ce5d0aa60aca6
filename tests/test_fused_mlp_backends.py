"""fused_mlp beyond its kernels: the composed backend (the other ops chained, its masks the reference's
whatever ``spec_masks()`` and ``use_backend()`` say), inductor's graphs reused across token counts, and
the op under torch.compile(fullgraph=True): the block's math unless a backend that takes the spec's
masks is requested, then one custom op running it, forward and backward against the float64 reference.
test_fused_mlp.py checks every backend's parity, composed's and inductor's included.
"""

from __future__ import annotations

import pytest
import torch

from dispatch import fused_mlp, use_backend
from dispatch.backends.inductor import compiler as inductor_compiler
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.tolerances import check
from dispatch.ops import fused_mlp as mlp_spec
from harness import grads

GEN_SEED = 20261205


def _tensors(m, h, f, dtype, gated, layout, bias, device):
    """x (..., H), then the weights and biases flat: w_in (w_up), b_in (b_up), w_out, b_out; None: no bias."""

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    rows, parts = (f, 2) if layout == "pair" else (2 * f if gated else f, 1)
    w_in = [rand(rows, h, scale=h**-0.5) for _ in range(parts)]
    b_in = [rand(rows, scale=0.5) if bias else None for _ in range(parts)]
    return [rand(*m, h), *w_in, *b_in, rand(h, f, scale=f**-0.5), rand(h, scale=0.5) if bias else None]


def _args(tensors, layout):
    """fused_mlp's (x, w_in, b_in, w_out, b_out) from ``_tensors``' flat list."""
    if layout != "pair":
        return tensors
    x, w_gate, w_up, b_gate, b_up, w_out, b_out = tensors
    return [x, (w_gate, w_up), None if b_gate is None else (b_gate, b_up), w_out, b_out]


def _reference(tensors, layout, activation, p, p_out, rngs, upcast):
    args = _args(tensors, layout)
    x, w_in, b_in, w_out, b_out = args
    pair = lambda t: t if isinstance(t, tuple) else (t, None)  # noqa: E731
    (w0, w_up), (b0, b_up) = pair(w_in), pair(b_in)
    rows = x.reshape(-1, x.shape[-1])
    block = mlp_spec.MLPOperands(rows, w0, w_up, b0, b_up, w_out, b_out, activation, p, p_out)
    return mlp_spec.reference(block, rngs, upcast=upcast).view(*x.shape[:-1], w_out.shape[0])


def _check_against_reference(name, y, tensors, layout, activation, p, p_out, rngs, grad_y):
    leaves = [t for t in tensors if t is not None and t.requires_grad]
    got = [y, *grads(y, leaves, grad_y)]
    ref_y = _reference(tensors, layout, activation, p, p_out, rngs, upcast=True)
    same_y = _reference(tensors, layout, activation, p, p_out, rngs, upcast=False)
    ref, same = [ref_y, *grads(ref_y, leaves, grad_y)], [same_y, *grads(same_y, leaves, grad_y)]
    for i, (out, r, s) in enumerate(zip(got, ref, same)):
        check(f"{name} output {i}", out.detach(), r.detach(), s.detach())


# ----------------------------------------------------------------------------- composed


def test_composed_masks_are_the_references(device):
    """Identity activation and W_out = I: y is zero exactly where the hidden or the output mask drops,
    and those are the masks the reference draws from the generator (hidden, then output), although no
    spec_masks() is on (bias_act_dropout's first able backend, pytorch, would draw torch's) and
    use_backend() names another backend or composed itself (the sub-calls go by the table)."""
    m, h, f, p, p_out = 37, 16, 24, 0.3, 0.25
    x = torch.randn(m, h, device=device)
    w_in, b_in = torch.randn(f, h, device=device), torch.randn(f, device=device)
    w_out = torch.eye(f, device=device)
    gen = torch.Generator(device=device).manual_seed(GEN_SEED)
    keep_h = dropout_rng.keep_mask(dropout_rng.draw_for(x, gen, m * f), m, f, p, x.device)
    keep_o = dropout_rng.keep_mask(dropout_rng.draw_for(x, gen, m * f), m, f, p_out, x.device)

    def run():
        g = torch.Generator(device=device).manual_seed(GEN_SEED)
        return fused_mlp(x, w_in, b_in, w_out, None, "identity", p, p_out, generator=g, backend="composed")

    y = run()
    assert torch.equal(y != 0, keep_h & keep_o)
    scale = dropout_rng.keep_scale(p) * dropout_rng.keep_scale(p_out)
    torch.testing.assert_close(y, (x @ w_in.T + b_in) * keep_h * keep_o * scale)
    with use_backend("pytorch"):
        assert torch.equal(run(), y)
    with use_backend("composed"):
        assert torch.equal(run(), y)
        g = torch.Generator(device=device).manual_seed(GEN_SEED)
        assert torch.equal(fused_mlp(x, w_in, b_in, w_out, None, "identity", p, p_out, generator=g), y)


def test_composed_gate_stacked_equals_paired(device):
    """A stacked [gate; up] weight runs as its row halves: the pair's calls, the same bits."""
    tensors = _tensors((3, 5), 16, 12, torch.float32, True, "stacked", True, device)
    x, w_in, b_in, w_out, b_out = tensors
    stacked = fused_mlp(x, w_in, b_in, w_out, b_out, "swiglu", backend="composed")
    pair = fused_mlp(
        x, (w_in[:12], w_in[12:]), (b_in[:12], b_in[12:]), w_out, b_out, "swiglu", backend="composed"
    )
    assert torch.equal(stacked, pair)


# ----------------------------------------------------------------------------- inductor


def test_inductor_fused_mlp_reuses_its_graphs_for_new_token_counts(device):
    """Compiled for M = 33 (x, grad_y and pre dynamic in dim 0), then M = 18 runs the same graphs."""
    compiles = None
    for m in ((33,), (2, 9)):
        tensors = _tensors(m, 16, 12, torch.float32, True, "stacked", True, device)
        y = fused_mlp(*tensors, "swiglu", backend="inductor")
        grad_y = torch.randn_like(y)
        _check_against_reference("inductor", y, tensors, "stacked", "swiglu", 0.0, 0.0, (None, None), grad_y)
        if compiles is None:
            compiles = inductor_compiler.cache_info().compiles
    assert inductor_compiler.cache_info().compiles == compiles


# ----------------------------------------------------------------------------- torch.compile


def _custom_ops(fn, *args) -> list[str]:
    """The fusedispatch custom ops in the graph dynamo captures for ``fn(*args)`` (no inductor)."""
    found: list[str] = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        found.extend(str(n.target) for n in gm.graph.nodes if "fusedispatch" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    torch._dynamo.reset()
    return found


def _op(layout, activation, p, p_out, **kwargs):
    return lambda *tensors: fused_mlp(*_args(list(tensors), layout), activation, p, p_out, **kwargs)


@pytest.mark.parametrize(
    "activation, layout, bias, p, p_out, x_grad",
    [("gelu", "stacked", True, 0.3, 0.2, True), ("swiglu", "pair", False, 0.2, 0.0, False)],
)
def test_compiled_custom_op_forward_and_backward(activation, layout, bias, p, p_out, x_grad, device):
    """A backend requested: the block is one custom op whose graph draws both rngs (aten randint, so
    with fallback_random the draws eager mode makes after the same seed: the reference's masks) and
    runs the backend forward, then its backward (regenerating both masks) for the gradients asked."""
    tensors = _tensors((2, 5), 16, 12, torch.float32, activation == "swiglu", layout, bias, device)
    tensors[0].requires_grad_(x_grad)
    op = _op(layout, activation, p, p_out, backend="eager")
    assert _custom_ops(op, *tensors) == ["fusedispatch.fused_mlp.default"]
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(op, fullgraph=True)
        torch.manual_seed(GEN_SEED)
        y = compiled(*tensors)
    torch.manual_seed(GEN_SEED)
    rngs = tuple(dropout_rng.draw(torch.device(device)) if q > 0 else None for q in (p, p_out))
    grad_y = torch.randn_like(y)
    _check_against_reference("custom op", y, tensors, layout, activation, p, p_out, rngs, grad_y)


def test_compiled_math_unless_a_backend_taking_spec_masks_is_requested(device):
    """No backend, pytorch (torch's RNG) or composed (ops it chains): the block traces as math, which
    inductor compiles to the reference's values; eager by use_backend(): the custom op."""
    tensors = _tensors((7,), 16, 12, torch.float32, False, "stacked", True, device)
    for kwargs in ({}, {"backend": "pytorch"}, {"backend": "composed"}):
        assert _custom_ops(_op("stacked", "gelu_tanh", 0.0, 0.0, **kwargs), *tensors) == [], kwargs
    with use_backend("eager"):
        assert _custom_ops(_op("stacked", "gelu_tanh", 0.0, 0.0), *tensors) == [
            "fusedispatch.fused_mlp.default"
        ]
    y = torch.compile(_op("stacked", "gelu_tanh", 0.0, 0.0), fullgraph=True)(*tensors)
    grad_y = torch.randn_like(y)
    _check_against_reference("math", y, tensors, "stacked", "gelu_tanh", 0.0, 0.0, (None, None), grad_y)
