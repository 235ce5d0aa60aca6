"""The shared test harness: backends from the registry (with their own skip reasons), the public ops
run with gradients, the float64 reference with the same dropout mask, the tolerance check, and test
double backends registered for one test.

Test files import it as ``from harness import ...`` (tests/ is on sys.path: conftest.py lives there).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import pytest
import torch

from dispatch import fused_bias_act_dropout, fused_linear
from dispatch.ops import bias_act_dropout as bad_spec
from dispatch.ops import fused_linear as linear_spec
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.op import torch_keep
from dispatch.contracts.tolerances import check
from dispatch.registry import Backend, Call, backends

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMPILING = frozenset({"inductor", "nvfuser"})  # each new kind of call compiles: 1-10 s on a small CPU
BIAS_ACT_DROPOUT_GRADS = ("grad_x", "grad_bias")
FUSED_LINEAR_GRADS = ("grad_x", "grad_weight", "grad_bias")


# ----------------------------------------------------------------------------- backends


def cpu_budget(backend: str, on_cpu: bool) -> tuple:
    """Marks that keep a compiling backend's case off CPU CI (it still runs with -m gpu)."""
    return () if on_cpu or backend not in COMPILING else (pytest.mark.gpu,)


def each_backend(make) -> list:
    """``make(backend)``'s pytest.params for every registered backend, the backend's name first."""
    return [
        pytest.param(name, *case.values, id=case.id, marks=case.marks)
        for name in backends()
        for case in make(name)
    ]


def require_call(backend: str, call: Call) -> None:
    """Skips with the backend's own reasons when it cannot serve ``call``."""
    reasons = backends()[backend].not_supported_reasons(call)
    if reasons:
        pytest.skip("; ".join(reasons))


def bias_act_dropout_call(x: torch.Tensor, activation: str, dropout: bool, training: bool = True) -> Call:
    rows = (math.prod(x.shape[:-1]), x.shape[-1])
    return bad_spec.SPEC.call(x.device, x.dtype, rows, training, activation=activation, dropout=dropout)


def fused_linear_call(x: torch.Tensor, n: int, activation: str, training: bool = True) -> Call:
    shape = (math.prod(x.shape[:-1]), n, x.shape[-1])
    return linear_spec.SPEC.call(x.device, x.dtype, shape, training, activation=activation)


# ----------------------------------------------------------------------------- gradients


def leaf(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A fresh leaf copy of ``t`` (in ``dtype`` if given) that requires grad."""
    return t.detach().to(dtype or t.dtype).requires_grad_()


def grads(
    y: torch.Tensor, leaves: Sequence[Optional[torch.Tensor]], grad_y: torch.Tensor, allow_unused: bool = False
) -> list[Optional[torch.Tensor]]:
    """The gradient of each of ``leaves`` (None where it is None or needs none), for ``grad_y`` cast to
    y's dtype."""
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(
        torch.autograd.grad(y, wanted, grad_y.to(y.dtype), allow_unused=allow_unused) if wanted else ()
    )
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]


def check_detached(name: str, out, ref, base=None) -> None:
    """``check`` on detached tensors (``base`` may be None)."""
    check(name, out.detach(), ref.detach(), None if base is None else base.detach())


# ----------------------------------------------------------------------------- the ops and the reference


def generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def op_rng(device, seed: int = 1234) -> torch.Tensor:
    """The [seed, offset] pair the public op draws from a generator seeded ``seed``."""
    return dropout_rng.draw(torch.device(device), torch.Generator(device=device).manual_seed(seed))


def bias_act_inputs(shape, dtype, device, bias=True):
    """x (scaled by 2), bias (N) or None, and grad_y, in ``dtype``."""
    x = torch.randn(shape, device=device).mul_(2).to(dtype)
    b = torch.randn(shape[-1], device=device).to(dtype) if bias else None
    return x, b, torch.randn(shape, device=device).to(dtype)


def run_bias_act_dropout(
    backend: str, x, bias, activation: str, p: float, grad_y, seed: int
) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Output and input gradients of the public op on ``backend`` (a fresh generator seeded ``seed``)."""
    y = fused_bias_act_dropout(x, bias, activation, p, generator=generator(x.device, seed), backend=backend)
    return y, grads(y, (x, bias), grad_y)


def reference_bias_act_dropout(
    x, bias, activation: str, p: float, grad_y, upcast: bool, seed: int, drawn: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """The reference's output and gradients with the mask the op draws from a generator seeded ``seed``,
    or, given ``drawn`` (an output of a backend whose masks are torch's), the mask it drew from that
    generator, replayed."""
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (x, bias)]
    if drawn is not None and p > 0:  # torch's mask: replayed from a generator seeded alike
        keep = torch_keep(x.shape, x.dtype, x.device, p, generator(x.device, seed))
        y = bad_spec.reference(leaves[0], leaves[1], activation, p, upcast=upcast, keep=keep)
        return y, grads(y, leaves, grad_y)
    rng = dropout_rng.draw_for(x, generator(x.device, seed)) if p > 0 else None  # as the op draws
    y = bad_spec.reference(leaves[0], leaves[1], activation, p, rng, upcast=upcast)
    return y, grads(y, leaves, grad_y)


def torch_masks(backend: str) -> bool:
    """Whether ``backend`` draws dropout masks from torch's RNG (its parity reads the mask back)."""
    return backends()[backend].torch_masks


def run_fused_linear(backend: str, x, weight, bias, activation: str, grad_y) -> tuple[torch.Tensor, list]:
    y = fused_linear(x, weight, bias, activation, backend=backend)
    return y, grads(y, (x, weight, bias), grad_y)


def reference_fused_linear(x, weight, bias, activation: str, grad_y, upcast: bool) -> tuple[torch.Tensor, list]:
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (x, weight, bias)]
    y = linear_spec.reference(*leaves, activation, upcast=upcast)
    return y, grads(y, leaves, grad_y)


def fused_linear_inputs(x_shape, n, dtype, device, needs=(True, True, True)):
    """x (..., K), weight (N, K) scaled by 1/sqrt(K), bias (N) or None; ``needs``: which require grad
    (None for bias: no bias)."""
    k = x_shape[-1]
    x = torch.randn(x_shape, device=device).to(dtype).requires_grad_(needs[0])
    weight = (torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype).requires_grad_(needs[1])
    bias = None if needs[2] is None else torch.randn(n, device=device).to(dtype).requires_grad_(needs[2])
    return x, weight, bias


# ----------------------------------------------------------------------------- test doubles


def eager_twin(name: str, summary: str = "eager twin", **changes) -> Backend:
    """A backend that serves what eager serves, with eager's ops, under another name; ``changes``
    replaces fields (ops, dtypes, ...)."""
    eager = backends()["eager"]
    fields = dict(
        kernels=eager.kernels, devices=eager.devices, dtypes=eager.dtypes, activations=eager.activations,
        deterministic=True, summary=summary,
    )
    return Backend(name=name, **{**fields, **changes})


def register(monkeypatch, *doubles: Backend) -> None:
    """Registers ``doubles`` for the length of one test (monkeypatch restores the registry)."""
    backends()  # the real backends load first, so the doubles join them rather than precede them
    for backend in doubles:
        monkeypatch.setitem(backends(), backend.name, backend)
