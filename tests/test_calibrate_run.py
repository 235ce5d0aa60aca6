"""Calibration through its command line under synthetic clocks (conftest.py's ``clocks``): both clocks
recorded, bisection to the crossover, the max(GPU, host) rule in the table and in explain(), parity
before a win (the GPU-time winner's too), members and dtypes sharing timings, --refit, and plain
PyTorch as a contender that no table's pick may lose to beyond NOISE."""

import json

import pytest
import torch

from dispatch import heuristics
from dispatch import calibrate, cases, explain
from dispatch.calibrate import __main__ as cli
from dispatch.calibrate import plan, report, series
from dispatch import ops
from dispatch.registry import Kernels, backends
from calibration import CPU, args, bad_call, segments
from harness import eager_twin, register


def test_bisection_finds_the_crossover_and_both_clocks_are_recorded(user_dir, clocks, capsys):
    out = user_dir / "t.json"
    assert calibrate.main(args(out, "--budget", "600", "--tables", acts=("gelu", "silu", "identity"),
                               features=("32", "32,16"), ops=("bias_act_dropout", "fused_linear"),
                               backends=("flat", "slow"))) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 2 and {e["activation"] for e in doc["entries"]} == {
        "gelu",
        "silu",
        "identity",
    }
    for e in doc["entries"]:
        (_, a), (cut, b) = segments(e)  # eager = 10 + M / 10, flat = 20 + M / 100 on the GPU: M = 111
        assert (a, b) == ("eager", "flat") and 64 <= cut <= 200, segments(e)
        for p in e["points"]:
            assert p["gpu_us"].keys() == p["host_us"].keys() and plan.BASELINE in p["gpu_us"]
        for s in e["segments"]:
            assert s["clock"] == "gpu" and s["pytorch_us"] and s["errors"][s["backend"]] < 1e-6
    rep = next(e for e in doc["entries"] if e["activation"] == "gelu" and e["op"] == "bias_act_dropout")
    assert len(rep["points"]) > 3 and rep["held_out"]  # bisected; one held-out point
    slow = [p for p in rep["points"] if "slow" in p["gpu_us"]]
    assert [p["m"] for p in slow] == [1024]  # HOPELESS at the first point (the largest M): dropped
    assert doc["self_check"]["points"] > 0 and doc["self_check"]["within_5pct"] == 1.0
    assert heuristics.lookup(bad_call(1000, activation="silu")).backend == "flat"
    assert explain("fused_bias_act_dropout", torch.randn(8, 32), None, "gelu", 0.0).backend.name == "eager"
    printed = capsys.readouterr().out
    assert "self-check" in printed and "flat 4.46x" in printed  # flat at 1024: 1.2 (10 + 102.4) / 30.24


def test_refit_fits_the_raw_points_again(user_dir, clocks, capsys):
    """python -m dispatch.calibrate --refit: the same segments from the same points by the same rule (a CPU
    document: no host smoothing), the refit noted, the slim table written; a slim table is refused."""
    out, slim = user_dir / "t.json", user_dir / "slim" / "t.json"
    assert calibrate.main(args(out, "--budget", "600", acts=("gelu",), features=("32",),
                               ops=("bias_act_dropout",), backends=("flat", "slow"))) == 0  # fmt: skip
    before = json.loads(out.read_text())
    assert calibrate.main(["--refit", str(out), "--slim-out", str(slim)]) == 0
    after = json.loads(out.read_text())
    assert [e["segments"] for e in after["entries"]] == [e["segments"] for e in before["entries"]]
    assert after["settings"]["refit"]["rule"] == "plan.fit" and "self-check" in capsys.readouterr().out
    with pytest.raises(ValueError, match="slim"):
        report.refit(json.loads(slim.read_text()))


