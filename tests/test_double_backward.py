"""Double backward: with ``create_graph=True`` the first-order gradients carry a graph, and their own
gradients (a gradient penalty's second-order terms) are right, on every backend.

Eager runs ``gradgradcheck`` in float64 (numerical against analytical second derivatives) for every
activation, with and without bias, dropout included: a fixed seed fixes the mask, which the backward
rebuilds from the forward's rng. The other backends (float32: what triton, nvfuser and inductor serve on
CPU) must give the eager backend's first- and second-order gradients. nvfuser and inductor compile once
per kind of call (seconds each on a small CPU), so they get one activation each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dispatch import ACTIVATION_NAMES, fused_bias_act_dropout, fused_linear
from dispatch import ops
from dispatch.registry import backends
from dispatch.select import clear_cache
from harness import require_call

M, N, K = 5, 7, 4  # bias_act_dropout: x (M, N); fused_linear: x (M, K), weight (3, K)
N_LINEAR = 3
SEED = 20240611  # the dropout mask's generator, drawn anew (same seed) by every call of the op


def _leaf(*shape, dtype=torch.float64, device="cpu"):
    return torch.randn(shape, dtype=dtype, device=device, requires_grad=True)


def _dropout_op(activation, p, backend="eager", with_bias=True):
    def op(x, *bias):
        gen = torch.Generator(x.device).manual_seed(SEED)  # the same mask on every call
        return fused_bias_act_dropout(
            x, bias[0] if with_bias else None, activation, p, generator=gen, backend=backend
        )

    return op


def _linear_op(activation, backend="eager", with_bias=True):
    def op(x, weight, *bias):
        return fused_linear(x, weight, bias[0] if with_bias else None, activation, backend=backend)

    return op


# ----------------------------------------------------------------------------- eager: gradgradcheck


@pytest.mark.parametrize("p", (0.0, 0.4))
@pytest.mark.parametrize("with_bias", (True, False), ids=("bias", "no-bias"))
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_bias_act_dropout_gradgradcheck(activation, with_bias, p):
    inputs = (_leaf(M, N),) + ((_leaf(N),) if with_bias else ())
    op = _dropout_op(activation, p, with_bias=with_bias)
    assert torch.autograd.gradcheck(op, inputs)
    assert torch.autograd.gradgradcheck(op, inputs)


@pytest.mark.parametrize("with_bias", (True, False), ids=("bias", "no-bias"))
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_fused_linear_gradgradcheck(activation, with_bias):
    """squared_relu runs in the dispatcher's autograd.Function (no PyTorch kernel pair), the others
    under torch's own autograd; both must differentiate twice."""
    inputs = (_leaf(M, K), _leaf(N_LINEAR, K)) + ((_leaf(N_LINEAR),) if with_bias else ())
    op = _linear_op(activation, with_bias=with_bias)
    assert torch.autograd.gradcheck(op, inputs)
    assert torch.autograd.gradgradcheck(op, inputs)


@pytest.mark.parametrize("activation", ("gelu", "squared_relu"))
def test_fused_linear_gradgradcheck_3d(activation):
    """x (..., K) is reshaped to (M, K) inside: the second-order graph still reaches the caller's x."""
    inputs = (_leaf(2, 3, K), _leaf(N_LINEAR, K), _leaf(N_LINEAR))
    assert torch.autograd.gradgradcheck(_linear_op(activation), inputs)


def test_gradient_penalty_keeps_its_second_order_term():
    """The user's case: loss + |d loss / d x|^2 through squared_relu, whose gradient depends on x. The
    penalty's gradient in weight equals the plain-autograd composition's."""
    x, w, b = _leaf(M, K), _leaf(N_LINEAR, K), _leaf(N_LINEAR)

    def penalized(y):
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y.sum() + (gx * gx).sum()

    got = torch.autograd.grad(penalized(fused_linear(x, w, b, "squared_relu")), (x, w, b))
    want = torch.autograd.grad(penalized(torch.relu(torch.nn.functional.linear(x, w, b)) ** 2), (x, w, b))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


# ----------------------------------------------------------------------------- the other backends


