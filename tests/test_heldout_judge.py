"""The held-out judge (benchmarks/bench_heldout.py): its scores and diagnostics on synthetic rows."""

import importlib
import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def evaluate(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # the benchmarks import their ``common`` as scripts do
    return importlib.import_module("bench_heldout")


def test_the_held_out_judge_reports_capture_runnable_scores_and_its_own_noise(evaluate):
    """Two calls: at the first inductor (which a capture never runs) is fastest, triton the fastest a
    capture may run and eager the pick; at the second eager and PyTorch run the same ops. The summary
    scores against every backend; the diagnostics against the capturable ones, and the A/A spread."""
    def row(act, us, pick="eager"):
        t = {n: {"gpu": g, "host": 10.0, "wall": g} for n, g in us.items()}
        return {"model": "m", "op": "fused_linear", "mode": "inference", "m": 256, "features": [8, 8],
                "activation": act, "pick": pick, "captured_pick": None, "us": t,
                "score": evaluate.score(t, pick)}  # fmt: skip

    rows = [
        row("gelu", {"eager": 120.0, "triton": 100.0, "inductor": 80.0, "pytorch": 120.0}),
        row("relu", {"eager": 103.0, "triton": 110.0, "pytorch": 100.0}),
    ]
    assert rows[0]["score"]["gpu_ratio"] == pytest.approx(1.5)
    assert rows[0]["score"]["fastest_gpu"] == "inductor"
    lines, ok = evaluate.summary(rows)
    assert not ok and lines[-1][3] == "50%" and lines[-1][4] == "1.500x"
    capture, noise = evaluate.diagnostics(rows)
    assert capture.endswith("a capture may run: 50.0% within 5%, worst 1.200x (2 calls)")
    assert noise.endswith("1.000-1.030x (2 calls)")



def test_plain_pytorch_is_scored_as_a_contender(evaluate):
    """Plain PyTorch as the pick scores 1.00x against itself; as the fastest it is what a pick is held
    to, on GPU time and under capture alike."""
    t = {n: {"gpu": g, "host": 10.0, "wall": g} for n, g in {"eager": 130.0, "pytorch": 100.0}.items()}
    own = evaluate.score(t, "pytorch")
    assert own["gpu_ratio"] == own["vs_pytorch_gpu"] == own["vs_pytorch_wall"] == 1.0
    assert own["fastest_gpu"] == "pytorch" and own["wall_ok"]
    other = evaluate.score(t, "eager")
    assert other["gpu_ratio"] == pytest.approx(1.3) and not other["wall_ok"]
    rows = [{"op": "fused_linear", "activation": "gelu", "pick": "eager", "captured_pick": None, "us": t,
             "score": other}]  # fmt: skip
    assert evaluate.diagnostics(rows)[0].endswith("0.0% within 5%, worst 1.300x (1 calls)")
