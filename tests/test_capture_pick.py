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


def test_the_capture_pick_is_the_gpu_time_winner_unless_it_compiles_or_cannot_serve():
    able = {name: [] for name in ("eager", "triton", "inductor", "nvfuser")}
    pick = select.capture_pick
    found, why = pick(heuristics.Choice("eager", "cell", "triton"), able)
    assert found.name == "triton" and why.startswith("the fastest by GPU time alone")
    for compiling in ("inductor", "nvfuser"):
        found, why = pick(heuristics.Choice("eager", "cell", compiling), able)
        assert found is None and f"({compiling}, faster by GPU time alone, would compile inside the capture)" in why
    found, why = pick(heuristics.Choice("eager", "cell", "triton"), {**able, "triton": ["not on this GPU"]})
    assert found is None and "cannot serve this call" in why
    assert pick(heuristics.Choice("eager", "cell", "cutlass9"), able)[0] is None  # not registered here
    assert pick(heuristics.Choice("eager", "cell"), able) == (None, "")  # a GPU-bound cell: no other pick


def test_a_cpu_call_has_no_capture_pick(table_dir):
    """Only CUDA streams capture graphs (and a CPU-only torch raises if asked whether one does): a CPU
    table's host-bound cell with another GPU-time winner runs its own pick, and explain() names no
    backend for capture."""
    table_dir(_table(torch.device("cpu"), "nvfuser", "eager"))
    x = torch.randn(8, N)
    decision = explain("fused_bias_act_dropout", x, None, "gelu", 0.0)
    assert decision.backend.name == "nvfuser" and decision.captured is None
    assert "while a CUDA graph is captured" not in str(decision)
    before = nvfuser_compiler.cache_info().compiles
    y = fused_bias_act_dropout(x, None, "gelu", 0.0)  # nvfuser runs: its first call of this kind compiles
    assert nvfuser_compiler.cache_info().compiles == before + 1
    torch.testing.assert_close(y, fused_bias_act_dropout(x, None, "gelu", 0.0, backend="eager"))


_CAPTURE = """
import json, sys, torch
from dispatch import explain, fused_bias_act_dropout
x = torch.randn(64, 16, device="cuda")
decision = explain("fused_bias_act_dropout", x, None, "gelu", 0.0)
assert decision.backend.name == "eager" and decision.captured.name == "triton", str(decision)
assert "while a CUDA graph is captured: triton" in str(decision)
assert explain("fused_bias_act_dropout", x, None, "gelu", 0.0, backend="eager").captured is None  # asked for
y = fused_bias_act_dropout(x, None, "gelu", 0.0)  # warm-up outside capture: eager runs
assert torch.equal(y, fused_bias_act_dropout(x, None, "gelu", 0.0, backend="eager"))
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


@pytest.mark.gpu
def test_capturing_is_true_exactly_inside_a_capture():
    """The capture question skips the driver on the default stream: it must still answer True inside
    a graph capture (a side stream) and False on the default stream and on an idle side stream."""
    assert not select.capturing()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert not select.capturing()
    seen = []
    graph = torch.cuda.CUDAGraph()
    x = torch.ones(4, device="cuda")
    with torch.cuda.graph(graph):
        seen.append(select.capturing())
        x.add_(1)
    assert seen == [True]
    torch.cuda._sleep(10_000_000)  # kernels queued on the default stream: still not capturing
    assert not select.capturing()
    torch.cuda.synchronize()


def test_capturing_is_false_without_cuda():
    """On a machine without a GPU the question answers False (no CUDA stream exists to capture on)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu test covers it")
    assert select.capturing() is False
