"""The compiled backends' caches of compiled functions (nvfuser, inductor): a function compiled for one
kind of call never serves another, and first calls from many threads at once compile safely.

Each walk keeps one shape and changes one thing at a time: p, the activation, the dtype, bias on or
off, which inputs require grad, the layout of x. Every call is compared with eager's, bit for bit:
both compiled backends run eager's own functions, so the same ops give the same bits, and
``torch.manual_seed`` before each call gives both the same dropout draw. The exceptions are sums over
the token dimension that inductor orders its own way (grad_bias): those are checked against the
float64 reference with ``dispatch.contracts.tolerances``. A graph served to the wrong kind of call shows up as
a wrong mask, activation or bias, far outside any tolerance.

Only the p walk has dropout on: a dropout graph (the Philox rounds) takes inductor 10-30 s to compile
on a 2-core CPU, nvfuser 1-3 s, against a few seconds and a fraction of one without; the other
changes need no mask to show a graph served to the wrong call.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dispatch.ops import bias_act_dropout as bad_spec
from dispatch.ops import fused_linear as linear_spec
from dispatch.backends.inductor import compiler as inductor_compiler
from dispatch import fused_bias_act_dropout, fused_linear
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.tolerances import check

COMPILED = ("nvfuser", "inductor")
M, N, K = 64, 48, 32
DRAW_SEED = 20261201  # torch.manual_seed before each call: the backend and eager draw the same mask
ROOT = Path(__file__).resolve().parents[1]


def _x(cols: int, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """(M, cols) x: contiguous, or the transpose of a contiguous tensor (strides (1, M))."""
    return torch.randn(cols, M, dtype=dtype).t() if transposed else torch.randn(M, cols, dtype=dtype)


def _leaves(tensors: dict, needs: dict, dtype=None) -> dict:
    """Fresh leaves (``dtype``, else their own) requiring grad where ``needs`` says so."""
    return {k: None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(needs[k])
            for k, t in tensors.items()}


def _grads(y: torch.Tensor, leaves: dict, grad_y: torch.Tensor) -> dict:
    wrt = {k: t for k, t in leaves.items() if t is not None and t.requires_grad}
    grads = torch.autograd.grad(y, list(wrt.values()), grad_y.to(y.dtype)) if wrt else ()
    return dict(zip(wrt, grads))


@contextlib.contextmanager
def _seeded():
    """``torch.manual_seed(DRAW_SEED)`` inside, the generator's own state restored after: every call
    draws the same dropout mask, and the data of the next case is still fresh."""
    with torch.random.fork_rng(devices=()):
        torch.manual_seed(DRAW_SEED)
        yield


def _run(op, backend: str, tensors: dict, needs: dict, grad_y: torch.Tensor, *args):
    """``op(*tensors, *args, backend=backend)`` on fresh leaves, ``_seeded``: y and {name: gradient}
    of the leaves that require grad."""
    leaves = _leaves(tensors, needs)
    with _seeded():
        y = op(*leaves.values(), *args, backend=backend)
    return y.detach(), _grads(y, leaves, grad_y)


def _reference_grads(reference, tensors: dict, needs: dict, grad_y: torch.Tensor) -> dict:
    """Float64 gradients of ``reference(*leaves)``."""
    leaves = _leaves(tensors, needs, torch.float64)
    return _grads(reference(*leaves.values()), leaves, grad_y)


def _compare(label: str, backend: str, got, want, exact: set, ref_grads=None) -> list[str]:
    """Mismatches of (y, grads) against eager's: bit for bit, except gradients not in ``exact``,
    checked against ``ref_grads`` (float64) within the dtype's tolerance."""
    (y, grads), (ey, egrads) = got, want
    bad = []
    if y.dtype != ey.dtype or not torch.equal(y, ey):
        bad.append(f"{label}: y differs from eager's (max {(y.double() - ey.double()).abs().max():.3g})")
    if grads.keys() != egrads.keys():
        return bad + [f"{label}: gradients for {sorted(grads)}, eager's for {sorted(egrads)}"]
    for name, g in grads.items():
        e = egrads[name]
        if name in exact:
            if g.dtype != e.dtype or not torch.equal(g, e):
                bad.append(f"{label}: grad_{name} differs from eager's "
                           f"(max {(g.double() - e.double()).abs().max():.3g})")
        else:
            try:
                check(f"{label}: grad_{name}", g, ref_grads[name], e)
            except AssertionError as err:
                bad.append(str(err))
    return bad


