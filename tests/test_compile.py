"""torch.compile(fullgraph=True) over a model that calls both ops: no graph breaks (fullgraph raises on
one), and the same outputs and gradients as the uncompiled model. Each compile costs ~10 s on a small
CPU, so there are two.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dispatch import fused_bias_act_dropout, fused_linear, fused_mlp, use_backend
from dispatch.select import cached_calls, clear_cache


class MLP(nn.Module):
    """A transformer MLP block: up-projection, bias + GELU + dropout, down-projection with SiLU."""

    def __init__(self, d: int = 16, hidden: int = 48, p: float = 0.0):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fused_linear(x, self.up.weight)  # (..., hidden), bias left to the next op
        h = fused_bias_act_dropout(h, self.up.bias, "gelu", self.p, self.training)
        return fused_linear(h, self.down.weight, self.down.bias, "silu")


def _run(
    model: nn.Module, x: torch.Tensor, seed: int = 1234
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)  # the dropout draw
    y = model(x)
    grads = torch.autograd.grad(y, (x, *model.parameters()), torch.ones_like(y) + y.detach())
    return y.detach(), grads


def _compare(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Compiles ``model`` and checks its output and gradients against the uncompiled model."""
    compiled = torch.compile(model, fullgraph=True)
    y_c, grads_c = _run(compiled, x)
    y, grads = _run(model, x)
    torch.testing.assert_close(y_c, y)
    names = ("x", *(name for name, _ in model.named_parameters()))
    for name, g_c, g in zip(names, grads_c, grads):
        torch.testing.assert_close(g_c, g, msg=lambda m, name=name: f"grad of {name}: {m}")
    return compiled


def test_compiled_mlp_matches_eager(device):
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    _compare(MLP().to(device), x)


def test_compiled_mlp_with_dropout_matches_eager_when_a_backend_is_requested(device):
    """With a backend requested the compiled graph keeps the custom op: it draws ``rng`` with aten
    randint (dispatch/contracts/rng.py) and the backend computes the spec's mask. On CPU eager mode draws with
    the same randint, so with fallback_random the masks, hence outputs and gradients, are equal. On
    CUDA eager mode reads the generator's state on the host instead (no kernel for the draw): there the
    compiled model must be reproducible under a seed, and each seed must give another mask."""
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    with torch._inductor.config.patch(fallback_random=True), use_backend("eager"):
        if x.is_cuda:
            compiled = torch.compile(MLP(p=0.3).to(device), fullgraph=True)
            again = _run(compiled, x, seed=1234)
            torch.testing.assert_close(again[0], _run(compiled, x, seed=1234)[0], rtol=0, atol=0)
        else:
            compiled = _compare(MLP(p=0.3).to(device), x)
        y_1234, _ = _run(compiled, x, seed=1234)
        y_99, _ = _run(compiled, x, seed=99)
    assert not torch.equal(y_1234, y_99), "the compiled model ignored dropout"


def test_compiled_dropout_without_a_backend_is_inductors(device):
    """No backend requested: the op is plain math in the graph and inductor draws the mask. What must
    hold is dropout's contract: kept values are act(x + bias) / (1 - p), about p of them dropped,
    the gradient zero exactly where the output was dropped, and a seed reproduces the mask."""
    p = 0.25
    x = (torch.rand(64, 96, device=device) + 0.5).requires_grad_()  # x + bias > 0: no zero is relu's
    bias = torch.rand(96, device=device, requires_grad=True)
    op = torch.compile(lambda x, b: fused_bias_act_dropout(x, b, "relu", p), fullgraph=True)
    torch.manual_seed(7)
    y = op(x, bias)
    kept = y != 0
    torch.testing.assert_close(y[kept], ((x + bias) / (1 - p))[kept])
    assert abs(1 - kept.float().mean().item() - p) < 0.05, f"dropped {1 - kept.float().mean().item():.3f}"
    grad_y = torch.randn_like(y)
    gx, gb = torch.autograd.grad(y, (x, bias), grad_y)
    torch.testing.assert_close(gx, torch.where(kept, grad_y / (1 - p), 0.0))
    torch.testing.assert_close(gb, gx.sum(0))
    torch.manual_seed(7)
    assert torch.equal(op(x, bias) != 0, kept), "the same seed drew another mask"
    assert not torch.equal(op(x, bias) != 0, kept), "the next call drew the same mask"


