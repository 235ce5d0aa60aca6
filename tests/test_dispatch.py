"""The dispatcher: explain(), the order argument > use_backend() > DISPATCH_BACKEND > table > default >
priority list, refusals with reasons, and the decision cache.

Test doubles are registered for the length of one test (monkeypatch restores the registry): "fake"
serves everything, including the meta device that eager refuses, and records what it ran; "picky"
serves float64 only.
"""

from __future__ import annotations

import re

import pytest
import torch

import dispatch
from dispatch import heuristics
from dispatch.backends.eager import bias_act_dropout as eager_bad
from dispatch.backends.eager import fused_linear as eager_linear
from dispatch import explain, fused_bias_act_dropout, fused_linear, registry, use_backend
from dispatch import select as select_mod
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.registry import Backend, Kernels
from harness import register

ALL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class Recorder:
    """Kernels that delegate to eager's and record each call (``calls``)."""

    def __init__(self, module):
        self.calls = []
        real = module.KERNELS
        self.kernels = Kernels(
            forward=self._record("forward", real.forward),
            backward=self._record("backward", real.backward),
            inference=self._record("inference", real.inference),
        )

    def _record(self, what, fn):
        def recorded(*args):
            self.calls.append(what)
            return fn(*args)

        return recorded


RECORDERS: dict = {}  # (backend, op) -> its Recorder


def _recorded(backend: str, op: str, module) -> Kernels:
    RECORDERS[backend, op] = Recorder(module)
    return RECORDERS[backend, op].kernels


def calls(backend: str, op: str) -> list:
    return RECORDERS[backend, op].calls


def _double(name: str, dtypes=ALL_DTYPES) -> Backend:
    return Backend(
        name=name,
        kernels={
            "bias_act_dropout": _recorded(name, "bias_act_dropout", eager_bad),
            "fused_linear": _recorded(name, "fused_linear", eager_linear),
        },
        devices=frozenset({"cpu", "cuda", "meta"}),
        dtypes=frozenset(dtypes),
        activations=frozenset(ACTIVATION_NAMES),
        deterministic=True,
        summary="test double",
    )


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """A fresh decision cache, no table, no environment override; all restored afterwards."""
    monkeypatch.delenv(select_mod.ENV_VAR, raising=False)
    monkeypatch.setattr(heuristics, "lookup", lambda call: None)
    select_mod.clear_cache()
    yield
    monkeypatch.undo()  # before re-reading DISPATCH_BACKEND below
    select_mod.clear_cache()


def _setenv(monkeypatch, name: str) -> None:
    """DISPATCH_BACKEND is read at import and by clear_cache()."""
    monkeypatch.setenv(select_mod.ENV_VAR, name)
    select_mod.clear_cache()


@pytest.fixture
def fake(monkeypatch) -> Backend:
    backend = _double("fake")
    register(monkeypatch, backend, _double("picky", {torch.float64}))
    return backend


def _table(monkeypatch, name: str) -> str:
    description = f"test table: cell picks {name}"
    monkeypatch.setattr(heuristics, "lookup", lambda call: heuristics.Choice(name, description))
    return description


