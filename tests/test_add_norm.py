"""add_norm through its public functions, ``fused_add_rms_norm`` and ``fused_add_layer_norm``, on every
registered backend against the op's float64 reference: y, h and the gradients of x, residual, weight and
bias, with upstream gradients on y, h or both; odd shapes, strides, residual None, Gemma's offset, bad
input, explain(), double backward, torch.compile, the planner, parity's grid and a calibration through
the command line.

Cases come from the registry; a backend that cannot serve one skips it with its own reason. The
compiling backends (inductor) take one case of each norm on CPU, float32: each new kind of call
compiles (~5 s on 2 cores).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dispatch import calibrate, explain, fused_add_layer_norm, fused_add_rms_norm, parity
from dispatch import table as table_cli
from dispatch.calibrate import plan
from dispatch.ops import add_norm as spec
from add_norm_checks import assert_matches, inputs, public
from harness import DTYPES, cpu_budget, each_backend, require_call

NORMS = spec.NORMS
SHAPES = ((7, 3), (2, 5, 33))


def call_of(x: torch.Tensor, norm: str, training: bool = True):
    rows = (math.prod(x.shape[:-1]), x.shape[-1])
    return spec.SPEC.call(x.device, x.dtype, rows, training, norm=norm)


# ----------------------------------------------------------------------------- every backend


def grid(backend: str) -> list:
    """(dtype, norm, shape) cases: the product on the backends that compile nothing; one float32 case of
    each norm on the compiling ones (more with -m gpu)."""
    cases = [(d, n, s) for d in DTYPES for n in NORMS for s in SHAPES]
    first = {(torch.float32, n, SHAPES[1]) for n in NORMS}
    return [
        pytest.param(*c, id=f"{backend}-{str(c[0])[6:]}-{c[1]}-{'x'.join(map(str, c[2]))}",
                     marks=cpu_budget(backend, c in first))  # fmt: skip
        for c in cases
    ]


@pytest.mark.parametrize("backend, dtype, norm, shape", each_backend(grid))
def test_matches_reference(backend, dtype, norm, shape, device):
    tensors, upstream = inputs(shape, dtype, device, norm)
    require_call(backend, call_of(tensors[0], norm))
    y, h, gx, gr, *_ = assert_matches(backend, norm, tensors, upstream)
    # Triton's CPU interpreter rounds float32 to bfloat16 toward zero (test_triton_add_norm.py checks it)
    if not (backend == "triton" and device == "cpu" and dtype == torch.bfloat16):
        assert torch.equal(h, tensors[0] + tensors[1]), "h is PyTorch's x + residual"
    assert torch.equal(gx, gr), "x and residual have one gradient"


@pytest.mark.parametrize("backend", ("pytorch", "eager", "triton"))
@pytest.mark.parametrize("used", ("y", "h"))
@pytest.mark.parametrize("norm", NORMS)
def test_one_output_used(norm, used, backend, device):
    """Only y feeds on (h's gradient None), or only h (x and residual get its gradient, weight none)."""
    tensors, (gy, gh) = inputs((3, 5, 33), torch.float32, device, norm)
    require_call(backend, call_of(tensors[0], norm))
    got = assert_matches(backend, norm, tensors, (gy, None) if used == "y" else (None, gh))
    if used == "h":
        assert torch.equal(got[2], gh) and not got[4].any()


@pytest.mark.parametrize("backend", ("pytorch", "eager", "triton"))
@pytest.mark.parametrize("norm", NORMS)
def test_residual_none_and_gemma_offset(norm, backend, device):
    """residual None: a plain norm, h is x itself; offset=1.0: (1 + weight), weight around 0."""
    for dtype in (torch.float32, torch.bfloat16):
        tensors, upstream = inputs((9, 41), dtype, device, norm, residual=False)
        require_call(backend, call_of(tensors[0], norm))
        assert_matches(backend, norm, tensors, upstream)
        y, h = public(norm, backend)(*tensors)
        assert h.data_ptr() == tensors[0].data_ptr() and h.shape == tensors[0].shape
        tensors, upstream = inputs((2, 3, 41), dtype, device, norm, offset=1.0)
        assert_matches(backend, norm, tensors, upstream, offset=1.0)


@pytest.mark.parametrize("backend", ("pytorch", "eager", "triton"))
@pytest.mark.parametrize("norm", NORMS)
def test_strides(norm, backend, device):
    """x with a row stride and a transposed x, an expanded (stride 0) residual, a strided weight, and
    non-contiguous upstream gradients."""
    m, n = 6, 37
    x = torch.randn(m, n + 5, device=device)[:, :n]
    r = torch.randn(n, device=device).expand(m, n)
    w = torch.randn(2 * n, device=device)[::2]
    b = torch.randn(n, device=device) if norm == "layer" else None
    upstream = (torch.randn(n, m, device=device).t(), torch.randn(n, device=device).expand(m, n))
    require_call(backend, call_of(x, norm))
    assert_matches(backend, norm, (x, r, w, b), upstream)
    x3 = torch.randn(2, n, 3, device=device).transpose(1, 2)  # (2, 3, n), unit stride nowhere near n
    assert_matches(backend, norm, (x3, torch.randn(2, 3, n, device=device), w, b), (x3.clone(), None))


# ----------------------------------------------------------------------------- checks, explain


def test_bad_input_names_the_argument():
    x, w = torch.randn(4, 8), torch.randn(8)
    cases = [
        (lambda: fused_add_rms_norm([1.0], None, w), TypeError, "x must be a torch.Tensor"),
        (lambda: fused_add_rms_norm(x, x[:1], w), ValueError, r"residual must have x's shape \(4, 8\), got"),
        (lambda: fused_add_rms_norm(x, x.double(), w), TypeError, "residual must have x's dtype"),
        (lambda: fused_add_rms_norm(x, None, w[:7]), ValueError, r"weight must have shape \(8,\)"),
        (lambda: fused_add_rms_norm(x, None, w.half()), TypeError, "weight must have x's dtype"),
        (lambda: fused_add_rms_norm(x, None, w, -1e-6), ValueError, "eps must be a number above 0"),
        (lambda: fused_add_rms_norm(x, None, w, True), ValueError, "eps must be a real number"),
        (lambda: fused_add_rms_norm(x, None, w, offset="one"), ValueError, "offset must be a real number"),
        (lambda: fused_add_layer_norm(x, None, w, w[:3]), ValueError, r"bias must have shape \(8,\)"),
        (lambda: fused_add_rms_norm(x, None, w, backend="nvfuser"), ValueError, "nvfuser does not implement"),
    ]  # fmt: skip
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_explain_by_either_public_name_or_the_table_name():
    x, r, w, b = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(16), torch.randn(16)
    rms = explain("fused_add_rms_norm", x, r, w)
    assert rms.call.traits == ("norm",) and rms.call.values == ("rms",) and rms.call.shape == (6, 16)
    assert str(rms).startswith("add_norm(6x16, float32, rms, inference) on cpu")
    layer = explain("fused_add_layer_norm", x, r, w, b, 1e-5, backend="eager")
    assert layer.call.values == ("layer",) and layer.backend.name == "eager"
    assert explain("add_norm", x, None, w).call == rms.call  # the table name parses as the first function
    assert "nvfuser does not implement add_norm" in str(rms)


# ----------------------------------------------------------------------------- twice, and compiled


def _positional(fn, tensors):
    """fn over the tensors that are not None, as gradcheck passes them."""

    def op(*given):
        it = iter(given)
        return fn(*(None if t is None else next(it) for t in tensors))

    return op, [t.detach().requires_grad_() for t in tensors if t is not None]


@pytest.mark.parametrize("residual", (True, False), ids=("residual", "no-residual"))
@pytest.mark.parametrize("norm", NORMS)
def test_eager_gradgradcheck(norm, residual, device):
    tensors, _ = inputs((4, 6), torch.float64, device, norm, residual=residual)
    op, leaves = _positional(public(norm, "eager"), tensors)
    assert torch.autograd.gradcheck(op, leaves) and torch.autograd.gradgradcheck(op, leaves)


@pytest.mark.parametrize("norm", NORMS)
def test_second_order_on_triton_is_eagers(norm, device):
    """A backward building a graph runs the reference's backward on the h the node kept, whatever the
    backend: triton's first- and second-order gradients are eager's."""
    tensors, _ = inputs((4, 6), torch.float32, device, norm)
    require_call("triton", call_of(tensors[0], norm))
    found = []
    for backend in ("eager", "triton"):
        op, leaves = _positional(public(norm, backend), tensors)
        y, h = op(*leaves)
        first = torch.autograd.grad((y * y).sum() + h.pow(3).sum(), leaves, create_graph=True)
        found.append([*first, *torch.autograd.grad(sum(g.sin().sum() for g in first), leaves)])
    for got, want in zip(found[1], found[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_compiled_inline_and_as_a_custom_op(device):
    """Under torch.compile(fullgraph=True): with no backend requested the baseline's math, inlined; with
    one, the op's custom op (its backward recomputing the statistics from the kept h); both give the
    eager-mode values and gradients, with and without a residual."""
    tensors, (gy, gh) = inputs((2, 3, 16), torch.float32, device, "layer")

    def step(backend, with_residual):
        def loss(x, r, w, b):
            y, h = fused_add_layer_norm(x, r if with_residual else None, w, b, backend=backend)
            return (y * gy).sum() + (h * gh).sum()

        return loss

    for backend, with_residual in ((None, True), ("eager", True), ("eager", False)):
        fn = step(backend, with_residual)
        op, leaves = _positional(fn, tensors)
        want = [op(*leaves), *torch.autograd.grad(op(*leaves), leaves, materialize_grads=True)]
        compiled = torch.compile(op, fullgraph=True)
        got = [compiled(*leaves), *torch.autograd.grad(compiled(*leaves), leaves, materialize_grads=True)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- planner, parity, calibration


def test_planner_and_parity_take_it_from_its_spec():
    """The calibrator's series run over the norm trait; parity's quick grid has both norms and every
    dtype; the widths are real models' (LLaMA-2-7B, Qwen2-0.5B/1.5B, Gemma-2B/7B)."""
    assert spec.SPEC.variant == "norm" and spec.SPEC.variants() == NORMS
    assert {f for (f,) in spec.SPEC.grid.features} == {4096, 896, 1536, 2048, 3072}
    p = plan.default_plan(torch.device("cpu"), quick=True, budget=10.0, op_names=["add_norm"])
    family = plan.Family("add_norm", torch.float32, "training", False)
    assert [s.rep for s in plan.series_of(p, family, spec.SPEC.variants())] == ["rms", "layer"]
    assert plan.servers("add_norm", "rms") >= {"pytorch", "eager", "triton", "inductor"}
    cases = [c for c in parity.grid(torch.device("cpu"), quick=True) if c[0] == "add_norm"]
    assert {c[1] for c in cases} == set(NORMS) and {c[2] for c in cases} == {*DTYPES, torch.float64}


def test_a_calibration_measures_it_and_the_table_answers(user_dir, capsys):
    """python -m dispatch.calibrate --quick --ops add_norm on the CPU (plain PyTorch and eager, two small
    sizes): entries keyed by norm, each winner parity-checked against the reference on both outputs and
    every gradient; python -m dispatch.table prints them; explain() answers from the table."""
    out = user_dir / "cpu.json"
    argv = ["--quick", "--ops", "add_norm", "--features", "64", "--tokens", "1", "16", "--backends", "eager",
            "--budget", "60", "--out", str(out)]  # fmt: skip
    assert calibrate.main(argv) == 0
    entries = json.loads(out.read_text())["entries"]
    keys = sorted((e["norm"], e["mode"]) for e in entries)
    assert keys == [(n, m) for n in sorted(NORMS) for m in ("inference", "training")]
    for e in entries:
        assert list(e)[:5] == ["op", "dtype", "norm", "mode", "features"] and e["measured_as"] == e["norm"]
        assert "activation" not in e and "dropout" not in e
        assert all(s["backend"] in s["errors"] for s in e["segments"]), e["segments"]
    capsys.readouterr()
    assert table_cli.main(["--gpu", str(out), "--op", "add_norm"]) == 0
    printed = capsys.readouterr().out
    titles = [line for line in printed.splitlines() if line.startswith("add_norm  float32  training  norm ")]
    assert titles and all("timed as" in t for t in titles), printed
    assert all(n in " ".join(titles) for n in NORMS), printed
    x = torch.randn(8, 64)
    decision = explain("fused_add_rms_norm", x, x, torch.ones(64))
    assert "heuristics table" in decision.rule and "add_norm float32 rms inference" in decision.rule