def _first_and_second(op, leaves, grad_y):
    """First-order gradients with a graph, then the gradients of a penalty on them in every leaf and
    in grad_y: y's weighted sum plus the squared first-order gradients."""
    y = op(*leaves)
    first = torch.autograd.grad(y, leaves, grad_y, create_graph=True)
    penalty = (y * grad_y).sum() + sum((g * g).sum() for g in first)
    second = torch.autograd.grad(penalty, (*leaves, grad_y))
    return y, first, second


def _compare_with_eager(op_of, leaves, grad_shape):
    grad_y = torch.randn(grad_shape, dtype=leaves[0].dtype, device=leaves[0].device, requires_grad=True)
    y, first, second = _first_and_second(op_of(None), leaves, grad_y)
    for g in first:
        assert g.requires_grad and g.grad_fn is not None, "create_graph=True gave a gradient with no graph"
    y_ref, first_ref, second_ref = _first_and_second(op_of("eager"), leaves, grad_y)
    torch.testing.assert_close(y, y_ref)
    for name, got, want in zip(("first", "second"), (first, second), (first_ref, second_ref)):
        for i, (g, r) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, r, msg=lambda m, i=i, name=name: f"{name}-order gradient {i}: {m}")


# one kind of call each for the compiling backends (a compile apiece), two activations for triton
BACKEND_CASES = [
    pytest.param("triton", "gelu", id="triton-gelu"),
    pytest.param("triton", "squared_relu", id="triton-squared_relu"),
    pytest.param("nvfuser", "silu", id="nvfuser-silu"),
    pytest.param("inductor", "gelu_tanh", id="inductor-gelu_tanh"),
]


@pytest.mark.parametrize("backend, activation", BACKEND_CASES)
def test_bias_act_dropout_double_backward_matches_eager(backend, activation, device):
    """With dropout (the mask from the forward's rng) where it compiles in seconds; inductor's analysis
    of the Philox ops takes ~30 s on a small CPU, so inductor runs p = 0."""
    p = 0.0 if backend == "inductor" else 0.3
    shape = (2, 3, N)
    call = ops.get("bias_act_dropout").call(
        torch.device(device), torch.float32, (6, N), True, activation=activation, dropout=p > 0
    )
    require_call(backend, call)
    leaves = [_leaf(*shape, dtype=torch.float32, device=device), _leaf(N, dtype=torch.float32, device=device)]

    def op_of(chosen):
        return _dropout_op(activation, p, backend=chosen or backend)

    _compare_with_eager(op_of, leaves, shape)


@pytest.mark.parametrize(
    "backend, activation", BACKEND_CASES + [pytest.param("cublaslt", "relu", id="cublaslt-relu")]
)
def test_fused_linear_double_backward_matches_eager(backend, activation, device):
    call = ops.get("fused_linear").call(torch.device(device), torch.float32, (6, N, K), True, activation=activation)
    require_call(backend, call)
    leaves = [
        _leaf(2, 3, K, dtype=torch.float32, device=device),
        _leaf(N, K, dtype=torch.float32, device=device),
        _leaf(N, dtype=torch.float32, device=device),
    ]

    def op_of(chosen):
        return _linear_op(activation, backend=chosen or backend)

    _compare_with_eager(op_of, leaves, (2, 3, N))


def test_backward_without_a_graph_still_runs_the_backend(monkeypatch):
    """create_graph=False keeps the backend's own backward (the fast kernels); only a graph being
    built takes the reference."""
    calls = []
    eager = backends()["eager"]
    real = eager.kernels["bias_act_dropout"]
    counted = dataclasses.replace(real, backward=lambda *a: calls.append(1) or real.backward(*a))
    monkeypatch.setitem(eager.kernels, "bias_act_dropout", counted)
    clear_cache()
    x, b = _leaf(M, N), _leaf(N)
    y = fused_bias_act_dropout(x, b, "gelu", 0.0, backend="eager")
    torch.autograd.grad(y, (x, b), torch.randn_like(y))
    assert calls == [1]
    y = fused_bias_act_dropout(x, b, "gelu", 0.0, backend="eager")
    torch.autograd.grad(y, (x, b), torch.randn_like(y), create_graph=True)
    assert calls == [1]
    monkeypatch.undo()
    clear_cache()
