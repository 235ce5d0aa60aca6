"""bias_act_dropout on every registered backend against the float64 reference: outputs and gradients.

Cases come from the registry; a backend that cannot serve one skips it with its own reason. Dropout
cases draw ``rng`` from a seeded generator, so the reference applies the very same mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from dispatch import ACTIVATION_NAMES, fused_bias_act_dropout
from dispatch.registry import backends
from dispatch.contracts.tolerances import check
from harness import (
    BIAS_ACT_DROPOUT_GRADS,
    DTYPES,
    bias_act_dropout_call,
    cpu_budget,
    each_backend,
    reference_bias_act_dropout,
    require_call,
    run_bias_act_dropout,
    torch_masks,
)

SMALL_SHAPES = ((7,), (1, 1), (3, 5, 24))
BIG_SHAPE = (1823, 781)
GEN_SEED = 20260501


def _id(backend: str, dtype: torch.dtype, activation: str, shape: tuple, p: float) -> str:
    return f"{backend}-{str(dtype)[6:]}-{activation}-{'x'.join(map(str, shape))}-p{p}"


def grid(backend: str) -> list:
    """(dtype, activation, shape, p) cases for ``backend``, bounded by what each case costs on CPU.

    Eager: the full product on the small shapes, and on the big one every dtype x activation without
    dropout plus each dtype with dropout (the mask of 1.4M elements costs ~0.2 s per evaluation on CPU;
    test_rng covers masks at scale). Other backends, which compile or interpret every variant: each
    activation once in float32, each dtype once with gelu, dropout a few times, and the big shape on
    the GPU; backends that compile (COMPILING) run only the first two of these cases on CPU.
    """
    if backend == "eager":
        cases = [
            (d, a, s, p) for d in DTYPES for a in ACTIVATION_NAMES for s in SMALL_SHAPES for p in (0.0, 0.3)
        ]
        cases += [(d, a, BIG_SHAPE, 0.0) for d in DTYPES for a in ACTIVATION_NAMES]
        cases += [(d, "gelu", BIG_SHAPE, 0.3) for d in DTYPES]
        return [pytest.param(*c, id=_id(backend, *c)) for c in cases]
    f32, bf16, f16 = DTYPES
    cases = [(f32, "gelu", (3, 5, 24), 0.3), (bf16, "silu", (7,), 0.0)]
    cases += [(f32, a, (3, 5, 24), 0.0) for a in ACTIVATION_NAMES if a != "gelu"]
    cases += [(bf16, "gelu", (7,), 0.3), (f16, "gelu", (7,), 0.3), (f32, "relu", (1, 1), 0.3)]
    params = [
        pytest.param(*c, id=_id(backend, *c), marks=cpu_budget(backend, i < 2)) for i, c in enumerate(cases)
    ]
    params += [
        pytest.param(
            d, "gelu", BIG_SHAPE, 0.3, marks=pytest.mark.gpu, id=_id(backend, d, "gelu", BIG_SHAPE, 0.3)
        )
        for d in DTYPES
    ]
    return params


def require(backend: str, x: torch.Tensor, activation: str, dropout: bool, training: bool = True) -> None:
    """Skips with the backend's own reasons when it cannot serve this call."""
    require_call(backend, bias_act_dropout_call(x, activation, dropout, training))


def run(backend: str, x, bias, activation: str, p: float, grad_y):
    """Output and input gradients of the public op on ``backend`` (a fresh generator seeded GEN_SEED)."""
    return run_bias_act_dropout(backend, x, bias, activation, p, grad_y, GEN_SEED)


def reference(x, bias, activation: str, p: float, grad_y, upcast: bool, drawn=None):
    """The reference's output and gradients for the same mask as ``run`` (read back from ``drawn``, the
    output of a backend whose masks are torch's)."""
    return reference_bias_act_dropout(x, bias, activation, p, grad_y, upcast, GEN_SEED, drawn)