def test_no_graph_breaks_in_eval(device):
    model = MLP(p=0.3).to(device).eval()
    explanation = torch._dynamo.explain(model)(torch.randn(3, 16, device=device))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def _custom_ops_traced(model: nn.Module, x: torch.Tensor, fullgraph: bool = True) -> list[str]:
    """The fusedispatch custom ops in the graphs dynamo captures for ``model(x)`` (no inductor)."""
    found: list[str] = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        found.extend(str(n.target) for n in gm.graph.nodes if "fusedispatch" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture, fullgraph=fullgraph)(x)
    torch._dynamo.reset()
    return found


def test_compile_inlines_the_reference_unless_a_backend_is_requested(device):
    """With no backend requested both ops, dropout included, are traced as plain math, so inductor can
    fuse them with their neighbours (with a generator, the baseline's mask from it, as in eager mode);
    a requested backend keeps every op a custom op that runs it."""
    x = torch.randn(3, 16, device=device)
    assert _custom_ops_traced(MLP().to(device).eval(), x) == []
    assert _custom_ops_traced(MLP(p=0.3).to(device).train(), x) == []
    gen = torch.Generator(device).manual_seed(0)  # dynamo breaks the graph at the draw from it
    with_gen = _custom_ops_traced(
        lambda x: fused_bias_act_dropout(x, None, "gelu", 0.3, generator=gen), x, fullgraph=False
    )
    assert with_gen == []
    compiled = torch.compile(lambda x, g: fused_bias_act_dropout(x, None, "gelu", 0.3, generator=g))
    y = compiled(x, torch.Generator(device).manual_seed(5))
    expected = fused_bias_act_dropout(x, None, "gelu", 0.3, generator=torch.Generator(device).manual_seed(5))
    torch.testing.assert_close(y, expected)
    with use_backend("eager"):
        traced = _custom_ops_traced(MLP().to(device).eval(), x)
    assert sorted(set(traced)) == [
        "fusedispatch.bias_act_dropout.default",
        "fusedispatch.fused_linear.default",
    ]


def test_export_traces_both_ops(device):
    """torch.export, strict (dynamo) and non-strict (the model's Python run on fake tensors): the ops
    are traced as their math in aten ops, with no decision made (no backend runs on a fake tensor),
    and the exported program matches the model. Non-strict tracing is the case the fast path leaves by
    the type of its tensors (FakeTensor is a subclass)."""
    model = MLP().to(device).eval()
    x, x_new = torch.randn(3, 16, device=device), torch.randn(3, 16, device=device)
    with torch.no_grad():
        expected, expected_new = model(x), model(x_new)
        for strict in (False, True):
            clear_cache()
            program = torch.export.export(model, (x,), strict=strict)
            assert not cached_calls(), (
                f"strict={strict}: a backend was chosen while tracing: {cached_calls()}"
            )
            targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
            assert targets and all(isinstance(t, torch._ops.OpOverload) for t in targets), targets
            torch.testing.assert_close(program.module()(x), expected)
            torch.testing.assert_close(program.module()(x_new), expected_new)


