"""fused_linear on every registered backend against the float64 reference: outputs and gradients.

Cases come from the registry; a backend that cannot serve one skips it with its own reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dispatch import ACTIVATION_NAMES, fused_linear
from dispatch.registry import backends
from dispatch.select import clear_cache
from dispatch.contracts.activations import ACTIVATIONS
from dispatch.contracts.tolerances import check
from harness import (
    COMPILING,
    DTYPES,
    FUSED_LINEAR_GRADS,
    cpu_budget,
    each_backend,
    fused_linear_call,
    fused_linear_inputs,
    reference_fused_linear,
    require_call,
    run_fused_linear,
)

# x's shape (..., K) and out_features N
SMALL_SHAPES = (((7,), 5), ((1, 1), 1), ((3, 5, 24), 17))
BIG_SHAPE = ((1823, 781), 129)


def _id(backend: str, dtype: torch.dtype, activation: str, shape: tuple) -> str:
    (x_shape, n) = shape
    return f"{backend}-{str(dtype)[6:]}-{activation}-{'x'.join(map(str, x_shape))}-n{n}"


def grid(backend: str) -> list:
    """(dtype, activation, shape) cases for ``backend``, bounded by what each case costs on CPU.

    Eager: the full product on the small shapes; on the big one every activation in float32 and
    identity/gelu in the half dtypes (a half matmul of that size costs ~0.3 s on CPU, and the
    activations are elementwise). Other backends, which compile or interpret every variant: each
    activation once in float32, each dtype once with gelu, and the big shape on the GPU; backends that
    compile (COMPILING) run only the first two of these cases on CPU.
    """
    if backend == "eager":
        cases = [(d, a, s) for d in DTYPES for a in ACTIVATION_NAMES for s in SMALL_SHAPES]
        cases += [(torch.float32, a, BIG_SHAPE) for a in ACTIVATION_NAMES]
        cases += [(d, a, BIG_SHAPE) for d in DTYPES[1:] for a in ("identity", "gelu")]
        return [pytest.param(*c, id=_id(backend, *c)) for c in cases]
    f32, bf16, f16 = DTYPES
    cases = [(f32, "gelu", SMALL_SHAPES[2]), (bf16, "identity", SMALL_SHAPES[0])]
    cases += [(f32, a, SMALL_SHAPES[2]) for a in ACTIVATION_NAMES if a != "gelu"]
    cases += [(bf16, "gelu", SMALL_SHAPES[0]), (f16, "gelu", SMALL_SHAPES[0]), (f32, "relu", SMALL_SHAPES[1])]
    params = [
        pytest.param(*c, id=_id(backend, *c), marks=cpu_budget(backend, i < 2)) for i, c in enumerate(cases)
    ]
    params += [
        pytest.param(d, a, BIG_SHAPE, marks=pytest.mark.gpu, id=_id(backend, d, a, BIG_SHAPE))
        for d in DTYPES
        for a in ("identity", "gelu")
    ]
    return params


def require(backend: str, x: torch.Tensor, n: int, activation: str, training: bool = True) -> None:
    """Skips with the backend's own reasons when it cannot serve this call."""
    require_call(backend, fused_linear_call(x, n, activation, training))


def assert_parity(backend: str, x, weight, bias, activation: str, grad_y) -> None:
    y, grads = run_fused_linear(backend, x, weight, bias, activation, grad_y)
    ref, ref_grads = reference_fused_linear(x, weight, bias, activation, grad_y, upcast=True)
    if backend == "eager":  # plain PyTorch in the same dtype sets the bar for the reference backend itself
        base, base_grads = reference_fused_linear(x, weight, bias, activation, grad_y, upcast=False)
    else:
        base, base_grads = run_fused_linear("eager", x, weight, bias, activation, grad_y)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], weight.shape[0])
    check("y", y.detach(), ref.detach(), base.detach())
    for name, g, r, b, t in zip(FUSED_LINEAR_GRADS, grads, ref_grads, base_grads, (x, weight, bias)):
        if t is not None and t.requires_grad:
            assert g.dtype == t.dtype, f"{name} has dtype {g.dtype}, input has {t.dtype}"
            check(name, g, r, b)


@pytest.mark.parametrize("backend, dtype, activation, shape", each_backend(grid))
def test_matches_reference(backend, dtype, activation, shape, device):
    x_shape, n = shape
    x, weight, bias = fused_linear_inputs(x_shape, n, dtype, device)
    require(backend, x, n, activation)
    grad_y = torch.randn(*x_shape[:-1], n, device=device).to(dtype)
    assert_parity(backend, x, weight, bias, activation, grad_y)


SUBSETS = {  # which inputs require grad: (x, weight, bias); None = no bias
    "all": (True, True, True),
    "x-only": (True, False, False),
    "weight-only": (False, True, False),
    "bias-only": (False, False, True),
    "no-bias": (True, True, None),
    "inference": (False, False, False),
}


def _subset_cases() -> list:
    """Every subset with identity and gelu; a compiling backend runs gelu only, and on CPU only "all"
    (the first grid case: no new compile)."""
    return [
        pytest.param(b, a, s, marks=cpu_budget(b, a == "gelu" and s == "all"), id=f"{b}-{a}-{s}")
        for b in backends()
        for a in ("identity", "gelu")
        for s in SUBSETS
        if a == "gelu" or b not in COMPILING
    ]