def test_host_cost_decides_where_it_exceeds_gpu_time_and_explain_says_so(user_dir, clocks):
    """flat's host cost is 60 us a call: below M = 400 that exceeds both its GPU time and eager's cost,
    so eager keeps those calls although flat's GPU time is shorter from M = 111; explain() names the
    clock that decided and the speedup over plain PyTorch."""
    gpu, host, _ = clocks
    host["flat"] = lambda m: 60.0
    host["eager"] = lambda m: 15.0
    out = user_dir / "t.json"
    assert calibrate.main(args(out, tokens=("1", "64", "4096"))) == 0
    e = next(e for e in heuristics.load_table(str(out)).data["entries"] if not e["dropout"])
    # segments split where the binding clock or the winner by GPU time alone changes: eager host-bound
    # (M = 1: 15 > 10.1 us), eager GPU-bound, the same with flat faster by GPU time alone (from M = 111),
    # flat host-bound (60 us > 20 + M / 100), flat GPU-bound (M = 4096: 61 > 60 us)
    assert [(s["backend"], s["clock"], s["gpu_backend"]) for s in e["segments"]] == [
        ("eager", "host", "eager"),
        ("eager", "gpu", "eager"),
        ("eager", "gpu", "flat"),
        ("flat", "host", "flat"),
        ("flat", "gpu", "flat"),
    ]
    # flat's GPU time beats eager's from M = 111, eager's cost reaches flat's 60 us at M = 500; quick
    # bisects to within 4x
    assert 28 <= e["segments"][2]["m_from"] <= 444, segments(e)
    cut = e["segments"][3]["m_from"]
    assert 400 <= cut <= 2000, segments(e)
    near_cut = [p for p in e["points"] if 111 < p["m"] < cut]
    assert near_cut and all(
        plan.rank({n: p["gpu_us"][n] for n in ("eager", "flat")})[0] == "flat" for p in near_cut
    )
    text = str(explain("fused_bias_act_dropout", torch.randn(1, 32), None, "gelu", 0.0))
    assert (
        "host-bound: host cost 15 us exceeds GPU time 10 us at M=1" in text and "x plain PyTorch" in text
    ), text
    text = str(explain("fused_bias_act_dropout", torch.randn(4096, 32), None, "gelu", 0.0))
    assert "runs on: flat" in text and "GPU-bound: GPU time 61 us > host 60 us" in text, text
    assert "max(GPU time, host cost)" in text


def test_a_backend_that_fails_parity_never_wins(user_dir, clocks, monkeypatch):
    """'wrong' is the fastest on both clocks but its output is 1% off: it is checked where it would win,
    fails, and the table keeps eager and flat."""
    from dispatch.backends.eager import bias_act_dropout as eager_bad

    gpu, host, _ = clocks
    op = Kernels(lambda *a: eager_bad.forward(*a) * 1.01, eager_bad.backward, lambda *a: eager_bad.forward(*a) * 1.01)
    register(monkeypatch, eager_twin("wrong", kernels={**backends()["eager"].kernels, "bias_act_dropout": op}))
    gpu["wrong"], host["wrong"] = (lambda m: 1.0), (lambda m: 1.0)
    out = user_dir / "t.json"
    assert calibrate.main(args(out, backends=("flat", "wrong"))) == 0
    e = next(e for e in heuristics.load_table(str(out)).data["entries"] if not e["dropout"])
    assert [b for _, b in segments(e)] == ["eager", "flat"]
    assert any("tolerance" in p["rejected"].get("wrong", "") for p in e["points"])


def test_the_gpu_time_winner_is_parity_checked_too(user_dir, clocks, monkeypatch):
    """'wrong' and 'gpu' are fastest on the GPU clock alone (in that order) and lose on cost (their
    host cost is 1000x): each is checked where it is the captured pick; 'wrong' (1% off) fails and is
    never named, 'gpu' passes and is the gpu_backend of the segments where it was timed."""
    from dispatch.backends.eager import bias_act_dropout as eager_bad

    gpu, host, _ = clocks
    op = Kernels(lambda *a: eager_bad.forward(*a) * 1.01, eager_bad.backward, lambda *a: eager_bad.forward(*a) * 1.01)
    register(monkeypatch, eager_twin("wrong", kernels={**backends()["eager"].kernels, "bias_act_dropout": op}), eager_twin("gpu"))
    gpu["wrong"], host["wrong"] = (lambda m: 0.5), (lambda m: 5000.0)
    gpu["gpu"], host["gpu"] = (lambda m: 1.0), (lambda m: 5000.0)
    out = user_dir / "t.json"
    assert calibrate.main(args(out, backends=("flat", "wrong", "gpu"))) == 0
    e = next(e for e in heuristics.load_table(str(out)).data["entries"] if not e["dropout"])
    timed = [p for p in e["points"] if "gpu" in p["gpu_us"]]
    assert timed and all("gpu" in p["err"] for p in timed)
    for seg in e["segments"]:
        inside = [p for p in timed if p["m"] == seg["m"]]
        assert seg["backend"] != "gpu" and seg["gpu_backend"] == ("gpu" if inside else seg["gpu_backend"])
    named = {s["gpu_backend"] for s in e["segments"]}
    assert "wrong" not in named and "gpu" in named
    assert any("tolerance" in p["rejected"].get("wrong", "") for p in e["points"])
    inductor = {"m": 1, "gpu_us": {"eager": 10.0, "triton": 8.0, "inductor": 5.0},
                "host_us": {"eager": 20.0, "triton": 40.0, "inductor": 900.0}}  # fmt: skip
    assert "inductor" in plan.compiling() and plan.gpu_winner(inductor) == "triton"