@pytest.mark.parametrize("p", [0.5, 0.0])
def test_graph_traced_under_a_backend_runs_outside_it(p, device):
    """A graph traced under use_backend("eager") holds the custom op with the spec's rng it drew; run
    later outside, where the table (none here) picks pytorch, whose composite keeps nothing for a
    backward of its own: the op runs kernels that take the spec's rng instead, and backward drops
    exactly what forward dropped."""
    x = torch.randn(16, 40, device=device, requires_grad=True)
    b = torch.randn(40, device=device)
    compiled = torch.compile(lambda x, b: fused_bias_act_dropout(x, b, "gelu", p), fullgraph=True)
    with use_backend("eager"):
        compiled(x, b)
    y = compiled(x, b)
    (grad_x,) = torch.autograd.grad(y, x, torch.ones_like(y))
    z = (x + b).detach().double().requires_grad_()
    (slope,) = torch.autograd.grad(torch.nn.functional.gelu(z).sum(), z)
    if p:
        kept = y != 0
        assert 0.3 < kept.float().mean().item() < 0.7
        slope = kept * slope / (1 - p)
    torch.testing.assert_close(grad_x.double(), slope, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [0.3, 0.0])
def test_mlp_graph_traced_under_a_backend_runs_outside_it(p, device):
    """The same for fused_mlp, training: its custom op keeps pre for backward, which pytorch's
    composite does not give."""
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w_in, w_out = torch.randn(24, 8, device=device), torch.randn(8, 12, device=device)
    compiled = torch.compile(lambda x: fused_mlp(x, w_in, None, w_out, None, "swiglu", p), fullgraph=True)
    with use_backend("eager"):
        compiled(x)
    y = compiled(x)
    (grad_x,) = torch.autograd.grad(y, x, torch.ones_like(y))
    if not p:
        xd = x.detach().double().requires_grad_()
        gate, up = torch.nn.functional.linear(xd, w_in.double()).chunk(2, dim=-1)
        want = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_out.double())
        (grad_want,) = torch.autograd.grad(want.sum(), xd)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_x.double(), grad_want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.isfinite(grad_x).all() and grad_x.abs().sum() > 0


def test_a_fused_mlp_stays_opaque_under_compile_only_where_the_rule_says(user_dir):
    """FusedMLP under torch.compile: one custom op (triton) for a training call with hidden dropout of a
    plain activation where the table picks triton for the family at large M; its math elsewhere (no
    dropout, eval, a gate, the table's pick another backend), and under use_backend as every op."""
    import json

    from dispatch import heuristics, select
    from dispatch.nn import FusedMLP

    h, f = 8, 16
    info = heuristics.device_info(torch.device("cpu"))

    def table(backend: str) -> None:
        seg = {"m_from": 1, "backend": backend, "runner_up": "eager", "margin": 0.2, "m": 64,
               "clock": "gpu", "gpu_backend": backend, "gpu_us": {backend: 9.0, "eager": 12.0},
               "host_us": {backend: 4.0, "eager": 5.0}}  # fmt: skip
        entries = [{"op": "fused_mlp", "dtype": "float32", "activation": act, "mode": "training",
                    "dropout": True, "features": [h, f], "segments": [seg]}
                   for act in ("gelu", "swiglu")]  # fmt: skip
        doc = {"schema_version": heuristics.SCHEMA_VERSION, "device": info,
               "versions": heuristics.running_versions(), "entries": entries}  # fmt: skip
        (user_dir / f"{info['slug']}.json").write_text(json.dumps(doc))
        heuristics.reload()
        select.clear_cache()

    x = torch.randn(5, h)
    table("triton")
    opaque = ["fusedispatch.fused_mlp.default"]
    assert _custom_ops_traced(FusedMLP(h, f, activation="gelu", p=0.3).train(), x) == opaque
    assert _custom_ops_traced(FusedMLP(h, f, activation="gelu", p=0.3).eval(), x) == []
    assert _custom_ops_traced(FusedMLP(h, f, activation="gelu", p_out=0.3).train(), x) == []
    assert _custom_ops_traced(FusedMLP(h, f, activation="swiglu", p=0.3).train(), x) == []
    with use_backend("pytorch"):
        assert _custom_ops_traced(FusedMLP(h, f, activation="gelu", p=0.3).train(), x) == []
    table("pytorch")
    assert _custom_ops_traced(FusedMLP(h, f, activation="gelu", p=0.3).train(), x) == []
