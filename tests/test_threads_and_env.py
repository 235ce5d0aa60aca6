"""Concurrency of the dispatcher's first calls and caches, and the environment's settings as a user
sees them: an invalid DISPATCH_BACKEND, a table naming an unknown backend, ``python -m dispatch.info``."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

from dispatch import heuristics
from dispatch import explain, fused_bias_act_dropout, fused_linear, select

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env,
        timeout=300, cwd=ROOT,
    )  # fmt: skip


def test_eight_threads_first_calls_in_a_fresh_process():
    """Eight threads released together make the process's first calls: every one must get eager's
    result (a half-filled registry gave KeyError 'eager' or 'dictionary changed size')."""
    result = _fresh_python(
        """
        import threading, torch
        import torch.nn.functional as F
        from dispatch import fused_bias_act_dropout, fused_linear  # imports no backend yet
        acts = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "identity": lambda t: t}
        n = 8
        barrier, errors, ok = threading.Barrier(n), [], []
        x, b, w, wb = torch.randn(6, 5), torch.randn(5), torch.randn(4, 5), torch.randn(4)
        def worker(i):
            try:
                barrier.wait()
                act = list(acts)[i % 4]
                y = fused_bias_act_dropout(x, b, act, 0.0) if i % 2 else fused_linear(x, w, wb, act)
                want = acts[act](x + b) if i % 2 else acts[act](F.linear(x, w, wb))
                torch.testing.assert_close(y, want)
                ok.append(i)
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads: t.start()
        for t in threads: t.join()
        print("errors", errors)
        assert not errors and len(ok) == n
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_decision_cache_cleared_by_other_threads():
    """Calls go on while other threads clear the decision cache: each call still gets its result (a
    re-read of the cache after deciding gave KeyError)."""
    x, b = torch.randn(3, 8), torch.randn(8)
    want = fused_bias_act_dropout(x, b, "relu", 0.0, backend="eager")
    stop, errors = threading.Event(), []

    def clearer():
        while not stop.is_set():
            select.clear_cache()

    def caller():
        try:
            for _ in range(300):
                torch.testing.assert_close(fused_bias_act_dropout(x, b, "relu", 0.0), want)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=clearer)] + [threading.Thread(target=caller) for _ in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads every few bytecodes: the race window is a few long
    try:
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
    finally:
        stop.set()
        threads[0].join()
        sys.setswitchinterval(interval)
    assert not errors, errors


class _ClearedRightAfterWrite(dict):
    """A decision cache that another thread empties the moment a decision is stored in it."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        select.clear_cache()


def test_decision_cache_cleared_right_after_a_decision(monkeypatch):
    """The worst interleaving of the test above, made deterministic: the caller must use the value it
    decided, not read it back from a cache that may be empty by then."""
    monkeypatch.setattr(select, "_cache", _ClearedRightAfterWrite())
    x, b, w = torch.randn(3, 8), torch.randn(8), torch.randn(5, 8)
    torch.testing.assert_close(fused_bias_act_dropout(x, b, "relu", 0.0), torch.relu(x + b))
    torch.testing.assert_close(fused_linear(x, w, None, "relu"), torch.relu(x @ w.T))


def test_invalid_dispatch_backend_names_the_variable(monkeypatch):
    monkeypatch.setenv("DISPATCH_BACKEND", "cudnn")
    select.clear_cache()
    try:
        with pytest.raises(ValueError, match=r"backend must be one of pytorch.*got 'cudnn' \(from DISPATCH_BACKEND\)"):
            fused_bias_act_dropout(torch.randn(2, 4), None, "gelu")
    finally:
        monkeypatch.delenv("DISPATCH_BACKEND")
        select.clear_cache()


def test_table_naming_an_unknown_backend_warns_once(tmp_path, monkeypatch):
    slug = heuristics.device_info(torch.device("cpu"))["slug"]
    seg = [{"m_from": 1, "backend": "cutlass9", "runner_up": None, "margin": None}]
    table = {
        "schema_version": heuristics.SCHEMA_VERSION,
        "device": {"type": "cpu", "name": "this cpu", "slug": slug},
        "versions": heuristics.running_versions(),
        "entries": [
            {"op": "bias_act_dropout", "dtype": "float32", "activation": a, "mode": "inference",
             "dropout": False, "features": [16], "segments": seg}
            for a in ("gelu", "relu")
        ],
    }  # fmt: skip
    (tmp_path / f"{slug}.json").write_text(json.dumps(table))
    monkeypatch.setenv(heuristics.ENV_DIR, str(tmp_path))
    heuristics.reload()
    select.clear_cache()
    try:
        x = torch.randn(4, 16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for act in ("gelu", "relu", "gelu"):
                y = fused_bias_act_dropout(x, None, act, 0.0)
                torch.testing.assert_close(y, fused_bias_act_dropout(x, None, act, 0.0, backend="eager"))
        ours = [w for w in caught if issubclass(w.category, heuristics.HeuristicsWarning)]
        assert len(ours) == 1, [str(w.message) for w in ours]
        assert "cutlass9" in str(ours[0].message) and str(tmp_path) in str(ours[0].message)
        decision = explain("fused_bias_act_dropout", x, None, "gelu", 0.0)
        assert decision.backend.name == "pytorch" and "not a registered backend" in decision.rule
    finally:
        heuristics.reload()
        select.clear_cache()


def test_info_shows_the_environment_variables(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dispatch.info", "--device", "cpu"], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": ROOT, "DISPATCH_BACKEND": "eager", "DISPATCH_HEURISTICS_DIR": str(tmp_path)},
        timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "DISPATCH_BACKEND: eager" in result.stdout
    assert f"DISPATCH_HEURISTICS_DIR: {tmp_path}" in result.stdout


def test_fused_linear_from_threads_agree():
    """Many threads deciding the same new keys at once all get the same numbers."""
    x, w = torch.randn(5, 7), torch.randn(3, 7)
    want = fused_linear(x, w, None, "silu", backend="eager")
    select.clear_cache()
    results, barrier = [], threading.Barrier(6)

    def worker():
        barrier.wait()
        results.append(fused_linear(x, w, None, "silu"))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6
    for y in results:
        torch.testing.assert_close(y, want)