def test_members_keep_the_timings_of_the_backends_that_serve_them(user_dir, clocks, monkeypatch):
    """'lt' serves gelu_tanh only (as cuBLASLt's GELU epilogue) and is fastest: gelu_tanh's entry picks
    it; gelu shares gelu_tanh's timings but never sees it, and each of its segments was checked at its
    own activation."""
    gpu, host, _ = clocks
    register(monkeypatch, eager_twin("lt", activations=frozenset({"gelu_tanh"})))
    gpu["lt"], host["lt"] = (lambda m: 1.0), (lambda m: 1.0)
    out = user_dir / "t.json"
    assert calibrate.main(args(out, ops=("fused_linear",), acts=("gelu_tanh", "gelu"), features=("32,16",),
                               backends=("flat", "lt"))) == 0  # fmt: skip
    entries = {e["activation"]: e for e in heuristics.load_table(str(out)).data["entries"]}
    assert entries["gelu"]["measured_as"] == "gelu_tanh"
    assert [b for _, b in segments(entries["gelu_tanh"])] == ["lt"]
    member = entries["gelu"]
    assert all(p["gpu_us"] and "lt" not in p["gpu_us"] for p in member["points"])
    assert [b for _, b in segments(member)] == ["eager", "flat"]
    assert all(s["errors"] for s in member["segments"])


def test_a_dtype_can_share_another_dtypes_timings(user_dir, clocks, monkeypatch):
    """As float16 shares bfloat16's timings on a GPU: here bfloat16 shares float32's, its entries say
    so and each is parity-checked in bfloat16."""
    default = cli.default_plan

    def shared(device, quick, budget, op_names=None):
        p = default(device, quick, budget, op_names)
        p.shared = {torch.float32: (torch.bfloat16,)}
        return p

    monkeypatch.setattr(cli, "default_plan", shared)
    out = user_dir / "t.json"
    assert calibrate.main(args(out)) == 0
    entries = {e["dtype"]: e for e in heuristics.load_table(str(out)).data["entries"]}
    assert set(entries) == {"float32", "bfloat16"} and entries["bfloat16"]["measured_dtype"] == "float32"
    assert segments(entries["bfloat16"]) == segments(entries["float32"])
    assert all(s["errors"] for s in entries["bfloat16"]["segments"])
    call = bad_call(8, dtype=torch.bfloat16)
    choice = heuristics.lookup(call)
    assert "timings shared with gelu float32" in choice.description


# ----------------------------------------------------------------------------- plain PyTorch, a contender


