"""Triton fused_linear against the float64 reference: outputs and every gradient, at odd, empty,
non-contiguous and stride-0 shapes, deterministic. The Triton matmul's variants and configs:
test_triton_matmul.py.

On CPU the kernels run under Triton's interpreter with 32x16x16 tiles, so the tiny shapes here
still cross tile, group and K-block edges; ``gpu``-marked tests use real sizes and the H200 tiles.

Calls with autograd (``run_api``) run torch.mm and bias_act_dropout's kernels; only calls without it
(``infer``) run the Triton matmul (``matmul.py``), so tests of the matmul check y without autograd
(``assert_infer_matches``), and each asserts through ``launches`` that the matmul ran.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from dispatch.ops.fused_linear import reference
from dispatch.backends.triton import fused_linear as triton_op
from dispatch import ACTIVATION_NAMES, fused_linear
from dispatch.contracts.tolerances import check
from matmul_checks import assert_infer_matches, check_y, linear_inputs

triton_backend = pytest.importorskip("dispatch.backends.triton").BACKEND
if triton_backend.unavailable():
    pytest.skip(triton_backend.unavailable(), allow_module_level=True)

NAMES = ("grad_x", "grad_weight", "grad_bias")
ODD = ((1, 1, 1), (7, 5, 3), (33, 17, 40))  # (M, N, K)


def _grads(y, leaves, grad_y) -> list[Optional[torch.Tensor]]:
    inputs = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad(y, inputs, grad_y) if inputs else ())
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]


def _reference(x, weight, bias, activation, grad_y, needs, upcast):
    leaves = [
        None if t is None else t.detach().requires_grad_(need) for t, need in zip((x, weight, bias), needs)
    ]
    y = reference(*leaves, activation, upcast=upcast)
    return y.detach(), _grads(y, leaves, grad_y.to(y.dtype))


def assert_matches(y, grads, x, weight, bias, activation, grad_y, needs=(True, True, True)):
    """y and grads (x, weight, bias order; None where not needed) vs the float64 reference, with the
    tolerance set by eager PyTorch in the same dtype."""
    ref, ref_grads = _reference(x, weight, bias, activation, grad_y, needs, upcast=True)
    base, base_grads = _reference(x, weight, bias, activation, grad_y, needs, upcast=False)
    assert y.dtype == x.dtype and y.shape == ref.shape
    check("y", y, ref, base)
    for name, g, r, b, t, need in zip(NAMES, grads, ref_grads, base_grads, (x, weight, bias), needs):
        if need and t is not None:
            assert g is not None and g.dtype == t.dtype, f"{name}: {None if g is None else g.dtype}"
            check(name, g, r, b)
        else:
            assert g is None, f"{name} was not needed but was computed"


def run_api(x, weight, bias, activation, grad_y):
    leaves = [None if t is None else t.detach().requires_grad_() for t in (x, weight, bias)]
    y = fused_linear(*leaves, activation, backend="triton")
    return y.detach(), _grads(y, leaves, grad_y)


# ----------------------------------------------------------------------------- CPU (interpreter) and GPU


@pytest.mark.parametrize("mnk", ODD, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_every_activation_float32(activation, mnk, device, launches):
    """y and gradients with autograd; y without (the Triton matmul) at the shapes inside one tile:
    its epilogue is elementwise, so each activation needs one launch, and the tests below cover the
    tile, group and K edges of 33 x 17 x 40 (a 4-program launch, the interpreter's dearest here)."""
    M, N, K = mnk
    x, weight, bias = linear_inputs((M, K), N, torch.float32, device)
    grad_y = torch.randn(M, N, device=device)
    if mnk != ODD[-1]:
        assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_half_dtypes(dtype, activation, device, launches):
    x, weight, bias = linear_inputs((33, 40), 17, dtype, device)
    grad_y = torch.randn(33, 17, device=device).to(dtype)
    if activation == "silu":  # one matmul launch per dtype: its epilogue computes in float32 in either
        assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.parametrize(
    "needs", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)]
)
def test_only_needed_gradients(needs, device):
    x, weight, bias = linear_inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(33, 17, device=device)
    y, pre = triton_op.forward(x, weight, bias, "relu")
    grads = triton_op.backward(grad_y, x, weight, bias, pre, "relu", needs)
    assert_matches(y, list(grads), x, weight, bias, "relu", grad_y, needs)


@pytest.mark.parametrize("activation", ("identity", "gelu"))
def test_no_bias(activation, device, launches):
    x, weight, _ = linear_inputs((33, 40), 17, torch.float32, device, bias=False)
    grad_y = torch.randn(33, 17, device=device)
    if activation == "gelu":  # the matmul without a bias: one launch covers it
        assert_infer_matches(launches, x, weight, None, activation)
    assert_matches(
        *run_api(x, weight, None, activation, grad_y),
        x,
        weight,
        None,
        activation,
        grad_y,
        (True, True, False),
    )


def test_three_dim_x(device, launches):
    x, weight, bias = linear_inputs((2, 5, 24), 17, torch.float32, device)
    grad_y = torch.randn(2, 5, 17, device=device)
    assert_infer_matches(launches, x, weight, bias, "gelu_tanh")
    assert_matches(*run_api(x, weight, bias, "gelu_tanh", grad_y), x, weight, bias, "gelu_tanh", grad_y)


@pytest.mark.parametrize("layout", ("column-major", "sliced"))
def test_non_contiguous_inputs(layout, device, launches):
    if layout == "column-major":  # x and W stored transposed
        x = torch.randn(40, 33, device=device).t()
        weight = (torch.randn(40, 17, device=device) / 7).t()
    else:  # every other column of wider tensors
        x = torch.randn(33, 80, device=device)[:, ::2]
        weight = (torch.randn(17, 81, device=device) / 7)[:, 1::2]
    bias = torch.randn(17, device=device)
    grad_y = torch.randn(17, 33, device=device).t()
    assert not x.is_contiguous() and not weight.is_contiguous()
    assert_infer_matches(launches, x, weight, bias, "silu")
    assert_matches(*run_api(x, weight, bias, "silu", grad_y), x, weight, bias, "silu", grad_y)


