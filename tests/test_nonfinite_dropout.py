"""Dropout over NaN, +-inf and huge finite inputs: F.dropout's product y * mask * scale, so a dropped NaN
or inf gives NaN, not 0. Eager follows that rule bit for bit with its own mask; the other backends
follow eager (the compiled ones on test_compiled_backends' dropout graph), and so does triton's 16-bit
rows kernel. The references and their tolerances: nonfinite_checks.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dispatch.backends.eager import bias_act_dropout as eager_bad
from dispatch import fused_bias_act_dropout
from dispatch.contracts import rng as dropout_rng
from dispatch.registry import backends
from dispatch.contracts.tolerances import ATOL, RTOL
from nonfinite_checks import (
    BACKENDS, COMPOSITE, INTERPRETER_WARNINGS, NONFINITE, SHAPE, SPECIALS, assert_identical, assert_matches,
    assert_matches_either, pick_reference, randn, skip_unless_supported,
)  # fmt: skip

pytestmark = INTERPRETER_WARNINGS


def _dropout_case(backend, activation, x, b, g, p, seed):
    """(y, grad_x, grad_bias or None) of the public op, its rng drawn right after manual_seed(seed)."""
    xb = x.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    torch.manual_seed(seed)
    y = fused_bias_act_dropout(xb, bb, activation, p, backend=backend)
    grads = torch.autograd.grad(y, [t for t in (xb, bb) if t is not None], g)
    return y.detach(), grads[0], grads[1] if bb is not None else None


# (backend, activation, with bias, p, N): eager and triton run several activations with a bias; the
# compiled backends run test_compiled_backends' dropout graph (identity, no bias, p = 0.25, N = 40).
# Backends whose masks are torch's (pytorch: F.dropout itself) are F.dropout's rule by construction.
_DROPOUT_CASES = [
    (backend, activation, True, 0.5, 33)
    for backend in ("eager", "triton")
    for activation in ("identity", "relu", "gelu", "silu")
] + [
    (backend, "identity", False, 0.25, 40)
    for backend in BACKENDS
    if backend not in ("eager", "triton") and not backends()[backend].torch_masks
]


@pytest.mark.parametrize(("backend", "activation", "has_bias", "p", "n"), _DROPOUT_CASES)
def test_dropout_keeps_nan_like_f_dropout(backend, activation, has_bias, p, n):
    """y = act(x + b) * keep * scale: F.dropout's product, so a NaN or inf that is dropped gives NaN
    (NaN * 0, inf * 0), a finite one 0; backward is grad_y * keep * scale * act'(z), autograd's
    gradient of that product. Eager follows the rule bit for bit (same dispatch.contracts.rng mask, drawn after
    the same manual_seed); the other backends follow eager: bit for bit where the activation is exact
    in float32 (identity, relu), within tolerance with the same NaN/inf pattern otherwise."""
    m, seed = SHAPE[0], 20261130
    skip_unless_supported(backend, "bias_act_dropout", (m, n), activation, dropout=True)
    gen = torch.Generator().manual_seed(1)
    x = randn(gen, m, n, scale=3.0)
    x.view(-1)[::3] = torch.tensor(SPECIALS).repeat(m * n)[: len(x.view(-1)[::3])]
    b = randn(gen, n) if has_bias else None
    g = randn(gen, m, n)

    # the rule, with the mask the op draws: dispatch.contracts.rng's draw right after the same manual_seed
    torch.manual_seed(seed)
    keep = dropout_rng.keep_mask(dropout_rng.draw(torch.device("cpu")), m, n, p)
    scale = dropout_rng.keep_scale(p)
    xr = x.clone().requires_grad_()
    br = None if b is None else b.clone().requires_grad_()
    act = COMPOSITE[activation](xr if br is None else xr + br)
    rule = act * keep * scale
    rule_grads = torch.autograd.grad(rule, [t for t in (xr, br) if t is not None], g)
    act = act.detach()
    dropped_special = ~keep & ~torch.isfinite(act)
    assert dropped_special.any() and (keep & ~torch.isfinite(act)).any()
    assert torch.isnan(rule[dropped_special]).all()  # F.dropout's: NaN * 0 and inf * 0 are NaN
    # F.dropout itself treats them so (its own mask): every non-finite input it drops comes out NaN
    fd = F.dropout(act, p, training=True)
    assert torch.isnan(fd[~torch.isfinite(act) & ~torch.isinf(fd)]).all()

    y, gx, gb = _dropout_case("eager", activation, x, b, g, p, seed)
    assert_identical(y, rule.detach(), f"eager {activation} y vs act(z) * keep * scale")
    assert_identical(gx, rule_grads[0], f"eager {activation} grad_x vs autograd of the rule")
    if b is not None:
        gb_terms = gx.double().abs().sum(0)
        assert_matches(gb, rule_grads[1], f"eager {activation} grad_bias", rtol_scale=gb_terms)
    if backend == "eager":
        return

    # the other reference (see the module's docstring): eager on float64 copies, with the same mask (its
    # rng spec's, whatever the dtype): nonzero exactly where kept, wherever act(z) is finite and nonzero
    # in float64 (float32's gelu(-7.6) is already 0, float64's -2e-13)
    x64, b64 = x.double(), None if b is None else b.double()
    y64, gx64, gb64 = _dropout_case("eager", activation, x64, b64, g.double(), p, seed)
    act64 = COMPOSITE[activation](x64 if b64 is None else x64 + b64)
    live = torch.isfinite(act64) & (act64 != 0)
    assert (live & keep).any() and (live & ~keep).any() and torch.equal((y64 != 0)[live], keep[live])

    got_y, got_gx, got_gb = _dropout_case(backend, activation, x, b, g, p, seed)
    what = f"{backend} {activation} p={p}"
    if activation in ("identity", "relu"):
        assert_identical(got_y, y, f"{what} y vs eager")
        assert_identical(got_gx, gx, f"{what} grad_x vs eager")
    else:
        assert_matches_either(got_y, y, y64, f"{what} y vs eager")
        g_scale = g.double().abs().clamp(min=1.0)
        assert_matches_either(got_gx, gx, gx64, f"{what} grad_x vs eager", atol_scale=g_scale)
    if b is not None:
        gb_terms = (gx.double().abs().sum(0) + 1.0, gx64.abs().sum(0) + 1.0)
        assert_matches_either(got_gb, gb, gb64, f"{what} grad_bias vs eager", rtol_scale=gb_terms)


def test_dropout_rows_kernel_keeps_nan(monkeypatch):
    """The 16-bit rows kernel (dropout past 64 rows) multiplies by the mask as the tile kernel does:
    bfloat16 y bit for bit the tile kernel's, NaN wherever a non-finite value is dropped, with eager's
    NaN/inf pattern. (Not bit for bit eager's here: the interpreter rounds float32 to bfloat16 its own
    way, at p = 0 too; the GPU test compares with eager bit for bit.) gelu: NaN from -inf as well."""
    activation = "gelu"
    skip_unless_supported("triton", "bias_act_dropout", (72, 16), activation, dropout=True)
    from dispatch.backends.triton import bias_act_dropout as triton_bad

    m, n, p = 72, 16, 0.5
    gen = torch.Generator().manual_seed(2)
    x = randn(gen, m, n, scale=3.0)
    x.view(-1)[::5] = torch.tensor(NONFINITE + (3e38, -3e38)).repeat(m * n)[: len(x.view(-1)[::5])]
    x, b = x.to(torch.bfloat16), randn(gen, n).to(torch.bfloat16)
    rng = dropout_rng.draw(torch.device("cpu"))
    assert triton_bad._rows_kernel_fits(x, b, rng, m, n)
    got = triton_bad.forward(x, b, activation, p, rng)
    with monkeypatch.context() as patched:
        patched.setattr(triton_bad, "_rows_kernel_fits", lambda *args: False)
        tiled = triton_bad.forward(x, b, activation, p, rng)
    assert torch.equal(got.view(torch.int16), tiled.view(torch.int16))
    # eager's float32 math and, for the other reference (module docstring), eager on float64 copies
    want32 = eager_bad.forward(x, b, activation, p, rng)
    want64 = eager_bad.forward(x.double(), b.double(), activation, p, rng)
    keep = dropout_rng.keep_mask(rng, m, n, p)
    z = x.float() + b.float()
    act32, act64 = COMPOSITE[activation](z), COMPOSITE[activation](z.double())
    dropped_special = ~keep & ~torch.isfinite(act32) & ~torch.isfinite(act64)
    assert dropped_special.any() and torch.isnan(got[dropped_special]).all()
    (want,) = pick_reference(got, want32, want64)
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(got), kind(want)), f"rows kernel {activation}: {kind.__name__} pattern"
    dropped_finite = ~keep & torch.isfinite(want)
    assert torch.equal(got[dropped_finite], torch.zeros_like(got[dropped_finite]))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=RTOL[torch.bfloat16], atol=ATOL[torch.bfloat16])
