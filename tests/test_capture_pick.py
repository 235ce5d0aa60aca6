"""Calls captured in a CUDA graph run the table cell's GPU-time winner where the cell is host-bound: a
captured call's host cost is paid once, at capture, and every replay costs GPU time alone. explain()
says which backend runs under capture and why; a backend that compiles per kind of call is never
first called inside a capture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dispatch import explain, fused_bias_act_dropout, heuristics, select
from dispatch.backends.inductor import compiler as inductor_compiler
from dispatch.backends.nvfuser import compiler as nvfuser_compiler

ROOT = Path(__file__).resolve().parents[1]
N = 16


def _table(device: torch.device, backend: str, gpu_backend: str) -> dict:
    """A one-cell table for ``device``: bias_act_dropout float32 gelu inference, N = 16, every M."""
    info = heuristics.device_info(device)
    seg = {"m_from": 1, "backend": backend, "runner_up": gpu_backend, "margin": 0.2, "m": 64, "clock": "host",
           "gpu_backend": gpu_backend, "gpu_us": {backend: 9.0, gpu_backend: 3.0},
           "host_us": {backend: 40.0, gpu_backend: 60.0}}  # fmt: skip
    entry = {"op": "bias_act_dropout", "dtype": "float32", "activation": "gelu", "mode": "inference",
             "dropout": False, "features": [N], "segments": [seg]}  # fmt: skip
    return {"schema_version": heuristics.SCHEMA_VERSION, "device": {**info, "name": "test device"},
            "versions": heuristics.running_versions(), "entries": [entry]}  # fmt: skip


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """Tables written into a fresh user directory apply; the caches are cleared before and after."""

    def write(table: dict) -> None:
        (tmp_path / f"{table['device']['slug']}.json").write_text(json.dumps(table))
        heuristics.reload()
        select.clear_cache()

    monkeypatch.setenv(heuristics.ENV_DIR, str(tmp_path))
    yield write
    monkeypatch.undo()
    heuristics.reload()
    select.clear_cache()


def test_a_host_bound_cell_runs_its_gpu_time_winner_under_capture(table_dir, monkeypatch):
    table_dir(_table(torch.device("cpu"), "nvfuser", "eager"))
    x = torch.randn(8, N)
    decision = explain("fused_bias_act_dropout", x, None, "gelu", 0.0)
    assert decision.backend.name == "nvfuser" and decision.captured.name == "eager"
    assert "while a CUDA graph is captured: eager, the fastest by GPU time alone" in str(decision)
    # which backend ran: nvfuser compiles on its first call of a kind, eager compiles nothing
    before = nvfuser_compiler.cache_info().compiles
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    y = fused_bias_act_dropout(x, None, "gelu", 0.0)
    assert nvfuser_compiler.cache_info().compiles == before
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    y_host = fused_bias_act_dropout(x, None, "gelu", 0.0)
    assert nvfuser_compiler.cache_info().compiles == before + 1
    torch.testing.assert_close(y, y_host)
    torch.testing.assert_close(y, fused_bias_act_dropout(x, None, "gelu", 0.0, backend="eager"))


def test_a_compiling_winner_is_not_first_called_inside_a_capture(table_dir, monkeypatch):
    table_dir(_table(torch.device("cpu"), "eager", "inductor"))
    x = torch.randn(8, N)
    decision = explain("fused_bias_act_dropout", x, None, "gelu", 0.0)
    assert decision.backend.name == "eager" and decision.captured is None
    assert "as outside it (inductor, faster by GPU time alone, would compile inside the capture)" in str(decision)
    before = inductor_compiler.cache_info().compiles
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fused_bias_act_dropout(x, None, "gelu", 0.0)
    assert inductor_compiler.cache_info().compiles == before


def test_a_requested_backend_and_a_gpu_bound_cell_ignore_capture(table_dir):
    table_dir(_table(torch.device("cpu"), "nvfuser", "eager"))
    x = torch.randn(8, N)
    requested = explain("fused_bias_act_dropout", x, None, "gelu", 0.0, backend="nvfuser")
    assert requested.captured is None and "CUDA graph" not in str(requested)
    same = _table(torch.device("cpu"), "eager", "eager")
    table_dir(same)
    decision = explain("fused_bias_act_dropout", x, None, "gelu", 0.0)
    assert decision.backend.name == "eager" and decision.captured is None and "CUDA graph" not in str(decision)


_CAPTURE = """
import json, sys, torch
from dispatch import explain, fused_bias_act_dropout
x = torch.randn(64, 16, device="cuda")
decision = explain("fused_bias_act_dropout", x, None, "gelu", 0.0)
assert decision.backend.name == "eager" and decision.captured.name == "triton", str(decision)
y = fused_bias_act_dropout(x, None, "gelu", 0.0)  # warm-up outside capture: eager runs
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y_graph = fused_bias_act_dropout(x, None, "gelu", 0.0)  # triton's first call in this process
x.copy_(torch.randn_like(x))
graph.replay()
torch.cuda.synchronize()
want = fused_bias_act_dropout(x, None, "gelu", 0.0, backend="triton")
assert torch.equal(y_graph, want), (y_graph - want).abs().max()
torch.testing.assert_close(y_graph, fused_bias_act_dropout(x, None, "gelu", 0.0, backend="eager"))
print("ok")
"""


@pytest.mark.gpu
def test_triton_first_called_inside_a_capture_replays_its_own_result(tmp_path):
    """In a fresh process (triton never launched), the captured call compiles and launches triton's
    kernel inside the capture; the replay on new data gives triton's result bit for bit."""
    table = _table(torch.device("cuda", torch.cuda.current_device()), "eager", "triton")
    (tmp_path / f"{table['device']['slug']}.json").write_text(json.dumps(table))
    env = {**os.environ, heuristics.ENV_DIR: str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _CAPTURE], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]
