"""Triton fused_mlp's "cublaslt" variant: gelu_tanh's first product through cuBLASLt's GELU_AUX_BIAS
epilogue (dispatch/backends/triton/gelu_aux.py). With a stand-in for nvmath's Matmul that computes the
epilogue as cuBLASLt defines it (a^T and pre^T column-major, the bias along the result's rows), the
block's output and every gradient match the float64 reference, no forward pass runs, backward forms no
a, one plan serves each shape and holds no tensor between calls; calls the epilogue does not serve take
the passes. The gpu test runs nvmath itself, eagerly and captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_triton_fused_mlp import BF16, F32, _inputs, assert_matches

from dispatch.backends.triton import gelu_aux
from dispatch.backends.triton import fused_mlp as triton_fused_mlp
from dispatch.backends.triton import mlp_hidden


def _column_major(t):
    return t.t().contiguous().t()


class FakeMatmul:
    """nvmath.linalg.advanced.Matmul's calls the product makes, computed in float64."""

    made: list["FakeMatmul"] = []

    def __init__(self, a, b, bias):
        self.a, self.b, self.bias, self.executed, self.released, self.freed = a, b, bias, 0, 0, False
        FakeMatmul.made.append(self)

    def reset_operands_unchecked(self, a, b, epilog_inputs):
        assert self.a is None, "operands rebound before the last call released them"
        self.a, self.b, self.bias = a, b, epilog_inputs["bias"]

    def execute(self):
        assert self.a is not None, "executed without operands"
        pre = self.a.double() @ self.b.double() + self.bias.double()[:, None]  # (F, M)
        self.executed += 1
        a = F.gelu(pre, approximate="tanh")
        return _column_major(a.to(self.a.dtype)), {"gelu_aux": _column_major(pre.to(self.a.dtype))}

    def release_operands(self):
        self.a = self.b = self.bias = None
        self.released += 1

    def free(self):
        self.freed = True