def test_a_table_never_picks_a_backend_slower_than_pytorch_beyond_noise(
    user_dir, clocks, monkeypatch, capsys
):
    """Plain PyTorch is 1.25-2x faster than eager and 1.3x faster than 'mid' (each of which a table
    without it would have picked at small M); flat overtakes them all from M = 300. At every measured and
    held-out point of every entry, the table's pick costs at most (1 + NOISE) times plain PyTorch:
    PyTorch wins the small M at 1.00x, flat the large M; the choice tables print PyTorch's cells at
    1.00x."""
    gpu, host, _ = clocks
    register(monkeypatch, eager_twin("mid"))
    gpu[plan.BASELINE], host[plan.BASELINE] = (lambda m: 8 + 0.05 * m), (lambda m: 5.0)
    gpu["mid"], host["mid"] = (lambda m: 1.3 * (8 + 0.05 * m)), (lambda m: 5.0)
    out = user_dir / "t.json"
    tokens = ("1", "16", "256", "1024", "4096")
    assert calibrate.main(args(out, "--tables", modes=("inference", "training"), tokens=tokens,
                               backends=("flat", "mid"))) == 0  # fmt: skip
    table = heuristics.load_table(str(out))
    checked = 0
    for e in table.data["entries"]:
        assert {s["backend"] for s in e["segments"]} == {plan.BASELINE, "flat"}, segments(e)
        for p in e["points"] + e["held_out"]:
            c = plan.costs(p)
            spec = ops.get(e["op"])
            call = spec.call(CPU, torch.float32, (p["m"], *e["features"]), e["mode"] == "training",
                             **{t: e[t] for t in spec.traits})  # fmt: skip
            pick = table.choose(call).backend
            assert c[pick] <= (1 + plan.NOISE) * c[plan.BASELINE], (p, pick)
            checked += 1
        base = [s for s in e["segments"] if s["backend"] == plan.BASELINE]
        assert base[0]["m_from"] == 1 and all(s["speedup"] == 1.0 for s in base)
        assert all(plan.BASELINE in s["errors"] for s in base)  # gated like every winner
    assert checked >= 4 * 5
    assert "pytorch 1.00x" in capsys.readouterr().out


def test_pytorch_failing_its_gate_wins_nothing_and_still_sets_the_speedups(user_dir, clocks, monkeypatch):
    """Plain PyTorch is the cheapest everywhere but fails its parity gate: eager and flat keep the table,
    and every segment still has its speedup over plain PyTorch, whose timings the points keep."""
    gpu, host, _ = clocks
    gpu[plan.BASELINE] = lambda m: 1.0
    real = cases.gate
    monkeypatch.setattr(cases, "gate", lambda name, *a: cases.Gate(False, None, "broken here")
                        if name == plan.BASELINE else real(name, *a))  # fmt: skip
    out = user_dir / "t.json"
    assert calibrate.main(args(out)) == 0
    for e in heuristics.load_table(str(out)).data["entries"]:
        assert [b for _, b in segments(e)] == ["eager", "flat"]
        assert all(s["speedup"] and s["speedup"] < 1 and s["pytorch_us"] for s in e["segments"])
        assert any(p["rejected"].get(plan.BASELINE) == "broken here" for p in e["points"])
        assert all(plan.BASELINE in p["gpu_us"] for p in e["points"])


def test_pytorch_is_timed_once_and_first():
    """The registry lists a backend named pytorch too: a point names it once, first, --backends or not."""
    p = plan.default_plan(CPU, True, 10.0, ["bias_act_dropout"])
    fam = plan.Family("bias_act_dropout", torch.float32, "inference", False)
    case = cases.case("bias_act_dropout", torch.float32, "gelu", False, False, 4, (32,), CPU)
    for only in (None, frozenset({"eager", plan.BASELINE}), frozenset({"eager"})):
        names = series.Measurer(p, only, lambda: 1.0, None).names(case)
        assert names[0] == plan.BASELINE and names.count(plan.BASELINE) == 1 and "eager" in names, names
    assert plan.BASELINE in backends() and fam.label == "bias_act_dropout float32 inference"


def test_a_torch_mask_backend_is_checked_with_the_mask_it_drew():
    """Plain PyTorch's masks are torch's: its gate replays them from the run's seeded generator, both
    of fused_mlp's (hidden, then output) and bias_act_dropout's, even in bfloat16 where x + b == 0
    exactly at a few elements (there y cannot tell a dropped element from a kept one)."""
    mlp = cases.case("fused_mlp", torch.float32, "gelu", True, True, 5, (8, 16), CPU)
    got = cases.gate(plan.BASELINE, mlp, *cases.inputs(mlp))
    assert got.passed and got.error < 1e-4 and got.why == "", got
    for dtype, act in ((torch.float32, "gelu"), (torch.bfloat16, "identity")):
        case = cases.case("bias_act_dropout", dtype, act, True, True, 64, (4096,), CPU)
        got = cases.gate(plan.BASELINE, case, *cases.inputs(case))
        assert got.passed and got.why == "", got
