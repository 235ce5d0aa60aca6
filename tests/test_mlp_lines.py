"""benchmarks/mlp_lines.py: a row's line, budget and pass bytes from bench_mlp's numbers, and the verdict
they give; a results file read end to end."""

import importlib
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def mlp_lines(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    return importlib.import_module("mlp_lines")


def _row(block, act, compiled, floor, inner=4096, m=8192, dispatched=None):
    row = {"block": block, "act": act, "M": m, "F": inner}
    row.update({"gpu_us:compile": compiled, "gpu_us:torch.mm": floor})
    if dispatched is not None:
        row["gpu_us:mlp/dispatch"] = dispatched
    return row


def test_a_gate_moves_eight_f_unfused_and_a_plain_activation_five(mlp_lines):
    """F = 8192 x 4096 x 2 B = 67.1 MB; at 1 TB/s one F takes 67.1 us."""
    f_us = 8192 * 4096 * 2 / 1e6
    plain = mlp_lines.line_row(_row("bert-large", "gelu", 900.0, 600.0), tbs=1.0)
    gated = mlp_lines.line_row(_row("qwen2-0.5b", "swiglu", 900.0, 600.0), tbs=1.0)
    assert [plain[k] / f_us for k in ("unfused", "fwd epilogue", "both")] == pytest.approx([5, 4, 2])
    assert [gated[k] / f_us for k in ("unfused", "fwd epilogue", "both")] == pytest.approx([8, 6, 4])


def test_the_line_is_the_tighter_of_compile_and_floor(mlp_lines):
    loose_floor = mlp_lines.line_row(_row("gpt2", "gelu_tanh", 500.0, 300.0), tbs=3.35)
    assert loose_floor["line"] == pytest.approx(min(0.97 * 500, 1.10 * 300))  # 330: the floor's line
    near_compile = mlp_lines.line_row(_row("gpt2", "gelu_tanh", 400.0, 380.0), tbs=3.35)
    assert near_compile["line"] == pytest.approx(0.97 * 400)
    assert near_compile["budget"] == pytest.approx(0.97 * 400 - 380)


def test_llama_has_its_own_floor_line_and_under_the_floor_says_so(mlp_lines):
    r = mlp_lines.line_row(_row("llama-2-7b", "swiglu", 9890.0, 9830.0, inner=11008), tbs=3.35)
    assert r["line"] == pytest.approx(min(0.97 * 9890, 1.03 * 9830))
    assert r["budget"] < 0
    assert mlp_lines.verdict(r).startswith("under the floor")


def test_verdicts_name_the_cheapest_design_that_fits(mlp_lines):
    roomy = mlp_lines.line_row(_row("bert-large", "gelu", 2000.0, 600.0, inner=1024), tbs=3.35)
    assert roomy["unfused"] <= roomy["budget"]  # 25 us of bytes in a 60 us budget
    assert mlp_lines.verdict(roomy) == "fits unfused"
    tight = mlp_lines.line_row(_row("bert-large", "gelu", 848.0, 604.0), tbs=3.35)  # budget 60, both 40
    assert tight["fwd epilogue"] > tight["budget"] >= tight["both"]
    assert mlp_lines.verdict(tight) == "fits both"
    gemma = mlp_lines.line_row(_row("gemma-2b", "geglu_tanh", 7630.0, 7320.0, inner=16384), tbs=3.35)
    assert 0 < gemma["budget"] < gemma["both"]
    assert mlp_lines.verdict(gemma) == "only with epilogues hidden behind the products"


def test_a_results_file_reads_end_to_end_and_an_unknown_card_needs_tbs(mlp_lines, tmp_path, capsys):
    rows = [_row("gpt2", "gelu_tanh", 462.0, 381.0, inner=3072, dispatched=445.0), {"block": "skipped"}]
    path = tmp_path / "bench_mlp.json"
    env = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-06"}
    path.write_text(json.dumps({"environment": env, "rows": rows}))
    assert mlp_lines.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "gpt2" in out and "fits both" in out and "skipped" not in out
    assert "0.963" in out  # dispatch / compile = 445 / 462
    with pytest.raises(ValueError, match="gpu 'Some GPU'.*--tbs"):
        mlp_lines.peak_tbs("Some GPU")
    assert mlp_lines.peak_tbs("Some GPU", 2.0) == 2.0
