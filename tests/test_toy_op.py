"""A toy op defined entirely here, scaled_add(x, y, scale) = x * scale + y: its spec, an eager kernel
and a plain-PyTorch baseline. With no edit to the package, the dispatcher runs it, explain() explains
it, the calibration planner plans it on the CPU, a calibration measures it and dispatch.table prints
it: the test that a new op is one spec file (plus a kernel file per backend that implements it). It
declares no traits: its calls carry no activation and no dropout."""

from __future__ import annotations

import json
import numbers
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
from torch import Tensor

from dispatch import calibrate, explain, ops, select
from dispatch import table as table_cli
from dispatch.calibrate import plan
from dispatch.contracts import checks
from dispatch.contracts.backend import Call, Kernels
from dispatch.contracts.op import Case, Grid, Inputs, OpCall, OpSpec

NAME = "scaled_add"


class ScaledAddCall(OpCall):
    __slots__ = ("x", "y", "scale")

    def __init__(self, call: Call, x: Tensor, y: Tensor, scale: float) -> None:
        super().__init__(call)
        self.x, self.y, self.scale = x, y, scale


def _math(x: Tensor, y: Tensor, scale: float) -> Tensor:
    return x * scale + y


def _backward(grad: Tensor, x: Tensor, y: Tensor, scale: float, needs: tuple[bool, bool]) -> tuple:
    return (grad * scale if needs[0] else None), (grad if needs[1] else None)


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, y, scale, kernels):  # type: ignore[override]
        ctx.scale, ctx.kernels = scale, kernels
        ctx.save_for_backward(x, y)
        return kernels.forward(x, y, scale)

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        x, y = ctx.saved_tensors
        return (*ctx.kernels.backward(grad, x, y, ctx.scale, tuple(ctx.needs_input_grad[:2])), None, None)