def _drop_fraction(y: torch.Tensor) -> float:
    return (y == 0).float().mean().item()


# ----------------------------------------------------------------------------- bias_act_dropout


def _bias_act_dropout_case(backend: str, p: float, activation: str = "identity", dtype=torch.float32,
                           bias: bool = True, needs=(True, True), transposed: bool = False):
    x = _x(N, dtype, transposed)
    tensors = {"x": x, "bias": torch.randn(N, dtype=dtype) if bias else None}
    needs = dict(zip(tensors, needs))
    grad_y = torch.randn(M, N, dtype=dtype)
    got = _run(fused_bias_act_dropout, backend, tensors, needs, grad_y, activation, p)
    want = _run(fused_bias_act_dropout, "eager", tensors, needs, grad_y, activation, p)
    with _seeded():
        rng = dropout_rng.draw_for(x) if p > 0 else None  # the ops' own draw

    def reference(x, b):
        return bad_spec.reference(x, b, activation, p, rng, upcast=True)

    return got, want, _reference_grads(reference, tensors, needs, grad_y)


@pytest.mark.parametrize("backend", COMPILED)
def test_bias_act_dropout_each_change_gets_its_own_compiled_function(backend):
    exact = {"x", "bias"} if backend == "nvfuser" else {"x"}  # inductor sums grad_bias its own way
    bad = []
    for p in (0.1, 0.5, 0.9):  # three values: the third is where a p traced as a symbol went wrong
        got, want, ref = _bias_act_dropout_case(backend, p)
        bad += _compare(f"p={p}", backend, got, want, exact, ref)
        # identity, bias: y is 0 exactly where dropped (an exact 0.0 draw is ~1 in 5 million); over
        # 3072 elements 0.03 is 3.3 standard deviations at p = 0.5 (and DRAW_SEED fixes the draw)
        if abs(_drop_fraction(got[0]) - p) > 0.03:
            bad.append(f"p={p}: {backend} dropped {_drop_fraction(got[0]):.3f} of y")
    for label, change in [
        ("activation=relu", dict(activation="relu")),
        ("dtype=bfloat16", dict(dtype=torch.bfloat16)),
        ("bias=None", dict(bias=False)),
        ("no grad", dict(needs=(False, False))),
        ("grad of x only", dict(needs=(True, False))),
        ("transposed x", dict(transposed=True)),
    ]:
        got, want, ref = _bias_act_dropout_case(backend, 0.0, **change)
        bad += _compare(label, backend, got, want, exact, ref)
    assert not bad, "\n".join(bad)
    if backend == "inductor":  # everything static but M: a new token count reuses the graphs
        compiles = inductor_compiler.cache_info().compiles
        x, b = torch.randn(M + 9, N, requires_grad=True), torch.randn(N, requires_grad=True)
        with _seeded():
            y = fused_bias_act_dropout(x, b, "identity", 0.5, backend="inductor")
        with _seeded():
            assert torch.equal(y, fused_bias_act_dropout(x, b, "identity", 0.5, backend="eager"))
        assert inductor_compiler.cache_info().compiles == compiles


# ----------------------------------------------------------------------------- fused_linear


def _fused_linear_case(backend: str, activation: str = "relu", dtype=torch.float32, bias: bool = True,
                       needs=(True, True, True), transposed: bool = False):
    tensors = {
        "x": _x(K, dtype, transposed),
        "weight": torch.randn(N, K, dtype=dtype) / K**0.5,
        "bias": torch.randn(N, dtype=dtype) if bias else None,
    }
    needs = dict(zip(tensors, needs))
    grad_y = torch.randn(M, N, dtype=dtype)
    got = _run(fused_linear, backend, tensors, needs, grad_y, activation)
    want = _run(fused_linear, "eager", tensors, needs, grad_y, activation)

    def reference(x, w, b):
        return linear_spec.reference(x, w, b, activation, upcast=True)

    return got, want, _reference_grads(reference, tensors, needs, grad_y)


