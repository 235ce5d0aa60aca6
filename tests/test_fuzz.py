"""Hypothesis fuzz of both ops on the eager backend against the float64 reference: random shapes
(zero-sized dims included), strides (transposed, sliced, expanded), dtypes, activations, p, and which
inputs need gradients. (Other backends get the registry-driven parity tests: fuzzing them would compile
a kernel per drawn shape.)"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch.ops import bias_act_dropout as bad_spec
from dispatch.ops import fused_linear as linear_spec
from dispatch import ACTIVATION_NAMES, fused_bias_act_dropout, fused_linear
from dispatch.contracts import rng as dropout_rng
from harness import BIAS_ACT_DROPOUT_GRADS, FUSED_LINEAR_GRADS, check_detached, grads as leaf_grads

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded")
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _leaf_and_layout(draw, shape: tuple[int, ...], device: str):
    """A random leaf tensor and a function viewing it as ``shape`` with the drawn layout."""
    layout = draw(st.sampled_from(LAYOUTS if len(shape) >= 2 else ("contiguous", "sliced", "expanded")))
    if layout == "transposed":
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return torch.randn(swapped, device=device), lambda t: t.transpose(-1, -2)
    if layout == "sliced":
        return torch.randn(*shape[:-1], 2 * shape[-1], device=device), lambda t: t[..., ::2]
    if layout == "expanded":
        return torch.randn(1, *shape[1:], device=device), lambda t: t.expand(shape)
    return torch.randn(shape, device=device), lambda t: t


def _leaves(raw, dtype, needs):
    """The tested leaves in ``dtype``, their float64 twins, and plain-PyTorch twins in ``dtype``."""
    tested = [t.to(dtype).requires_grad_(need) for t, need in zip(raw, needs)]
    exact = [t.detach().double().requires_grad_(need) for t, need in zip(tested, needs)]
    plain = [t.detach().clone().requires_grad_(need) for t, need in zip(tested, needs)]
    return tested, exact, plain


@FUZZ
@given(data=st.data())
def test_fuzz_bias_act_dropout(data, device):
    draw = data.draw
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=2))) + (draw(st.integers(1, 40)),)
    dtype, activation = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(ACTIVATION_NAMES))
    p = draw(st.sampled_from((0.0, 0.1, 0.5, 0.9)) | st.floats(0.0, 0.99))
    training, with_bias = draw(st.booleans()), draw(st.booleans())
    needs = (draw(st.booleans()), with_bias and draw(st.booleans()))
    x_raw, x_view = _leaf_and_layout(draw, shape, device)
    b_raw = torch.randn(2 * shape[-1], device=device)
    b_view = (lambda t: t[::2]) if draw(st.booleans()) else (lambda t: t[: shape[-1]])
    tested, exact, plain = _leaves((x_raw, b_raw), dtype, needs)
    seed = draw(st.integers(0, 2**31))

    def run(leaves, upcast):
        """(output, gradients) of the op (upcast None) or of the reference."""
        x, bias = x_view(leaves[0]), b_view(leaves[1]) if with_bias else None
        if upcast is None:
            gen = torch.Generator(device=device).manual_seed(seed)
            y = fused_bias_act_dropout(x, bias, activation, p, training, generator=gen, backend="eager")
        else:
            dropout = training and p > 0
            rng = (
                dropout_rng.draw_for(x, torch.Generator(device=device).manual_seed(seed))
                if dropout
                else None
            )
            y = bad_spec.reference(x, bias, activation, p if dropout else 0.0, rng, upcast=upcast)
        # gradients with respect to the op's own (strided) inputs, not the leaves they view: a leaf
        # behind an expanded view would add autograd's low-precision sum over the expanded dimension
        return y, leaf_grads(y, (x, bias), grad_y)

    grad_y = torch.randn(shape, device=device)
    (y, grads), (ref, ref_grads), (base, base_grads) = run(tested, None), run(exact, True), run(plain, False)
    assert y.shape == shape and y.dtype == dtype
    check_detached("y", y, ref, base)
    for name, g, r, b in zip(BIAS_ACT_DROPOUT_GRADS, grads, ref_grads, base_grads):
        if g is not None:
            check_detached(name, g, r, b)


@FUZZ
@given(data=st.data())
def test_fuzz_fused_linear(data, device):
    draw = data.draw
    lead = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=2)))
    k, n = draw(st.integers(0, 24)), draw(st.integers(0, 24))
    dtype, activation = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(ACTIVATION_NAMES))
    with_bias = draw(st.booleans())
    needs = (draw(st.booleans()), draw(st.booleans()), with_bias and draw(st.booleans()))
    x_raw, x_view = _leaf_and_layout(draw, (*lead, k), device)
    w_raw, w_view = _leaf_and_layout(draw, (n, k), device)
    w_raw = w_raw / math.sqrt(max(k, 1))
    tested, exact, plain = _leaves((x_raw, w_raw, torch.randn(n, device=device)), dtype, needs)

    def run(leaves, upcast):
        """(output, gradients) of the op (upcast None) or of the reference."""
        x, w, bias = x_view(leaves[0]), w_view(leaves[1]), leaves[2] if with_bias else None
        if upcast is None:
            y = fused_linear(x, w, bias, activation, backend="eager")
        else:
            y = linear_spec.reference(x, w, bias, activation, upcast=upcast)
        return y, leaf_grads(y, (x, w, bias), grad_y)

    grad_y = torch.randn(*lead, n, device=device)
    (y, grads), (ref, ref_grads), (base, base_grads) = run(tested, None), run(exact, True), run(plain, False)
    assert y.shape == (*lead, n) and y.dtype == dtype
    check_detached("y", y, ref, base)
    for name, g, r, b in zip(FUSED_LINEAR_GRADS, grads, ref_grads, base_grads):
        if g is not None:
            check_detached(name, g, r, b)
