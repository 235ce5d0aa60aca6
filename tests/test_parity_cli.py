"""python -m dispatch.parity: its quick mode passes on working backends and fails on a broken one; its
verdict counts the groups that did not run, with the cause.

The compiling backends (nvfuser, inductor) are left out here: on 2 CPU cores their compiles take
minutes for the quick grid, and their own test files check them against the same reference. The
Triton interpreter is in (conftest sets TRITON_INTERPRET=1 without a GPU).
"""

import os

import pytest
import torch

from dispatch.backends.eager import bias_act_dropout as eager_bad
from dispatch import ops, parity, select
from dispatch.registry import Kernels, backends
from harness import eager_twin, register


@pytest.fixture
def clean_cache():
    select.clear_cache()
    yield
    select.clear_cache()


def twin(name, forward=None, backward=None):
    """A backend that is eager except for the given bias_act_dropout functions."""
    forward = forward or eager_bad.forward
    op = Kernels(forward=forward, backward=backward or eager_bad.backward, inference=forward)
    kernels = {**backends()["eager"].kernels, "bias_act_dropout": op}
    return eager_twin(name, "test twin", kernels=kernels, dtypes=frozenset({torch.float32, torch.bfloat16}))


def test_quick_passes(capsys, clean_cache):
    names = ["eager"] + (
        ["triton"] if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available() else []
    )
    assert parity.main(["--quick", "--backends", *names]) == 0
    out = capsys.readouterr().out
    for name in names:
        for op in ("bias_act_dropout", "fused_linear"):
            for dtype in ("float32", "bfloat16", "float16"):
                assert any(
                    line.split()[:3] == [name, op, dtype] and line.rstrip().endswith("PASS")
                    for line in out.splitlines()
                ), (name, op, dtype)
    assert "FAIL" not in out


def test_wrong_forward_fails(capsys, monkeypatch, clean_cache):
    def forward(x, bias, activation, p, rng):
        return eager_bad.forward(x, bias, activation, p, rng) * 1.01

    register(monkeypatch, twin("broken", forward=forward))
    assert parity.main(["--quick", "--backends", "eager", "broken"]) == 1
    out = capsys.readouterr().out
    assert "FAIL broken bias_act_dropout float32" in out and "y " in out
    assert "skipped broken" in out  # float16 and float64 are not declared: skipped with the reason


def test_wrong_gradient_and_crash_fail(capsys, monkeypatch, clean_cache):
    def backward(grad_y, x, bias, activation, p, rng, need_x, need_bias):
        gx, gb = eager_bad.backward(grad_y, x, bias, activation, p, rng, need_x, need_bias)
        return gx, None if gb is None else gb + 1.0

    def forward(*args):
        raise RuntimeError("kernel exploded")

    register(monkeypatch, twin("badgrad", backward=backward), twin("crash", forward=forward))
    assert parity.main(["--quick", "--backends", "badgrad", "crash"]) == 1
    out = capsys.readouterr().out
    assert "FAIL badgrad bias_act_dropout float32" in out and "grad_bias" in out
    assert "RuntimeError: kernel exploded" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("badgrad", "crash"))]
    assert all(r[-1] == "PASS" for r in rows if r[1] == "fused_linear")  # the eager fused_linear is fine


@pytest.mark.gpu
@pytest.mark.long
def test_quick_passes_for_every_backend_on_gpu(capsys, clean_cache):
    """Every backend that compiles nothing per kind of call (inductor and nvfuser take minutes of
    compiles for the quick grid; their test files check them against the same reference)."""
    names = ["pytorch", "eager", "cublaslt", "triton", "composed"]
    assert parity.main(["--quick", "--backends", *names, "--budget", "0"]) == 0, capsys.readouterr().out


def test_summary_counts_the_groups_not_run():
    """The verdict counts only groups that ran as passing, and says how many did not run, and why."""
    ran = [parity.Row("eager", op, "float32") for op in ("bias_act_dropout", "fused_linear")]
    unrun = {("inductor", op, "float32"): {parity.BUDGET} for op in ("bias_act_dropout", "fused_linear")}
    unrun[("inductor", "fused_linear", "bfloat16")] = {parity.BUDGET}
    line = "2/2 run groups (backend x op x dtype) pass; 3 groups not run (inductor: budget)"
    assert parity.summary(ran, unrun) == line
    ran.append(parity.Row("triton", "fused_linear", "float32", failures=["y 2.00x the tolerance"]))
    unrun[("triton", "fused_linear", "float32")] = {parity.BUDGET}
    unrun[("triton", "fused_linear", "float64")] = {parity.UNSUPPORTED}
    assert parity.summary(ran, unrun) == (
        "2/3 run groups (backend x op x dtype) pass; "
        "4 groups not run (inductor: budget; triton: not supported); "
        "1 group cut short by the budget (triton: budget)"
    )


def test_budget_spent_is_in_the_verdict(capsys, monkeypatch, clean_cache):
    """A backend stopped by --budget after its first case: its other groups are counted as not run."""
    register(monkeypatch, twin("slow"))
    assert parity.main(["--quick", "--backends", "eager", "slow", "--budget", "1e-9"]) == 0
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict.startswith("passed on ")
    groups = 4 * len(ops.names())  # every op's quick grid covers the four dtypes: eager runs them all
    assert verdict.endswith(
        f": {groups + 1}/{groups + 1} run groups (backend x op x dtype) pass; {groups - 1} groups not run "
        "(slow: budget, not supported); 1 group cut short by the budget (slow: budget)"
    )


def test_pytorch_backend_passes_in_every_dtype(capsys, clean_cache):
    """pytorch's dropout is torch's: its parity reference replays torch's mask with F.dropout's scale
    1 / (1 - p), not the spec's 65536 / (65536 - T) (2**-16 apart: float64 failed by 5e4x)."""
    assert parity.main(["--quick", "--backends", "pytorch"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for op in ("bias_act_dropout", "fused_linear", "fused_mlp"):
        assert any(line.split()[:3] == ["pytorch", op, "float64"] and line.rstrip().endswith("PASS")
                   for line in out.splitlines()), op  # fmt: skip


def test_a_picked_backend_cut_by_the_budget_is_incomplete(capsys, monkeypatch, clean_cache):
    """Where this device's table picks a backend whose cases the budget cut, the verdict is not
    'passed': 'incomplete', exit code 2, with the command that checks it fully."""
    register(monkeypatch, twin("slow"))
    monkeypatch.setattr(parity, "picked_backends", lambda device: {"slow", "pytorch"})
    assert parity.main(["--quick", "--backends", "eager", "slow", "--budget", "1e-9"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("incomplete on ")
    assert out[-1].startswith("incomplete: this device's table picks slow") and "--budget 0" in out[-1]


def test_picked_backends_reads_the_table(user_dir):
    from dispatch import heuristics
    from table_docs import valid_document

    heuristics.save_table(valid_document(), os.path.join(str(user_dir), heuristics.device_info(
        torch.device("cpu"))["slug"] + ".json"))  # fmt: skip
    heuristics.reload()
    assert parity.picked_backends(torch.device("cpu")) >= {"eager"}