@pytest.mark.parametrize("backend, activation, subset", _subset_cases())
def test_gradient_subsets(backend, activation, subset, device):
    needs = SUBSETS[subset]
    x, weight, bias = fused_linear_inputs((3, 5, 24), 17, torch.float32, device, needs)
    require(backend, x, 17, activation, training=any(needs))
    assert_parity(backend, x, weight, bias, activation, torch.randn(3, 5, 17, device=device))


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_eager_training_path(activation, dtype, device, monkeypatch):
    """Eager calls with autograd run under torch's own autograd where the activation has PyTorch kernels
    both ways (no Python Function node in the graph), through KernelsFunction otherwise; the two paths
    give the same outputs and gradients within the dtype's tolerance."""
    x, weight, bias = fused_linear_inputs((37, 24), 19, dtype, device)
    grad_y = torch.randn(37, 19, device=device)
    y, grads = run_fused_linear("eager", x, weight, bias, activation, grad_y)
    act = ACTIVATIONS[activation]
    native = act.native and act.backward is not None
    assert ("KernelsFunctionBackward" != type(y.grad_fn).__name__) == native, type(y.grad_fn).__name__
    eager = backends()["eager"]
    kernels = dataclasses.replace(eager.kernels["fused_linear"], autograd=lambda activation: False)
    monkeypatch.setitem(eager.kernels, "fused_linear", kernels)
    clear_cache()  # the path is resolved once per decision
    try:
        y_fn, grads_fn = run_fused_linear("eager", x, weight, bias, activation, grad_y)
    finally:
        monkeypatch.undo()
        clear_cache()
    assert type(y_fn.grad_fn).__name__ == "KernelsFunctionBackward"
    ref, ref_grads = reference_fused_linear(x, weight, bias, activation, grad_y, upcast=True)
    check("y", y.detach(), ref.detach(), y_fn.detach())
    for name, g, r, b in zip(FUSED_LINEAR_GRADS, grads, ref_grads, grads_fn):
        check(name, g, r, b)


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_gradcheck(activation, device):
    x = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)

    def op(x, weight, bias):
        return fused_linear(x, weight, bias, activation, backend="eager")

    assert torch.autograd.gradcheck(op, (x, weight, bias))


@pytest.mark.parametrize("backend", ("eager", "triton", "cublaslt"))
def test_relu_keeps_no_tensor_beside_its_output(backend, device):
    """relu's backward needs only where y > 0: a training call keeps x, W, b and y itself, as PyTorch's
    relu(F.linear(...)) does, no M x N pre-activation of its own (one fewer activation-sized tensor a
    layer)."""
    x, weight, bias = fused_linear_inputs((37, 24), 19, torch.float32, device)
    require(backend, x, 19, "relu")
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused_linear(x, weight, bias, "relu", backend=backend)
    big = [t for t in kept if t.numel() == y.numel()]
    assert big and all(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in big), [
        (tuple(t.shape), t.data_ptr() == y.data_ptr()) for t in kept
    ]
    grad_y = torch.randn_like(y)
    ref, ref_grads = reference_fused_linear(x, weight, bias, "relu", grad_y, upcast=True)
    check("y", y.detach(), ref.detach(), ref.detach().to(y.dtype))
    grads = torch.autograd.grad(y, (x, weight, bias), grad_y)
    for name, got, r, t in zip(FUSED_LINEAR_GRADS, grads, ref_grads, (x, weight, bias)):
        check(name, got, r, r.to(t.dtype))


@pytest.mark.parametrize("backend", ("eager", "triton"))
@pytest.mark.parametrize("activation", ("relu", "leaky_relu", "gelu_tanh"))
def test_output_modified_in_place_before_backward_as_in_pytorch(backend, activation, device):
    """What autograd allows on the output is what it allows on act(F.linear(...)): relu keeps its output
    (torch.relu does), so modifying it in place before backward is refused; the others keep their input,
    so the output may change in place and the gradients are those of the changed expression."""
    x, weight, bias = fused_linear_inputs((9, 24), 17, torch.float32, device)
    require(backend, x, 17, activation)
    y = fused_linear(x, weight, bias, activation, backend=backend)
    y.mul_(2.0)
    grad_y = torch.randn_like(y)
    if activation == "relu":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y, (x, weight, bias), grad_y)
        return
    got = torch.autograd.grad(y, (x, weight, bias), grad_y)
    ref, ref_grads = reference_fused_linear(x, weight, bias, activation, 2.0 * grad_y, upcast=True)
    for name, g, r in zip(FUSED_LINEAR_GRADS, got, ref_grads):
        check(name, g, r, r.to(g.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("eager", "triton", "cublaslt"))
@pytest.mark.parametrize("activation", ("relu", "leaky_relu", "gelu_tanh"))
def test_nan_and_inf_rows_on_the_gpu_match_pytorch(backend, activation):
    """On CUDA (cuBLASLt's epilogues, Triton's compiled kernels): a NaN or infinite x reaches its whole
    row of y and of grad_x as in PyTorch's act(F.linear(x, W, b)); relu(NaN) is NaN there."""
    x, weight, bias = fused_linear_inputs((64, 32), 48, torch.bfloat16, "cuda")
    require(backend, x, 48, activation)
    with torch.no_grad():
        x[3, 5], x[9, 0], x[20, 7] = float("nan"), float("inf"), -float("inf")
    g = torch.randn(64, 48, device="cuda").to(torch.bfloat16)
    got = fused_linear(x, weight, bias, activation, backend=backend)
    got_grads = torch.autograd.grad(got, (x, weight, bias), g)
    # PyTorch's act(F.linear(...)) in x's dtype: the reference without upcast
    want, want_grads = reference_fused_linear(x, weight, bias, activation, g, upcast=False)
    for name, a, b in zip(("y", *FUSED_LINEAR_GRADS), (got, *got_grads), (want, *want_grads)):
        for kind in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(kind(a), kind(b)), f"{backend} {name}: {kind.__name__} differs"
        finite = torch.isfinite(b)
        torch.testing.assert_close(a[finite].float(), b[finite].float(), atol=0.1, rtol=0.05)