@pytest.fixture
def fake(monkeypatch):
    """nvmath "installed" on every device, its Matmul the stand-in; passes counted."""
    FakeMatmul.made = []
    monkeypatch.setattr(gelu_aux, "_plans", type(gelu_aux._plans)())
    monkeypatch.setattr(gelu_aux, "_installed", [True])
    monkeypatch.setattr(gelu_aux, "DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(gelu_aux, "_plan", lambda x, w, b: FakeMatmul(w, x.t(), b))
    forms, asked_a = [], []
    real_forward, real_backward = mlp_hidden.forward, mlp_hidden.backward
    monkeypatch.setattr(mlp_hidden, "forward", lambda *a: forms.append(a[1]) or real_forward(*a))
    monkeypatch.setattr(mlp_hidden, "backward", lambda *a: asked_a.append(a[6]) or real_backward(*a))
    return forms, asked_a


@pytest.mark.parametrize("shape", [(16, 16, 24, 16), (40, 24, 32, 8)])
def test_the_product_gives_the_reference(fake, device, shape):
    forms, asked_a = fake
    tensors = _inputs("gelu_tanh", False, True, BF16, shape, device)
    assert triton_fused_mlp.DEFAULT_VARIANT == "cublaslt"
    assert_matches(tensors, "gelu_tanh", 0.0, 0.2)
    assert_matches(tensors, "gelu_tanh", 0.0, 0.0)
    (plan,) = FakeMatmul.made  # one plan for both calls of this shape
    assert plan.executed == plan.released == 2 and plan.a is None
    assert forms == [] and asked_a == [False, False]  # no forward pass; a kept, not formed again


def test_leading_dims_and_a_second_shape_plan_again(fake, device):
    tensors = _inputs("gelu_tanh", False, True, BF16, (24, 16, 24, 16), device, x_shape=(3, 8, 16))
    assert_matches(tensors, "gelu_tanh", 0.0, 0.0)
    assert_matches(_inputs("gelu_tanh", False, True, BF16, (32, 16, 24, 16), device), "gelu_tanh", 0.0, 0.0)
    assert [p.executed for p in FakeMatmul.made] == [1, 1]


def test_plans_for_many_token_counts_are_bounded(fake, device, monkeypatch):
    """Token counts change per batch: the least recently used plan goes (freed) past MAX_PLANS."""
    monkeypatch.setattr(gelu_aux, "MAX_PLANS", 2)
    w, b = torch.randn(24, 16, device=device).to(BF16), torch.randn(24, device=device).to(BF16)
    for m in (16, 24, 16, 32):  # 16 used again before 32 comes: 24 is the one evicted
        a, pre = gelu_aux.gelu_aux_bias(torch.randn(m, 16, device=device).to(BF16), w, b)
        assert a.shape == pre.shape == (m, 24)
    assert [p.executed for p in FakeMatmul.made] == [2, 1, 1]
    assert [p.freed for p in FakeMatmul.made] == [False, True, False]
    assert [k[0] for k in gelu_aux._plans] == [16, 32]


def test_the_dispatcher_plans_ahead_for_a_capture_pick(fake, device, user_dir, monkeypatch):
    """Where a decision runs plain PyTorch but triton under CUDA-graph capture (a GPU's host-bound cell;
    made here by hand), the key's first call, eager, plans the product (and holds no tensor), so the
    capture's first call finds it; it runs no product itself. A key without a capture pick plans none."""
    import dataclasses

    from dispatch import fused_mlp, select

    real, triton = select.decision, select.backends()["triton"]
    x, w_in, _, b_in, _, w_out, b_out = _inputs("gelu_tanh", False, True, BF16, (24, 16, 32, 16), device)
    fused_mlp(x.requires_grad_(), w_in, b_in, w_out, b_out, "gelu_tanh")
    assert FakeMatmul.made == []
    monkeypatch.setattr(select, "decision", lambda key: dataclasses.replace(real(key), captured=triton))
    select.clear_cache()
    y = fused_mlp(x, w_in, b_in, w_out, b_out, "gelu_tanh")
    (plan,) = FakeMatmul.made
    assert plan.a is None and plan.executed == 0 and y.shape == (24, 16)
    assert list(gelu_aux._plans) == [(24, 16, 32, BF16, x.device)]
    fused_mlp(x, w_in, b_in, w_out, b_out, "gelu_tanh")  # the key decided: not planned again
    assert len(FakeMatmul.made) == 1
    # a patched block's module decides through its memo, and runs its own forward where plain
    from dispatch.nn import FusedMLP

    block = FusedMLP(16, 32, activation="gelu_tanh", p_out=0.1, device=device, dtype=BF16)
    block(torch.randn(40, 16, device=device).to(BF16))
    assert [k[0] for k in gelu_aux._plans] == [24, 40] and FakeMatmul.made[1].executed == 0


@pytest.mark.parametrize(
    "case",
    ["hidden dropout", "no bias", "rows not a multiple of 8", "float32", "relu", "variant passes"],
)
def test_calls_it_does_not_serve_take_the_passes(fake, device, case):
    forms, asked_a = fake
    activation = "relu" if case == "relu" else "gelu_tanh"
    dtype = F32 if case == "float32" else BF16
    shape = (20, 16, 24, 16) if case == "rows not a multiple of 8" else (16, 16, 24, 16)
    tensors = _inputs(activation, False, case != "no bias", dtype, shape, device)
    with triton_fused_mlp.options("passes" if case == "variant passes" else None):
        assert_matches(tensors, activation, 0.3 if case == "hidden dropout" else 0.0, 0.2)
    assert FakeMatmul.made == []
    assert forms == ([] if case == "relu" else [activation])


def test_a_plan_that_fails_is_not_tried_again(fake, device, monkeypatch):
    forms, _ = fake
    tries = []
    monkeypatch.setattr(gelu_aux, "_plan", lambda *a: tries.append(1) or 1 / 0)
    tensors = _inputs("gelu_tanh", False, True, BF16, (16, 16, 24, 16), device)
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError.*the passes run instead"):
        assert_matches(tensors, "gelu_tanh", 0.0, 0.0)
    assert_matches(tensors, "gelu_tanh", 0.0, 0.0)
    assert tries == [1] and forms == ["gelu_tanh", "gelu_tanh"]


def test_takes_refuses_what_the_plan_does_not_hold(fake, device):
    x, w, b = (torch.randn(*s, device=device).to(BF16) for s in ((16, 32), (24, 32), (24,)))
    assert gelu_aux.takes(x, w, b)
    assert not gelu_aux.takes(x[:, :16], w[:, :16], b)  # x not row-major contiguous
    shifted = torch.randn(600, device=device).to(BF16)[4:516].view(16, 32)  # 8 bytes off its allocation
    assert shifted.is_contiguous() and not gelu_aux.takes(shifted, w, b)
    assert not gelu_aux.takes(x, w, b.float())
    assert not gelu_aux.takes(x[:8], w, b)  # M <= 8
    assert not gelu_aux.takes(x.float(), w.float(), b.float())


@pytest.mark.gpu
def test_nvmath_product_eager_and_captured(device):
    pytest.importorskip("nvmath", reason="nvmath-python is the optional CUDA extra (fusedispatch[cuda])")
    torch.manual_seed(3)
    tensors = _inputs("gelu_tanh", False, True, BF16, (4096, 768, 3072, 768), device)
    assert_matches(tensors, "gelu_tanh", 0.0, 0.1)
    assert any(plan is not None for plan in gelu_aux._plans.values()), "no cuBLASLt product was planned"
    x, w, b = tensors[0], tensors[1], tensors[3]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gelu_aux.gelu_aux_bias(x, w, b)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            a, pre = gelu_aux.gelu_aux_bias(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    x.normal_()  # the replay reads the new x
    graph.replay()
    torch.cuda.synchronize()
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(pre.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(a.double(), F.gelu(want, approximate="tanh"), rtol=2e-2, atol=2e-2)
