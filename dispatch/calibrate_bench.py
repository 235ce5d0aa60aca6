"""Measuring one call on one backend: inputs, the parity check against the float64 reference, timing.

Shared by ``python -m dispatch.calibrate`` and ``python -m dispatch.parity``. Every run goes through
the public ops with ``backend=name``, so what is checked and timed is what a user's call runs
(validation, the cached decision and the autograd glue cost the same ~us for every backend). The
clock is ``dispatch.timing``'s, the one the benchmarks use: ``time_all`` only hands it ``Timer``s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from dispatch import timing
from dispatch.api import fused_bias_act_dropout, fused_linear
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts import tolerances
from dispatch.contracts.backend import Call

P_DROPOUT = 0.1  # the p of every dropout measurement: cost does not depend on p
WARM_CALLS = 1  # a call before the checked one: JIT backends compile/profile on their first call


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

    @classmethod
    def of_entry(cls, e: dict, m: int, device: torch.device) -> "Case":
        """The case of a table entry (or a held-out-size record, which has the same keys) at M = m."""
        return cls(
            e["op"],
            getattr(torch, e["dtype"]),
            e["activation"],
            e["mode"] == "training",
            e["dropout"],
            m,
            tuple(e["features"]),
            device,
        )

    def call(self) -> Call:
        return Call(
            self.op,
            self.device,
            self.dtype,
            (self.m, *self.features),
            self.activation,
            self.dropout,
            self.training,
        )

    @property
    def p(self) -> float:
        return P_DROPOUT if self.dropout else 0.0


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


def _leaves(case: Case, inp: Inputs, dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    ts = [inp.x, inp.weight, inp.bias] if case.op == "fused_linear" else [inp.x, inp.bias]
    return [t.detach().to(dtype or t.dtype).requires_grad_(case.training) for t in ts]


def run_once(name: str, case: Case, inp: Inputs) -> list[Tensor]:
    """[y] in inference, [y, grad_x, (grad_w,) grad_bias] in training; the same dropout mask every time."""
    leaves = _leaves(case, inp)
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
    # imported here, once a worker has a job: the reference is not needed to start one
    from dispatch.backends.eager import bias_act_dropout as ref_bad
    from dispatch.backends.eager import fused_linear as ref_fl

    leaves = _leaves(case, inp, torch.float64)
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


def failure(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:300]


def check(name: str, case: Case, inp: Inputs, refs: list[Tensor], eager: list[Tensor]) -> Check:
    """Runs ``name`` (after warm-up calls) and compares every output with the reference, using
    dispatch.contracts.tolerances' rule: err <= 2 * err(eager in this dtype) + atol + rtol * max|ref|."""
    try:
        for _ in range(WARM_CALLS if name != "eager" else 0):
            run_once(name, case, inp)
        outs = run_once(name, case, inp)
    except Exception as exc:  # a broken backend is reported, never fatal
        return Check((), (), failure(exc))
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


class Timer(NamedTuple):
    """What ``time_all`` times: ``fn`` runs ``calls`` calls of the op; ``leaves``' grads reset before it."""

    fn: Callable[[], object]
    leaves: list[Tensor]
    calls: int = 1


# Training on CUDA is timed as TRAIN_CHAIN forwards and one backward over all their outputs. A model
# calls backward once per step for all its ops, so the autograd engine's fixed cost per backward()
# call (on the H200 ~0.5 ms at M = 1, most of an isolated fwd+bwd at GPT-2's c_fc shape) belongs to
# no single op; timed one call per backward it swamped the differences between backends, and the
# table sent c_fc to cublaslt: GPT-2 patched then trained at 0.86x eager's speed, 1.21x once the
# chained timings sent it to triton.
TRAIN_CHAIN = 4


def timer(name: str, case: Case, inp: Inputs) -> Timer:
    """A closure running the op (forward, or forward + backward) and the tensors whose grads reset."""
    leaves = _leaves(case, inp)
    p, act, grad_y = case.p, case.activation, inp.grad_y
    if case.op == "bias_act_dropout":
        x, b = leaves

        def forward() -> Tensor:
            return fused_bias_act_dropout(x, b, act, p, True, backend=name)
    else:
        x, w, b = leaves

        def forward() -> Tensor:
            return fused_linear(x, w, b, act, backend=name)

    if not case.training:
        return Timer(forward, [])
    if case.device.type != "cuda":  # the CPU table keeps one call per backward (its quick budget)

        def step() -> None:
            forward().backward(grad_y)

        return Timer(step, leaves)

    def chain() -> None:
        outs = [forward() for _ in range(TRAIN_CHAIN)]
        torch.autograd.backward(outs, [grad_y] * TRAIN_CHAIN)

    return Timer(chain, leaves, TRAIN_CHAIN)


def time_all(
    timers: dict[str, Timer],
    device: torch.device,
    quick: bool,
    training: bool,
    rounds: int = timing.ROUNDS,
) -> tuple[dict[str, Union[float, Exception]], dict[str, float]]:
    """Each backend's median milliseconds per op call over ``rounds`` interleaved rounds (A B C,
    B C A, ...: ``timing.interleave``), each round ``timing.per_call_ms`` over a ``timing.ROUNDS``-th
    of its usual time, the first round after an untimed call (a JIT backend may compile there). A
    backend whose first round took ``timing.SLOW_MS`` or more is not timed again; one whose timing
    raised gets its exception instead of a number. Also returns the seconds spent on each."""
    out, spent = timing.interleave(
        {
            name: lambda r, t=t: timing.per_call_ms(
                t.fn, t.leaves, device, quick, training, 1 / timing.ROUNDS, warm=r == 0, calls=t.calls
            )
            for name, t in timers.items()
        },
        rounds,
    )
    return {n: t if isinstance(t, Exception) else t.ms for n, t in out.items()}, spent
