"""benchmarks/probe_epilogue_mlp.py: its two Functions pose every product transposed for cuBLASLt
(column-major results, bias and bias gradients along the result's rows). With a stand-in for nvmath
that computes each epilogue as cuBLASLt defines it, on the CPU, both give the block's output and all
five gradients of the float64 reference (the device run checks the real library the same way)."""

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _column_major(t):
    return t.t().contiguous().t()


def fake_cublaslt(a, b, epilog, inputs):
    """D = a @ b (m x n), column-major, and the epilogue's outputs, as nvmath names them."""
    d = a.double() @ b.double()
    bias = inputs.get("bias") if inputs else None
    pre = d + bias.double()[:, None] if bias is not None else d
    gelu = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    if epilog in ("GELU_AUX_BIAS", "GELU_BIAS"):
        aux = {"gelu_aux": _column_major(pre.to(a.dtype))} if epilog == "GELU_AUX_BIAS" else {}
        return _column_major(gelu(pre).to(a.dtype)), aux
    if epilog in ("RELU_AUX_BIAS", "RELU_BIAS"):
        aux = {"relu_aux": _column_major(pre > 0)} if epilog == "RELU_AUX_BIAS" else {}
        return _column_major(torch.relu(pre).to(a.dtype)), aux
    if epilog == "DGELU_BGRAD":
        with torch.enable_grad():  # the probe calls this inside a backward
            z = inputs["gelu_aux"].double().requires_grad_()
            (slope,) = torch.autograd.grad(gelu(z).sum(), z)
        g = d * slope
        return _column_major(g.to(a.dtype)), {"dgelu_bgrad": g.sum(1).to(a.dtype)}
    if epilog == "DRELU_BGRAD":
        g = d * inputs["relu_aux"]
        return _column_major(g.to(a.dtype)), {"drelu_bgrad": g.sum(1).to(a.dtype)}
    if epilog == "BGRADB":
        return _column_major(d.to(a.dtype)), {"bgradb": b.double().sum(0).to(a.dtype)}
    raise AssertionError(f"the probe asked for an epilogue the stand-in lacks: {epilog}")


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    module = importlib.import_module("probe_epilogue_mlp")
    monkeypatch.setattr(module, "PLANS", fake_cublaslt)
    return module


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
@pytest.mark.parametrize("entry", ["hybrid", "epilogues", "epilogues+bgradb"])
def test_the_transposed_products_give_the_reference_gradients(probe, activation, entry):
    torch.manual_seed(len(activation) + len(entry))
    m, h, f = 48, 24, 40
    x = torch.randn(m, h, requires_grad=True)
    w_in = (torch.randn(f, h) / h**0.5).requires_grad_()
    b_in, b_out = torch.randn(f, requires_grad=True), torch.randn(h, requires_grad=True)
    w_out = (torch.randn(h, f) / f**0.5).requires_grad_()
    leaves = (x, w_in, b_in, w_out, b_out)
    if entry == "hybrid":
        y = probe.HybridMLP.apply(*leaves, activation)
    else:
        y = probe.EpilogueMLP.apply(*leaves, activation, entry.endswith("bgradb"))
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, gy)
    ref64 = [t.detach().double().requires_grad_() for t in leaves]
    act = (lambda t: F.gelu(t, approximate="tanh")) if activation == "gelu_tanh" else torch.relu
    y64 = F.linear(act(F.linear(ref64[0], ref64[1], ref64[2])), ref64[3], ref64[4])
    want = torch.autograd.grad(y64, ref64, gy.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("x", "w_in", "b_in", "w_out", "b_out"), got, want):
        assert g.shape == w.shape, (name, g.shape)
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=f"grad of {name}")
