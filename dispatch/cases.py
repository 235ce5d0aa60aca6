"""One call of an op at one shape: its inputs, its run on a backend, the float64 reference and the check.

Shared by ``python -m dispatch.parity`` and ``python -m dispatch.calibrate`` (whose parity gate and
timers build on it). Every run goes through the public ops with ``backend=name``, so what is checked is
what a user's call runs; the reference is the eager backend's definitions in float64.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from dispatch import timing
from dispatch.api import fused_bias_act_dropout, fused_linear
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts import tolerances
from dispatch.contracts.backend import Call

P_DROPOUT = 0.1  # the p of every dropout case: a cost does not depend on p, and 0.1 is the common one


@dataclass(frozen=True)
class Case:
    """One shape of one op: (M, N) for bias_act_dropout, (M, N, K) for fused_linear."""

    op: str
    dtype: torch.dtype
    activation: str
    training: bool  # forward + backward; inference is the forward under no_grad
    dropout: bool
    m: int
    features: tuple[int, ...]
    device: torch.device

    def call(self) -> Call:
        shape = (self.m, *self.features)
        return Call(self.op, self.device, self.dtype, shape, self.activation, self.dropout, self.training)

    @property
    def p(self) -> float:
        return P_DROPOUT if self.dropout else 0.0

    @property
    def seed(self) -> int:
        return zlib.crc32(repr(self).encode())


@dataclass
class Inputs:
    x: Tensor  # (M, N) or (M, K)
    bias: Tensor  # (N,)
    weight: Optional[Tensor]  # (N, K) for fused_linear
    grad_y: Tensor  # (M, N)
    seed: int  # of the dropout generator


def make_inputs(case: Case, seed: int) -> Inputs:
    """Fresh random inputs on the device (pre-activations ~ N(0, 1), so every activation branch is hit)."""
    g = torch.Generator(device=case.device).manual_seed(seed)
    dev, dt, n = case.device, case.dtype, case.features[0]

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt)

    if case.op == "bias_act_dropout":
        return Inputs(randn(case.m, n), randn(n, scale=0.5), None, randn(case.m, n), seed)
    k = case.features[1]
    weight = randn(n, k, scale=1.0 / math.sqrt(k))
    return Inputs(randn(case.m, k), randn(n, scale=0.5), weight, randn(case.m, n), seed)


def _generator(case: Case, seed: int) -> Optional[torch.Generator]:
    return torch.Generator(device=case.device).manual_seed(seed + 1) if case.dropout else None


def leaf_tensors(case: Case, inp: Inputs, dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    ts = [inp.x, inp.weight, inp.bias] if case.op == "fused_linear" else [inp.x, inp.bias]
    return [t.detach().to(dtype or t.dtype).requires_grad_(case.training) for t in ts]


def run_once(name: str, case: Case, inp: Inputs) -> list[Tensor]:
    """[y] in inference, [y, grad_x, (grad_w,) grad_bias] in training; the same dropout mask every time."""
    leaves = leaf_tensors(case, inp)
    with torch.set_grad_enabled(case.training):
        if case.op == "bias_act_dropout":
            x, b = leaves
            gen = _generator(case, inp.seed)
            y = fused_bias_act_dropout(x, b, case.activation, case.p, True, generator=gen, backend=name)
        else:
            x, w, b = leaves
            y = fused_linear(x, w, b, case.activation, backend=name)
    if not case.training:
        return [y]
    y.backward(inp.grad_y)
    return [y.detach(), *(t.grad for t in leaves)]


def reference(case: Case, inp: Inputs) -> list[Tensor]:
    """The float64 reference of run_once's outputs (the eager backend's definitions, autograd grads)."""
    from dispatch.backends.eager import bias_act_dropout as ref_bad
    from dispatch.backends.eager import fused_linear as ref_fl

    leaves = leaf_tensors(case, inp, torch.float64)
    with torch.set_grad_enabled(case.training):
        if case.op == "bias_act_dropout":
            x, b = leaves
            gen = _generator(case, inp.seed)
            rng = dropout_rng.draw_for(x, gen) if gen is not None else None  # as the op draws
            y = ref_bad.reference(x, b, case.activation, case.p, rng, upcast=True)
        else:
            x, w, b = leaves
            y = ref_fl.reference(x, w, b, case.activation, upcast=True)
    if not case.training:
        return [y]
    y.backward(inp.grad_y.double())
    return [y.detach(), *(t.grad for t in leaves)]


@dataclass(frozen=True)
class Check:
    errors: tuple[float, ...]  # max|out - ref| / max|ref| per output (y first, then the gradients)
    ratios: tuple[float, ...]  # max|out - ref| / allowed per output; <= 1 passes
    failure: str = ""  # an exception, if the backend raised

    @property
    def ok(self) -> bool:
        return not self.failure and all(r <= 1.0 for r in self.ratios)

    @property
    def error(self) -> float:
        return max(self.errors, default=math.inf)


def check(name: str, case: Case, inp: Inputs, refs: list[Tensor], eager: list[Tensor]) -> Check:
    """Runs ``name`` (after one warm-up call: JIT backends compile on their first) and compares every
    output with the reference: err <= 2 * err(eager in this dtype) + atol + rtol * max|ref|."""
    try:
        if name != "eager":
            run_once(name, case, inp)
        outs = run_once(name, case, inp)
    except Exception as exc:  # a broken backend is reported, never fatal
        return Check((), (), timing.describe(exc))
    return compare(outs, refs, eager)


def compare(outs: list[Tensor], refs: list[Tensor], eager: list[Tensor]) -> Check:
    errors, ratios = [], []
    for out, ref, eag in zip(outs, refs, eager):
        if out is None or out.shape != ref.shape:
            return Check(
                (), (), f"output shape {None if out is None else tuple(out.shape)} != {tuple(ref.shape)}"
            )
        err = tolerances.max_error(out, ref)
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        errors.append(err / scale if scale else err)
        ratios.append(err / tolerances.allowed_error(ref, out.dtype, eag))
    return Check(tuple(errors), tuple(ratios))


def gate(name: str, case: Case, inp: Inputs, refs: list, eager: list) -> list:
    """[passed, max relative error, why it failed] of backend ``name`` at ``case``."""
    c = compare(eager, refs, eager) if name == "eager" else check(name, case, inp, refs, eager)
    if c.ok:
        return [True, float(f"{c.error:.3g}"), ""]
    return [False, None, c.failure or f"max error {max(c.ratios):.2f}x the tolerance"]


def inputs(case: Case) -> tuple[Inputs, list, list]:
    """The point's inputs (seeded by the case), the float64 reference and eager's outputs."""
    inp = make_inputs(case, case.seed)
    return inp, reference(case, inp), run_once("eager", case, inp)