def assert_parity(backend: str, x, bias, activation: str, p: float, grad_y) -> None:
    y, grads = run(backend, x, bias, activation, p, grad_y)
    drawn = y if torch_masks(backend) else None
    ref, ref_grads = reference(x, bias, activation, p, grad_y, upcast=True, drawn=drawn)
    if backend == "eager" or drawn is not None:  # the reference in the same dtype sets the bar
        base, base_grads = reference(x, bias, activation, p, grad_y, upcast=False, drawn=drawn)
    else:
        base, base_grads = run("eager", x, bias, activation, p, grad_y)
    assert y.dtype == x.dtype and y.shape == x.shape
    check("y", y.detach(), ref.detach(), base.detach())
    for name, g, r, b, t in zip(BIAS_ACT_DROPOUT_GRADS, grads, ref_grads, base_grads, (x, bias)):
        if t is not None and t.requires_grad:
            assert g.dtype == t.dtype, f"{name} has dtype {g.dtype}, input has {t.dtype}"
            check(name, g, r, b)


@pytest.mark.parametrize("backend, dtype, activation, shape, p", each_backend(grid))
def test_matches_reference(backend, dtype, activation, shape, p, device):
    x = torch.randn(shape, device=device).mul_(2).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], device=device).to(dtype).requires_grad_()
    require(backend, x, activation, p > 0)
    grad_y = torch.randn(shape, device=device).to(dtype)
    assert_parity(backend, x, bias, activation, p, grad_y)


SUBSETS = {  # which inputs require grad: (x, bias); None = no bias
    "x-and-bias": (True, True),
    "x-only": (True, False),
    "bias-only": (False, True),
    "no-bias": (True, None),
    "inference": (False, False),
}


@pytest.mark.parametrize(
    "backend, subset",  # "x-and-bias" is the first grid case: no new compile
    [pytest.param(b, s, marks=cpu_budget(b, s == "x-and-bias")) for b in backends() for s in SUBSETS],
)
def test_gradient_subsets(backend, subset, device):
    need_x, need_bias = SUBSETS[subset]
    shape = (3, 5, 24)
    x = torch.randn(shape, device=device).requires_grad_(need_x)
    bias = None if need_bias is None else torch.randn(24, device=device).requires_grad_(need_bias)
    require(backend, x, "gelu", True, training=need_x or bool(need_bias))
    assert_parity(backend, x, bias, "gelu", 0.3, torch.randn(shape, device=device))


@pytest.mark.parametrize("p", (0.0, 0.3))
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_gradcheck(activation, p, device):
    x = torch.randn(4, 6, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, device=device, requires_grad=True)

    def op(x, bias):  # the generator is reseeded on every call, so every evaluation has the same mask
        gen = torch.Generator(device=device).manual_seed(GEN_SEED)
        return fused_bias_act_dropout(x, bias, activation, p, generator=gen, backend="eager")

    assert torch.autograd.gradcheck(op, (x, bias))


@pytest.mark.parametrize("p", (0.1, 0.5))
def test_torch_masks_drop_at_rate_p_and_backward_uses_the_same_mask(p, device):
    """The pytorch backend's mask is torch's: its drop rate is p within a binomial bound, and its
    gradient is zero exactly where its output was dropped (one mask, forward and backward)."""
    x = (torch.rand(256, 512, device=device) + 0.5).requires_grad_()  # relu(x) > 0: every drop is readable
    y = fused_bias_act_dropout(x, None, "relu", p, backend="pytorch")
    y.backward(torch.ones_like(y))
    n = y.numel()
    rate = float((y == 0).sum()) / n
    assert abs(rate - p) <= 6 * math.sqrt(p * (1 - p) / n), rate
    torch.testing.assert_close((x.grad == 0), (y == 0))
    torch.testing.assert_close(y[y != 0], (x * (1 / (1 - p)))[y != 0])
