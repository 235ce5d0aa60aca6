"""One call of an op at one shape: its inputs, its run on a backend, the float64 reference and the check.

Shared by ``python -m dispatch.parity`` and ``python -m dispatch.calibrate`` (whose parity gate and
timers build on it); every op's part comes from its spec (``dispatch.ops``). Every run goes through
the public op with ``backend=name``, so what is checked is what a user's call runs; the reference is
the spec's definition in float64, with the spec's dropout mask, or for a backend whose masks come from
torch's RNG the mask recovered from its output (and its drop rate held to a binomial bound); where an
output cannot give its masks back (fused_mlp's two), that backend is checked on the case without dropout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from dispatch import ops, registry, timing
from dispatch.contracts import tolerances
from dispatch.contracts.op import P_DROPOUT, Case, Inputs, outputs_of

__all__ = [
    "P_DROPOUT", "Case", "Inputs", "Check", "Gate", "case", "make_inputs", "run_once", "reference", "check",
    "gate", "inputs",
]  # fmt: skip

DROP_RATE_SIGMAS = 6.0  # a torch-RNG mask's drop rate within this many binomial deviations of p


def case(op: str, dtype: torch.dtype, variant: Optional[str], training: bool, dropout: bool, m: int,
         features: tuple[int, ...], device: torch.device) -> Case:  # fmt: skip
    """The case of op ``op`` at one shape, holding the traits the op declares: ``variant`` the value of its
    variant trait (an activation; None for an op without one), ``dropout`` False for an op without it."""
    spec = ops.get(op)
    dropout = dropout and spec.dropout
    return Case(op, dtype, variant, training, dropout, m, tuple(features), device, spec.traits)


def make_inputs(case: Case, seed: int) -> Inputs:
    """Fresh random inputs on the device (pre-activations ~ N(0, 1), so every activation branch is hit)."""
    return ops.get(case.op).inputs(case, seed)


def leaf_tensors(case: Case, inp: Inputs, dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    return [t.detach().to(dtype or t.dtype).requires_grad_(case.training) for t in inp.tensors]


def run_once(name: Optional[str], case: Case, inp: Inputs) -> list[Tensor]:
    """[y] in inference, [y, *grads] in training (the same dropout mask every time for spec masks), y
    the op's outputs (one, or more: ``Grid.outputs``); ``name`` None runs the baseline composite."""
    leaves = leaf_tensors(case, inp)
    with torch.set_grad_enabled(case.training):
        outs = outputs_of(ops.get(case.op).run_case(case, leaves, name, inp.seed))
    if not case.training:
        return list(outs)
    torch.autograd.backward(outs, inp.grads)
    return [*(y.detach() for y in outs), *(t.grad for t in leaves)]


def reference(case: Case, inp: Inputs, torch_masks: bool = False) -> list[Tensor]:
    """The float64 reference of run_once's outputs, with torch's masks replayed for ``torch_masks``."""
    leaves = leaf_tensors(case, inp, torch.float64)
    with torch.set_grad_enabled(case.training):
        outs = outputs_of(ops.get(case.op).reference_case(case, leaves, inp.seed, torch_masks))
    if not case.training:
        return list(outs)
    torch.autograd.backward(outs, tuple(g.double() for g in inp.grads))
    return [*(y.detach() for y in outs), *(t.grad for t in leaves)]


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


def _torch_masks(name: str) -> bool:
    return registry.backends()[name].torch_masks


def drop_rate_failure(y: Tensor, undropped: Tensor, p: float) -> str:
    """Why a mask read back from ``y`` is not a dropout at rate ``p`` ("" if it is): its drop rate over
    the elements it can be read at (nonzero undropped values) within DROP_RATE_SIGMAS deviations."""
    readable = undropped != 0
    n = int(readable.sum())
    if n == 0:
        return ""
    rate = float(((y == 0) & readable).sum()) / n
    bound = DROP_RATE_SIGMAS * math.sqrt(p * (1.0 - p) / n) + 1.0 / n
    return "" if abs(rate - p) <= bound else f"drop rate {rate:.4f} for p = {p} over {n} elements"


def check(name: str, case: Case, inp: Inputs, refs: list[Tensor], eager: list[Tensor]) -> Check:
    """Runs ``name`` (after one warm-up call: JIT backends compile on their first) and compares every
    output with the reference: err <= 2 * err(eager in this dtype) + atol + rtol * max|ref|."""
    try:
        if name != "eager":
            run_once(name, case, inp)
        outs = run_once(name, case, inp)
    except Exception as exc:  # a broken backend is reported, never fatal
        return Check((), (), timing.describe(exc))
    if case.dropout and _torch_masks(name):
        refs = reference(case, inp, torch_masks=True)
        plain = reference(dataclasses.replace(case, dropout=False, training=False), inp)[0]
        why = drop_rate_failure(outs[0].double(), plain, case.p)
        if why:
            return Check((), (), why)
        eager = refs  # eager's mask is another: the float64 reference alone sets the bound
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


class Gate(NamedTuple):
    """A calibration's parity gate of one backend at one case."""

    passed: bool
    error: Optional[float]  # max relative error over the outputs, where passed
    why: str  # why it failed ("" where passed)


def gate(name: str, case: Case, inp: Inputs, refs: list, eager: list) -> Gate:
    """The gate of backend ``name`` at ``case`` (eager: its outputs, computed already, against the
    reference)."""
    c = compare(eager, refs, eager) if name == "eager" else check(name, case, inp, refs, eager)
    if c.ok:
        return Gate(True, float(f"{c.error:.3g}"), "")
    return Gate(False, None, c.failure or f"max error {max(c.ratios):.2f}x the tolerance")


def inputs(case: Case) -> tuple[Inputs, list, list]:
    """The point's inputs (seeded by the case), the float64 reference and eager's outputs."""
    inp = make_inputs(case, case.seed)
    return inp, reference(case, inp), run_once("eager", case, inp)