@pytest.mark.parametrize("backend", COMPILED)
def test_fused_linear_each_change_gets_its_own_compiled_function(backend):
    exact = {"x", "weight", "bias"} if backend == "nvfuser" else {"x", "weight"}
    bad = []
    for label, change in [
        ("relu", {}),
        ("activation=identity", dict(activation="identity")),
        ("dtype=bfloat16", dict(dtype=torch.bfloat16)),
        ("bias=None", dict(bias=False)),
        ("no grad", dict(needs=(False, False, False))),
        ("grad of x only", dict(needs=(True, False, False))),
        ("transposed x", dict(transposed=True)),
    ]:
        got, want, ref = _fused_linear_case(backend, **change)
        bad += _compare(label, backend, got, want, exact, ref)
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- concurrent first calls

_CONCURRENT = """
import sys, threading, traceback, warnings
import torch
import torch._inductor.config
from dispatch import fused_bias_act_dropout

if not torch.cuda.is_available():
    torch._inductor.config.cpp.simdlen = 0  # scalar C++, as in conftest: no vector-ISA probe
THREADS = 8
backend, activations = sys.argv[1], sys.argv[2].split(",")
acts = [activations[i % len(activations)] for i in range(THREADS)]  # threads share kinds, too
xs, b = [torch.randn(16, 8) for _ in range(THREADS)], torch.randn(8)
expected = [fused_bias_act_dropout(xs[i], b, acts[i], backend="eager") for i in range(THREADS)]
filters, config = list(warnings.filters), torch._dynamo.config.get_config_copy()
barrier = threading.Barrier(THREADS)
results, errors = [None] * THREADS, []

def first_call(i):
    try:
        barrier.wait()
        results[i] = fused_bias_act_dropout(xs[i], b, acts[i], backend=backend)
    except BaseException:
        errors.append(traceback.format_exc())

threads = [threading.Thread(target=first_call, args=(i,)) for i in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
wrong = [i for i in range(THREADS) if results[i] is None or not torch.equal(results[i], expected[i])]
changed = [k for k, v in torch._dynamo.config.get_config_copy().items() if v != config[k]]
print(f"{backend}: {len(errors)} exceptions, threads with a wrong or no result: {wrong}, "
      f"dynamo config changed: {changed}, warnings filters restored: {warnings.filters == filters}")
for e in errors[:2]:
    print(e)
sys.exit(1 if errors or wrong or changed or warnings.filters != filters else 0)
"""


@pytest.mark.parametrize(
    "backend, activations",
    [
        ("nvfuser", "identity,relu,silu,gelu"),
        ("inductor", "identity,relu"),  # inductor's gelu differs from eager's in the last bit
    ],
)
def test_concurrent_first_calls_compile_safely_and_match_eager(backend, activations):
    """In a fresh process (nothing compiled yet), eight threads behind a barrier make their first
    calls of the backend at once: every thread gets eager's result, none raises, and the process's
    warnings filters and dynamo config are as they were (first calls patch both for their duration).
    Four kinds on nvfuser, two on inductor (a compile takes it seconds), each shared by several
    threads; no dropout, which would only lengthen each compile. One process per backend: a
    failed nvfuser round leaves FX's tracing state broken for whatever runs after it."""
    result = subprocess.run(
        [sys.executable, "-c", _CONCURRENT, backend, activations],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]


def test_a_long_compile_says_so_once(monkeypatch):
    """A kind's first call that compiles past NOTICE_S gives one CompileNotice naming what compiled and
    how long; its later calls, and quick compiles, say nothing."""
    import warnings

    from dispatch.contracts import compiled as compiled_mod

    monkeypatch.setattr(compiled_mod, "NOTICE_S", 0.0)
    cache = compiled_mod.CompiledCache(lambda: 4)

    def fn(t):
        return t + 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cache.run((fn, "kind"), (torch.ones(2),), lambda: (fn, fn(torch.ones(2))))
    notices = [w for w in caught if issubclass(w.category, compiled_mod.CompileNotice)]
    assert len(notices) == 1 and "test_a_long_compile_says_so_once.<locals>.fn" in str(notices[0].message)
    monkeypatch.setattr(compiled_mod, "NOTICE_S", 3600.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.run((fn, "other"), (torch.ones(2),), lambda: (fn, fn(torch.ones(2))))
    assert not [w for w in caught if issubclass(w.category, compiled_mod.CompileNotice)]