@pytest.mark.parametrize("activation", ("identity", "gelu"))
def test_stride_zero_grad(activation, device):
    x, weight, bias = linear_inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(1, 17, device=device).expand(33, 17)  # e.g. the gradient of y.sum(0)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


def test_empty_rows(device):
    x, weight, bias = linear_inputs((0, 8), 5, torch.float32, device)
    y, saved = triton_op.forward(x, weight, bias, "gelu")
    assert y.shape == (0, 5) and saved.shape == (0, 5)
    grad_x, grad_w, grad_b = triton_op.backward(y, x, weight, bias, saved, "gelu", (True, True, True))
    assert grad_x.shape == (0, 8)
    assert torch.equal(grad_w, torch.zeros_like(weight)) and torch.equal(grad_b, torch.zeros_like(bias))


def test_empty_reduction(device, launches):
    """K == 0: y = act(b), and the gradients of b still flow. Called directly: the public call sends
    empty inputs to the reference, not to a backend."""
    x, weight, bias = linear_inputs((5, 0), 3, torch.float32, device)
    grad_y = torch.randn(5, 3, device=device)
    y = triton_op.infer(x, weight, bias, "gelu")
    assert len(launches) == 1
    check_y("y (infer)", y, x, weight, bias, "gelu")
    y, saved = triton_op.forward(x, weight, bias, "gelu")
    grads = triton_op.backward(grad_y, x, weight, bias, saved, "gelu", (True, True, True))
    assert_matches(y, list(grads), x, weight, bias, "gelu", grad_y)


def test_deterministic(device):
    x, weight, bias = linear_inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(33, 17, device=device)
    first = run_api(x, weight, bias, "gelu", grad_y)
    second = run_api(x, weight, bias, "gelu", grad_y)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ("identity", "relu", "gelu", "gelu_tanh", "silu"))
def test_realistic_bf16(activation, launches):
    x, weight, bias = linear_inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    grad_y = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


ODD_GPU = [(torch.bfloat16, a) for a in ("leaky_relu", "squared_relu", "gelu")]  # + test_realistic_bf16's
ODD_GPU += [(d, a) for d in (torch.float16, torch.float32) for a in ("identity", "gelu_tanh")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, activation", ODD_GPU, ids=lambda v: str(v).removeprefix("torch."))
def test_odd_shape_gpu(dtype, activation, launches):
    x, weight, bias = linear_inputs((1823, 341), 781, dtype, "cuda")
    grad_y = torch.randn(1823, 781, device="cuda").to(dtype)
    assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.gpu
def test_long_reduction(launches):
    x, weight, bias = linear_inputs((256, 28672), 512, torch.bfloat16, "cuda")
    grad_y = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    assert_infer_matches(launches, x, weight, bias, "gelu")
    assert_matches(*run_api(x, weight, bias, "gelu", grad_y), x, weight, bias, "gelu", grad_y)


@pytest.mark.gpu
def test_tf32_when_allowed(launches):
    x, weight, bias = linear_inputs((1024, 2048), 1536, torch.float32, "cuda")
    grad_y = torch.randn(1024, 1536, device="cuda")
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # eager uses TF32 too: the tolerance follows it
    try:
        with torch.no_grad():
            y_infer = fused_linear(x, weight, bias, "gelu", backend="triton")  # the Triton matmul, "tf32"
        assert len(launches) == 1
        y, grads = run_api(x, weight, bias, "gelu", grad_y)
        needs = (True, True, True)
        ref, ref_grads = _reference(x, weight, bias, "gelu", grad_y, needs, upcast=True)
        base, base_grads = _reference(x, weight, bias, "gelu", grad_y, needs, upcast=False)
        # TF32 rounds each operand to 10 mantissa bits and the two libraries accumulate in different
        # orders, so max-abs errors scatter; compare relative Frobenius errors (~3e-4 expected)
        names, outs = ("y (infer)", "y", *NAMES), (y_infer, y, *grads)
        for name, out, r, b in zip(names, outs, (ref, ref, *ref_grads), (base, base, *base_grads)):
            rel = float((out.double() - r).norm() / r.norm())
            rel_eager = float((b.double() - r).norm() / r.norm())
            assert rel <= max(2 * rel_eager, 1e-3), f"{name}: relative error {rel:.2e} (eager {rel_eager:.2e})"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
def test_deterministic_gpu():
    x, weight, bias = linear_inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    grad_y = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    _, pre = triton_op.forward(x, weight, bias, "gelu")
    first = triton_op.backward(grad_y, x, weight, bias, pre, "gelu", (True, True, True))
    for _ in range(3):
        again = triton_op.backward(grad_y, x, weight, bias, pre, "gelu", (True, True, True))
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_64_bit_offsets(launches):
    """y with 2**31 elements: offsets past int32 must not wrap (checked on the last rows), in infer's
    matmul epilogue and in forward's bias + activation pass."""
    x, weight, bias = linear_inputs((65536, 64), 32768, torch.bfloat16, "cuda")
    tail = slice(-3, None)
    y = triton_op.infer(x, weight, bias, "gelu")
    assert len(launches) == 1
    check_y("infer y[-3:]", y[tail], x[tail], weight, bias, "gelu")
    del y
    y, _ = triton_op.forward(x, weight, bias, "gelu")
    check_y("forward y[-3:]", y[tail], x[tail], weight, bias, "gelu")