def _args(device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    return x, torch.randn(16, device=device)


# ----------------------------------------------------------------------------- explain


def test_explain_default(device):
    x, bias = _args(device)
    decision = explain("fused_bias_act_dropout", x, bias, "gelu", 0.1)
    assert decision.backend.name == "pytorch"  # plain PyTorch where no table answers
    assert "the first able backend: pytorch" in decision.rule
    call = decision.call
    assert (call.op, call.shape, call.dtype, call.activation, call.dropout, call.training) == (
        "bias_act_dropout",
        (4, 16),
        torch.float32,
        "gelu",
        True,
        True,
    )
    lines = str(decision).splitlines()
    assert lines[0] == str(call) and "bias_act_dropout(4x16, float32, gelu, dropout, training)" in lines[0]
    assert lines[1] == "  runs on: pytorch" and lines[2].startswith("  because: ")
    assert lines[3] == "  dropout mask: torch's RNG (as nn.Dropout)"
    others = [name for name in registry.backends() if name != "pytorch"]
    assert [line.split(":")[0].strip() for line in lines[4:]] == others
    for name in others:  # a reason, or the fact that it could have run
        assert decision.reasons[name] or "could run, not chosen" in str(decision)


def test_explain_fused_linear_and_inference(device):
    x = torch.randn(2, 3, 8, device=device)
    decision = explain("fused_linear", x, torch.randn(5, 8, device=device), None, "silu")
    assert decision.call.shape == (6, 5, 8) and decision.call.activation == "silu"
    assert not decision.call.training and not decision.call.dropout
    off = explain("fused_bias_act_dropout", x, None, "relu", 0.5, training=False)
    assert not off.call.dropout


def test_explain_unknown_op():
    """The message lists every op's public functions, as the registry derives them from the specs."""
    listed = ", ".join(map(repr, dispatch.ops.public_names()))
    assert "'fused_bias_act_dropout', 'fused_linear'" in listed
    with pytest.raises(ValueError, match=re.escape(f"op_name must be one of {listed}; got 'matmul'")):
        explain("matmul", torch.randn(2, 2))


# ----------------------------------------------------------------------------- the order of decision


def test_table_beats_default(monkeypatch, fake, device):
    description = _table(monkeypatch, "fake")
    x, bias = _args(device)
    decision = explain("fused_bias_act_dropout", x, bias)
    assert decision.backend is fake and decision.rule == description
    fused_bias_act_dropout(x, bias).sum().backward()
    assert calls("fake", "bias_act_dropout") == ["forward", "backward"]


def test_env_beats_table(monkeypatch, fake, device):
    _table(monkeypatch, "fake")
    _setenv(monkeypatch, "eager")
    x, bias = _args(device)
    decision = explain("fused_bias_act_dropout", x, bias)
    assert decision.backend.name == "eager" and decision.rule == "requested by DISPATCH_BACKEND"
    fused_bias_act_dropout(x, bias)
    assert calls("fake", "bias_act_dropout") == []


def test_use_backend_beats_env(monkeypatch, fake, device):
    _setenv(monkeypatch, "eager")
    x, bias = _args(device)
    with use_backend("fake"):
        decision = explain("fused_bias_act_dropout", x, bias)
        fused_bias_act_dropout(x, bias)
    assert decision.backend is fake and decision.rule == "requested by use_backend()"
    assert calls("fake", "bias_act_dropout") == ["forward"]
    fused_bias_act_dropout(x, bias)  # the block is over
    assert calls("fake", "bias_act_dropout") == ["forward"]


def test_argument_beats_use_backend(fake, device):
    x, bias = _args(device)
    w = torch.randn(3, 16, device=device)
    with use_backend("fake"):
        decision = explain("fused_bias_act_dropout", x, bias, backend="eager")
        fused_bias_act_dropout(x, bias, backend="eager")
        fused_linear(x, w, backend="eager")
        fused_linear(x, w)
    assert decision.backend.name == "eager" and decision.rule == "requested by the backend= argument"
    assert calls("fake", "bias_act_dropout") == []
    assert calls("fake", "fused_linear") == ["forward"]  # from the call without backend=


def test_fused_linear_takes_inference_without_autograd(fake, device):
    """Calls without autograd run the kernels' inference, calls with autograd their forward (and
    backward, through dispatch.contracts.running's KernelsFunction)."""
    x = torch.randn(2, 3, 16, device=device)
    w = torch.randn(5, 16, device=device, requires_grad=True)
    with use_backend("fake"):
        fused_linear(x, w, None, "gelu").sum().backward()
        with torch.no_grad():
            for _ in range(2):
                y = fused_linear(x, w, None, "gelu")
    assert calls("fake", "fused_linear") == ["forward", "backward", "inference", "inference"]
    assert y.shape == (2, 3, 5)
    torch.testing.assert_close(y, torch.nn.functional.gelu(x @ w.detach().T))


def test_first_able_backend_when_the_table_pick_cannot_serve(monkeypatch, fake, device):
    _table(monkeypatch, "picky")  # float64 only; the call is float32
    x, bias = _args(device)
    decision = explain("fused_bias_act_dropout", x, bias)
    assert decision.backend.name == "pytorch"
    assert decision.rule == "table chose picky, which cannot serve it; default pytorch"
    assert decision.reasons["picky"] == ["picky supports dtypes float64; x is torch.float32"]


def test_first_able_backend_when_the_default_cannot_serve(monkeypatch, fake):
    x = torch.empty(4, 16, device="meta")  # pytorch and eager run on cpu and cuda only
    decision = explain("fused_bias_act_dropout", x)
    assert decision.backend is fake and "the first able backend: fake" in decision.rule
    assert decision.reasons["eager"] == ["eager needs a cpu or cuda device; x is on meta"]


def test_spec_masks_keep_dropout_off_torch_masks(device):
    """dispatch.spec_masks(): dropout calls leave the pytorch backend (its masks are torch's) for the
    first backend with the spec's masks; calls without dropout stay."""
    x, bias = _args(device)
    try:
        dispatch.spec_masks(True)
        drop = explain("fused_bias_act_dropout", x, bias, "gelu", 0.1)
        plain = explain("fused_bias_act_dropout", x, bias, "gelu", 0.0)
        with pytest.raises(ValueError, match="pytorch draws dropout masks from torch's RNG"):
            fused_bias_act_dropout(x, bias, "gelu", 0.1, backend="pytorch")
    finally:
        dispatch.spec_masks(False)
    assert drop.backend.name == "eager" and "dropout mask: dispatch.contracts.rng's spec" in str(drop)
    assert plain.backend.name == "pytorch"
    assert explain("fused_bias_act_dropout", x, bias, "gelu", 0.1).backend.name == "pytorch"


def test_spec_masks_as_a_context_manager(device):
    """``with dispatch.spec_masks():`` holds for the block only, nested blocks restore what was before."""
    x, bias = _args(device)
    picked = lambda: explain("fused_bias_act_dropout", x, bias, "gelu", 0.1).backend.name  # noqa: E731
    with dispatch.spec_masks():
        assert picked() == "eager"
        with dispatch.spec_masks(False):
            assert picked() == "pytorch"
        assert picked() == "eager"
    assert picked() == "pytorch"
    with pytest.raises(RuntimeError, match="inside"):
        with dispatch.spec_masks():
            raise RuntimeError("inside")
    assert picked() == "pytorch"


def test_no_backend_can_run_lists_every_reason():
    x = torch.empty(4, 16, device="meta")
    with pytest.raises(
        ValueError, match=r"no backend can run bias_act_dropout\(4x16, float32, gelu, inference\) on meta"
    ) as err:
        explain("fused_bias_act_dropout", x)
    for name in registry.backends():
        assert f"\n  {name}: " in str(err.value)
    assert "eager needs a cpu or cuda device; x is on meta" in str(err.value)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("how", ("argument", "use_backend", "env"))
def test_requested_backend_that_cannot_serve(how, monkeypatch, fake, device):
    x, bias = _args(device)
    source = {
        "argument": "the backend= argument",
        "use_backend": r"use_backend\(\)",
        "env": "DISPATCH_BACKEND",
    }[how]
    match = (
        rf"backend 'picky' \(from {source}\) cannot run bias_act_dropout\(4x16, float32.*"
        r"picky supports dtypes float64; x is torch\.float32"
    )
    kwargs = {"backend": "picky"} if how == "argument" else {}
    if how == "env":
        _setenv(monkeypatch, "picky")
    with pytest.raises(ValueError, match=match):
        if how == "use_backend":
            with use_backend("picky"):
                fused_bias_act_dropout(x, bias, **kwargs)
        else:
            fused_bias_act_dropout(x, bias, **kwargs)
    with pytest.raises(ValueError, match=r"backend 'picky'.*cannot run fused_linear"):
        fused_linear(x, torch.randn(3, 16, device=device), backend="picky")


def test_unknown_backend_lists_registered(monkeypatch, device):
    names = ", ".join(registry.backends())
    match = rf"backend must be one of {names}; got 'cudnn'"
    x, bias = _args(device)
    with pytest.raises(ValueError, match=match):
        fused_bias_act_dropout(x, bias, backend="cudnn")
    with pytest.raises(ValueError, match=match):
        with use_backend("cudnn"):
            pass
    with pytest.raises(ValueError, match=match):
        explain("fused_linear", x, torch.randn(3, 16, device=device), backend="cudnn")
    _setenv(monkeypatch, "cudnn")
    with pytest.raises(ValueError, match=match):
        fused_bias_act_dropout(x, bias)


# ----------------------------------------------------------------------------- the decision cache


def test_decisions_are_cached(monkeypatch, device):
    decided = []
    original = select_mod.decide

    def counting(call, requested, source=""):
        decided.append(call)
        return original(call, requested, source)

    monkeypatch.setattr(select_mod, "decide", counting)
    x, bias = _args(device)
    for _ in range(3):
        fused_bias_act_dropout(x, bias, "gelu", 0.1)
    assert len(decided) == 1
    fused_bias_act_dropout(x.detach(), bias, "gelu", 0.1)  # inference: another signature
    fused_bias_act_dropout(x.double(), bias.double(), "gelu", 0.1)  # another dtype
    fused_bias_act_dropout(x, bias, "relu", 0.1)  # another activation
    fused_bias_act_dropout(x, bias, "gelu", 0.0)  # no dropout
    fused_bias_act_dropout(x[:3], bias, "gelu", 0.1)  # another token count
    assert len(decided) == 6
    w = torch.randn(3, 16, device=device)
    fused_linear(x, w)
    fused_linear(x, w)
    assert len(decided) == 7
    assert [c.training for c in decided] == [True, False, True, True, True, True, True]


def test_a_call_holds_the_traits_its_op_declares_and_keys_by_name():
    """fused_linear declares an activation, bias_act_dropout an activation and dropout: their calls, the
    table keys of them and explain() hold those and no other. Decision keys name their fields."""
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    linear = dispatch.ops.get("fused_linear").parse(x, w, None, "relu").call
    assert (linear.traits, linear.values, linear.dropout) == (("activation",), ("relu",), False)
    assert str(linear) == "fused_linear(4x3x8, float32, relu, inference) on cpu"
    bad = dispatch.ops.get("bias_act_dropout").parse(x, None, "gelu", 0.1).call
    assert (bad.traits, bad.values) == (("activation", "dropout"), ("gelu", True)) and bad.dropout
    assert str(bad) == "bias_act_dropout(4x8, float32, gelu, dropout, inference) on cpu"
    key = heuristics.EntryKey.of_call(linear)
    assert key.traits == (("activation", "relu"),) and key.activation == "relu" and key.dropout is False
    # the form from before traits still builds a call of activation and dropout, which keys alike
    former = registry.Call("fused_linear", linear.device, torch.float32, (4, 3, 8), "relu", False, False)
    assert former.traits == ("activation", "dropout") and heuristics.EntryKey.of_call(former) == key

    assert select_mod.key(linear, None) is linear  # nothing asked for a backend: the call is its own key
    assert select_mod.key(linear, "eager") == select_mod.Request(linear, "eager", None, False)
    with use_backend("pytorch"):
        assert select_mod.key(linear, None).context == "pytorch"
    assert select_mod.table_key(linear).by_table and not select_mod.key(linear, "eager").by_table


def test_cache_follows_overrides(fake, device):
    x, bias = _args(device)
    fused_bias_act_dropout(x, bias)
    with use_backend("fake"):  # a cached eager decision must not leak into the block
        fused_bias_act_dropout(x, bias)
    assert calls("fake", "bias_act_dropout") == ["forward"]