class ScaledAdd(OpSpec):
    name = NAME
    public_name = NAME
    dims = ("M", "N")
    grid = Grid(
        features=((64,),), quick={"cpu": ((64,),)}, classes=(), gemm=False,
        check_work=2**20, families=(("training", False), ("inference", False)),
    )  # fmt: skip

    def parse(self, x: object, y: object, scale: object = 2.0) -> ScaledAddCall:  # type: ignore[override]
        x, _, _, _, _, rows, device, dtype = checks.bias_act_dropout_args(
            x, None, "identity", 0.0, False, None
        )
        if not isinstance(y, Tensor) or y.shape != x.shape or y.dtype != dtype:
            raise ValueError(f"y must be a tensor of x's shape {tuple(x.shape)} and dtype {dtype}, got {y!r}")
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise ValueError(f"scale must be a real number, got {scale!r}")
        grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
        return ScaledAddCall(Call(NAME, device, dtype, rows, grad), x, y, float(scale))

    def runner(self, kernels: Kernels, call: Call) -> Callable[[OpCall], Tensor]:
        if not call.training:
            return lambda c: kernels.inference(c.x, c.y, c.scale)  # type: ignore[attr-defined]
        if kernels.autograd(call.activation):
            return lambda c: kernels.forward(c.x, c.y, c.scale)  # type: ignore[attr-defined]
        return lambda c: _Function.apply(c.x, c.y, c.scale, kernels)  # type: ignore[attr-defined]

    def traced(self, c: OpCall, backend: Optional[str], inline: bool) -> Tensor:
        return self.baseline(c)

    def baseline(self, c: OpCall) -> Tensor:
        return torch.add(c.y, c.x, alpha=c.scale)  # type: ignore[attr-defined]

    def baseline_kernels(self) -> Kernels:
        add = lambda x, y, scale: torch.add(y, x, alpha=scale)  # noqa: E731
        return Kernels(forward=add, backward=_backward, inference=add, autograd=lambda a: True, masks="torch")

    def reference_kernels(self) -> Kernels:  # the eager kernel
        return Kernels(forward=_math, backward=_backward, inference=_math)

    def inputs(self, case: Case, seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        shape = (case.m, *case.features)
        x, y, grad = (torch.randn(shape, generator=g).to(case.dtype) for _ in range(3))
        return Inputs([x, y], grad, seed)

    def run_case(
        self, case: Case, leaves: Sequence[Tensor], backend: Optional[str], seed: Optional[int]
    ) -> Tensor:
        x, y = leaves
        return torch.add(y, x, alpha=3.0) if backend is None else scaled_add(x, y, 3.0, backend=backend)

    def reference_case(self, case: Case, leaves: Sequence[Tensor], seed: int, torch_masks=False) -> Tensor:
        return _math(leaves[0], leaves[1], 3.0)


SPEC = ScaledAdd()


def scaled_add(x: Tensor, y: Tensor, scale: float = 2.0, *, backend: Optional[str] = None) -> Tensor:
    return ops.dispatcher().run(SPEC, SPEC.parse(x, y, scale), backend)


@pytest.fixture(autouse=True)
def registered():
    ops.register(SPEC)
    select.clear_cache()
    yield
    ops.unregister(NAME)
    select.clear_cache()


def test_the_dispatcher_runs_it_on_every_backend_that_serves_it():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    for backend in (None, "eager", "pytorch"):
        out = scaled_add(x, y, 0.5, backend=backend)
        torch.testing.assert_close(out, x.detach() * 0.5 + y.detach())
        gx, gy = torch.autograd.grad(out, (x, y), torch.ones_like(out))
        torch.testing.assert_close(gx, torch.full_like(x, 0.5))
        torch.testing.assert_close(gy, torch.ones_like(y))
    with pytest.raises(ValueError, match="triton does not implement scaled_add"):
        scaled_add(x, y, backend="triton")
    with pytest.raises(ValueError, match="scale must be a real number"):
        scaled_add(x, y, "two")


def test_explain_explains_it():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    decision = explain("scaled_add", x, y)
    assert decision.backend.name == "pytorch" and "the first able backend: pytorch" in decision.rule
    assert str(decision).startswith("scaled_add(4x8, float32, inference) on cpu")
    assert decision.call.traits == () and decision.call.activation is None and not decision.call.dropout
    assert decision.reasons["cublaslt"] == ["cublaslt does not implement scaled_add"]
    assert decision.reasons["eager"] == []


def test_the_planner_plans_it_on_the_cpu():
    p = plan.default_plan(torch.device("cpu"), quick=True, budget=10.0, op_names=[NAME])
    assert p.features == {NAME: [(64,)]}
    families = plan.family_order([NAME])
    assert families == [("training", NAME, False), ("inference", NAME, False)]
    family = plan.Family(NAME, torch.float32, "training", False)
    assert SPEC.variant is None and SPEC.variants() == (None,)  # no trait to run series over: one a family
    series = plan.series_of(p, family, SPEC.variants())
    assert [s.rep for s in series] == [None] and series[0].label == "scaled_add float32 training"
    assert p.grid(NAME, (64,), torch.float32)[-1] == p.m_cap(NAME, (64,), torch.float32)
    assert plan.servers(NAME, None) >= {"eager", "pytorch"}


def test_a_calibration_measures_it_and_the_table_prints_it(tmp_path, capsys):
    """python -m dispatch.calibrate --quick --ops scaled_add on the CPU: an entry per family, keyed by no
    trait (no activation, no dropout field), plain PyTorch and eager timed at every point, each winner
    parity-checked; then python -m dispatch.table prints it and the table answers its calls. The toy's
    eager (two passes through a Function) runs at 0.2-0.5x PyTorch's one add: PyTorch wins, at 1.00x."""
    out = tmp_path / "toy.json"
    assert calibrate.main(["--quick", "--ops", NAME, "--budget", "20", "--out", str(out)]) == 0
    entries = json.loads(out.read_text())["entries"]
    assert sorted(e["mode"] for e in entries) == ["inference", "training"]
    for e in entries:
        assert list(e)[:4] == ["op", "dtype", "mode", "features"] and "measured_as" not in e, list(e)
        assert all({"eager", "pytorch"} <= p["gpu_us"].keys() for p in e["points"]), e["points"]
        assert all(s["backend"] in s["errors"] for s in e["segments"]), e["segments"]
    capsys.readouterr()
    assert table_cli.main(["--gpu", str(out), "--op", NAME]) == 0
    printed = capsys.readouterr().out
    for mode in ("inference", "training"):
        assert f"scaled_add  float32  {mode}\n" in printed, printed
    assert "pytorch 1.00x" in printed and "activation" not in printed.split("cell:")[0], printed
    from dispatch import heuristics

    call = SPEC.call(torch.device("cpu"), torch.float32, (16, 64), True)
    choice = heuristics.load_table(str(out)).choose(call)
    assert choice.backend == "pytorch" and "scaled_add float32 training, the segment" in choice.description
