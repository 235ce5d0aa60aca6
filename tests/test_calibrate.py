"""Calibration through its command line: both clocks recorded, the max(GPU, host) rule, bisection to the
crossover, parity before a win, members, per-family budgets, resume and refresh, the choice tables."""

import json
import os
import time

import pytest
import torch

from dispatch import heuristics
from dispatch import calibrate, cases, explain, ops, select
from dispatch import table as table_cli
from dispatch.calibrate import __main__ as cli
from dispatch.calibrate import gate, measure, plan, report, series
from dispatch.calibrate import run as runner
from dispatch.registry import Call, Kernels, backends
from harness import eager_twin, register

CPU = torch.device("cpu")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(heuristics.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(heuristics.catalog, "SHIPPED_DIR", str(tmp_path / "none"))
    heuristics.reload()
    select.clear_cache()
    yield tmp_path
    heuristics.reload()
    select.clear_cache()


@pytest.fixture
def clocks(monkeypatch):
    """Eager twins 'flat' and 'slow' under synthetic clocks, us per call as functions of M: eager's GPU
    time grows 10x faster than flat's, so they cross at M = 111 on the GPU clock; host costs are
    constant. Plain PyTorch takes 1.2x eager's time on both clocks (beyond NOISE: it wins nothing) unless
    a test sets its own. The parity checks stay real (the twins compute what eager does)."""
    register(monkeypatch, eager_twin("flat"), eager_twin("slow"))
    gpu = {"eager": lambda m: 10 + 0.1 * m, "flat": lambda m: 20 + 0.01 * m, "slow": lambda m: 100 + m}
    host = dict.fromkeys(gpu, lambda m: 5.0)
    gpu[plan.BASELINE] = lambda m: 1.2 * gpu["eager"](m)
    host[plan.BASELINE] = lambda m: 1.2 * host["eager"](m)
    delay = {}  # (name, training, dropout) -> seconds the first call at a feature size sleeps (a compile)
    compiled = set()

    def timer(name, case, inp):
        return measure.Timer(lambda: None, [], 1, name, case)

    def first(self, t):
        kind = (t.name, t.case.training, t.case.dropout)
        if (kind, t.case.features, t.case.activation) not in compiled:
            compiled.add((kind, t.case.features, t.case.activation))
            time.sleep(delay.get(kind, 0.0))
        return 0.0

    def sample(self, t, est_ms):
        return measure.Timed(gpu[t.name](t.case.m), host[t.name](t.case.m), "graph", False)

    monkeypatch.setattr(measure, "timer", timer)
    monkeypatch.setattr(measure.Clock, "first", first)
    monkeypatch.setattr(measure.Clock, "estimate_ms", lambda self, t: 0.0)
    monkeypatch.setattr(measure.Clock, "sample", sample)
    return gpu, host, delay


def args(out, *extra, ops=("bias_act_dropout",), modes=("inference",), acts=("gelu",), features=("32",),
         tokens=("1", "16", "1024"), backends=("flat",)):  # fmt: skip
    return ["--quick", "--dtypes", "float32", "--ops", *ops, "--modes", *modes, "--activations", *acts,
            "--features", *features, "--tokens", *tokens, "--backends", "eager", *backends, "--out", str(out),
            *extra]  # fmt: skip


def segments(e):
    return [(s["m_from"], s["backend"]) for s in e["segments"]]


def bad_call(m, n=32, activation="gelu", training=False, dropout=False):
    return Call("bias_act_dropout", CPU, torch.float32, (m, n), activation, dropout, training)


# ----------------------------------------------------------------------------- the rule


def test_rank_breaks_ties_by_preference():
    assert plan.rank({"triton": 1.0, "eager": 1.0 + plan.NOISE / 2, "inductor": 0.99}) == [
        "eager",
        "inductor",
        "triton",
    ]
    assert plan.rank({"triton": 1.0, "eager": 1.0 + 2 * plan.NOISE}) == ["triton", "eager"]
    # plain PyTorch first in both orders: within NOISE the call runs what its user wrote
    for order in (plan.PREFERENCE, plan.PREFERENCE_INFERENCE):
        assert order[0] == plan.BASELINE
        tied = {"cublaslt": 1.0, "eager": 1.0, plan.BASELINE: 1.0 + plan.NOISE / 2}
        assert plan.rank(tied, order)[0] == "pytorch"
        assert plan.rank({"triton": 1.0, plan.BASELINE: 1.0 + 2 * plan.NOISE}, order) == ["triton", "pytorch"]



def test_inference_ties_go_to_cublaslt_and_training_ties_to_eager():
    """Within NOISE, a call without autograd goes to cuBLASLt (its epilogue saves eager's activation
    pass); with autograd to eager (cuBLASLt's training path is a Python Function). Beyond NOISE the
    cheaper backend wins in both modes. Plain PyTorch, out of these ties (2x eager), would take them in
    either mode."""

    def pt(m, eager, cublaslt, torch_=2.0):
        return {"m": m, "gpu_us": {"eager": eager, "cublaslt": cublaslt, "pytorch": torch_ * eager},
                "host_us": {"eager": 1.0, "cublaslt": 1.0, "pytorch": 1.0}, "err": {}}  # fmt: skip

    tied = [pt(64, 100.0, 100.0 * (1 + plan.NOISE / 2)), pt(4096, 1000.0, 1000.0 * (1 - plan.NOISE / 2))]
    inference = plan.fit(tied, plan.preference("inference"))
    training = plan.fit(tied, plan.preference("training"))
    assert [(s["backend"], s["gpu_backend"]) for s in inference] == [("cublaslt", "cublaslt")]
    assert [(s["backend"], s["gpu_backend"]) for s in training] == [("eager", "eager")]
    apart = [pt(64, 100.0, 100.0 * (1 + 2 * plan.NOISE))]
    assert plan.fit(apart, plan.preference("inference"))[0]["backend"] == "eager"
    tied = [pt(64, 100.0, 100.0, torch_=1.0 + plan.NOISE / 2)]
    for mode in ("inference", "training"):
        (seg,) = plan.fit(tied, plan.preference(mode))
        assert (seg["backend"], seg["gpu_backend"], seg["speedup"]) == ("pytorch", "pytorch", 1.0)

def test_bisection_decides_by_the_series_host_costs_on_a_gpu_and_by_the_modes_order():
    """gpt2.up relu inference on the H200: one host sample at M = 4096 made cuBLASLt ("cublaslt") win there as
    at 65536, so the gap went unbisected, while by the series' median host costs (what the table's
    pooled costs decide) eager wins 4096: bisected. On a CPU (host cost = wall time, growing with M)
    each point keeps its own. A tie goes by the mode's order: cuBLASLt first without autograd."""

    def pt(m, eager, lt):
        return {"m": m, "gpu_us": {"eager": eager[0], "cublaslt": lt[0]},
                "host_us": {"eager": eager[1], "cublaslt": lt[1]}}  # fmt: skip

    points = {1: pt(1, (5, 50), (5, 60)), 256: pt(256, (6, 52), (5, 59)), 1024: pt(1024, (13, 51), (10, 60)),
              4096: pt(4096, (45, 52), (32, 40)), 65536: pt(65536, (650, 52), (460, 59))}  # fmt: skip
    assert plan.to_bisect(points, 4.0) == []  # 4096: cuBLASLt by its own host sample (40 < 52)
    assert plan.to_bisect(points, 4.0, pooled=True) == [16384]  # by medians eager (52 < 59)
    tie = {m: pt(m, (10, 20), (10, 20.5)) for m in (1, 256)} | {4096: pt(4096, (100, 20), (60, 20))}
    assert plan.to_bisect(tie, 4.0, plan.PREFERENCE) == [1024]  # eager first: eager at 256, cuBLASLt at 4096
    assert plan.to_bisect(tie, 4.0, plan.PREFERENCE_INFERENCE) == []  # cuBLASLt at every point


def test_the_winner_is_the_cheapest_by_max_of_gpu_time_and_host_cost():
    """At M = 64 'fast' has the shorter GPU time but a host cost above both of eager's clocks: eager wins
    (host-bound 'fast' would idle the GPU); at M = 4096 the GPU time dominates and 'fast' wins. Each
    segment names its clock, the winner by GPU time alone, and its speedup over plain PyTorch."""

    def pt(m, eager, fast, torch_):
        return {"m": m, "gpu_us": {"eager": eager[0], "fast": fast[0], "pytorch": torch_[0]},
                "host_us": {"eager": eager[1], "fast": fast[1], "pytorch": torch_[1]}, "err": {}}  # fmt: skip

    points = [pt(64, (30, 20), (10, 50), (33, 20)), pt(4096, (900, 20), (500, 60), (990, 20))]
    assert plan.costs(points[0]) == {"eager": 30, "fast": 50, "pytorch": 33}  # the baseline contends too
    rejected = {**points[0], "rejected": {"pytorch": "max error 2.00x the tolerance"}}
    assert plan.costs(rejected) == {"eager": 30, "fast": 50}  # rejected there, its timings kept
    assert plan.to_bisect({p["m"]: p for p in points}, 2.0) == [512]
    first, second = plan.fit(points)
    assert (first["m_from"], first["backend"], first["gpu_backend"], first["clock"]) == (
        1,
        "eager",
        "fast",
        "gpu",
    )
    assert first["runner_up"] == "pytorch" and first["margin"] == pytest.approx(33 / 30 - 1, abs=1e-4)
    assert first["gpu_us"] == {"eager": 30, "pytorch": 33}
    assert first["host_us"] == {"eager": 20, "pytorch": 20}
    assert first["pytorch_us"] == {"gpu": 33, "host": 20} and first["speedup"] == pytest.approx(1.1)
    assert (second["m_from"], second["backend"], second["clock"]) == (512, "fast", "gpu")
    assert second["speedup"] == pytest.approx(990 / 500)
    # the same GPU times with a host that keeps up: 'fast' wins everywhere
    for p in points:
        p["host_us"]["fast"] = 1.0
    assert [s["backend"] for s in plan.fit(points)] == ["fast"]


def test_points_whose_contenders_are_slow_calls_take_more_rounds():
    """On a GPU, calls of SLOW_MS or more are read by events and the GPU's clock drifts under them: a
    point whose close contenders include one takes SLOW_ROUNDS; a slow entry far behind the cheapest
    does not, nor does any point on a CPU (one wall clock)."""
    gpu = measure.Clock(CPU, 3, False)
    gpu.cuda = True  # the rule alone: no GPU is touched
    slow = measure.SLOW_MS
    assert gpu.rounds_for({"eager": slow * 1.1, "pytorch": slow * 1.2}) == measure.SLOW_ROUNDS
    assert gpu.rounds_for({"eager": slow * 0.9, "triton": slow * 1.05}) == measure.SLOW_ROUNDS
    assert gpu.rounds_for({"eager": slow * 0.5, "nvfuser": slow * 1.5}) == 3
    assert gpu.rounds_for({"eager": slow * 0.5}) == 3
    assert measure.Clock(CPU, 3, False).rounds_for({"eager": slow * 2}) == 3


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


def test_a_series_host_cost_is_its_median_and_one_host_sample_drops_no_backend():
    """Each backend's host cost over a series is the median of its samples (an estimated or drained
    entry's reading is no sample); a backend dearer than the cheapest by a
    host sample alone is not hopeless, one dearer on GPU time too is."""
    pts = [
        {"m": 1, "gpu_us": {"a": 2.0, "b": 3.0}, "host_us": {"a": 10.0, "b": 12.0}},
        {"m": 16, "gpu_us": {"a": 2.0, "b": 3.0}, "host_us": {"a": 31.0, "b": 900.0},
         "gpu_clock": {"b": "estimate"}},
        {"m": 256, "gpu_us": {"a": 5.0, "b": 4.0}, "host_us": {"a": 11.0, "b": 50.0}, "drained": ["b"]},
    ]  # fmt: skip
    assert plan.series_host(pts) == {"a": 11.0, "b": 12.0}  # b's estimate and drained queue left out
    first = {"m": 4096, "gpu_us": {"eager": 100.0, "t": 101.0, "slow": 300.0, plan.BASELINE: 100.0},
             "host_us": {"eager": 20.0, "t": 400.0, "slow": 30.0, plan.BASELINE: 20.0}}  # fmt: skip
    assert plan.contenders(["eager", "t", "slow", plan.BASELINE], {4096: first}) == ["eager", "t", plan.BASELINE]
    # dearer by host cost at two points but fastest on the GPU: kept (a captured call runs it); dearer
    # on both clocks at both points: pruned
    pts = {m: {"m": m, "gpu_us": {"eager": 50.0, "t": 40.0, "u": 80.0, plan.BASELINE: 50.0},
               "host_us": {"eager": 100.0, "t": 140.0, "u": 140.0, plan.BASELINE: 100.0}} for m in (256, 4096)}  # fmt: skip
    assert plan.contenders(["eager", "t", "u", plan.BASELINE], pts) == ["eager", "t", plan.BASELINE]
    # a backend serving only the representative ("lt": cuBLASLt's tanh-only GELU) prunes nobody: the
    # members it lacks would lose their fastest backend
    pts = {m: {"m": m, "gpu_us": {"eager": 100.0, "t": 90.0, "lt": 60.0, plan.BASELINE: 100.0},
               "host_us": {"eager": 20.0, "t": 30.0, "lt": 20.0, plan.BASELINE: 20.0}} for m in (256, 4096)}  # fmt: skip
    names = ["eager", "t", "lt", plan.BASELINE]
    assert plan.contenders(names, pts) == ["eager", "lt", plan.BASELINE]
    assert plan.contenders(names, pts, frozenset({"lt"})) == names
    one = {"m": 4096, "gpu_us": {"eager": 100.0, "t": 90.0, "lt": 30.0},
           "host_us": {"eager": 20.0, "t": 30.0, "lt": 20.0}}  # fmt: skip
    assert plan.hopeless_in([one]) == {"t"} and plan.hopeless_in([one], frozenset({"lt"})) == set()
    fam = plan.Family("fused_linear", torch.bfloat16, "inference", False)
    acts = ("gelu_tanh", "gelu", "identity")
    series = {s.rep: s for s in plan.series_of(plan.default_plan(CPU, False, None), fam, acts)}
    lt_only = plan.servers("fused_linear", "gelu_tanh") - plan.servers("fused_linear", "gelu")
    assert series["gelu_tanh"].partial == lt_only and "cublaslt" in lt_only
    assert series["identity"].partial == frozenset()


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
    choice = heuristics.lookup(Call("bias_act_dropout", CPU, torch.bfloat16, (8, 32), "gelu", False, False))
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
            call = Call(e["op"], CPU, torch.float32, (p["m"], *e["features"]), e["activation"], e["dropout"],
                        e["mode"] == "training")  # fmt: skip
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
    case = cases.Case("bias_act_dropout", torch.float32, "gelu", False, False, 4, (32,), CPU)
    for only in (None, frozenset({"eager", plan.BASELINE}), frozenset({"eager"})):
        names = series.Measurer(p, only, lambda: 1.0, None).names(case)
        assert names[0] == plan.BASELINE and names.count(plan.BASELINE) == 1 and "eager" in names, names
    assert plan.BASELINE in backends() and fam.label == "bias_act_dropout float32 inference"


def test_a_torch_mask_backend_is_checked_with_the_mask_it_drew():
    """Plain PyTorch's masks are torch's: its gate replays them from the run's seeded generator, both
    of fused_mlp's (hidden, then output) and bias_act_dropout's, even in bfloat16 where x + b == 0
    exactly at a few elements (there y cannot tell a dropped element from a kept one)."""
    mlp = cases.Case("fused_mlp", torch.float32, "gelu", True, True, 5, (8, 16), CPU)
    got = cases.gate(plan.BASELINE, mlp, *cases.inputs(mlp))
    assert got.passed and got.error < 1e-4 and got.why == "", got
    for dtype, act in ((torch.float32, "gelu"), (torch.bfloat16, "identity")):
        case = cases.Case("bias_act_dropout", dtype, act, True, True, 64, (4096,), CPU)
        got = cases.gate(plan.BASELINE, case, *cases.inputs(case))
        assert got.passed and got.why == "", got




def test_refit_lets_only_a_checked_backend_win_and_keeps_the_others_as_runners_up():
    """--refit: plain PyTorch, cheapest but never parity-checked in the entry (a table from before it
    contended), wins nothing and stays the speedups' floor; dearer, it is a runner-up unchecked; once
    checked in the entry it wins at 1.00x."""

    def entry(err, base=5.0):
        pts = [{"m": m, "gpu_us": {"eager": 10.0 * m, plan.BASELINE: base * m},
                "host_us": {"eager": 1.0, plan.BASELINE: 1.0}, "err": err, "rejected": {}}
               for m in (1, 64)]  # fmt: skip
        return {"mode": "inference", "points": pts}

    old, dear, new = entry({"eager": 0.0}), entry({"eager": 0.0}, base=20.0), entry({plan.BASELINE: 0.0})
    report.refit_entries([old, dear, new], gpu=False)
    (seg,) = old["segments"]
    assert (seg["backend"], seg["runner_up"], seg["speedup"]) == ("eager", None, 0.5)
    assert all(plan.BASELINE not in p["rejected"] for p in old["points"])  # the document's points kept
    (seg,) = dear["segments"]
    assert (seg["backend"], seg["runner_up"], seg["speedup"]) == ("eager", plan.BASELINE, 2.0)
    (seg,) = new["segments"]
    assert (seg["backend"], seg["speedup"]) == (plan.BASELINE, 1.0)


# ----------------------------------------------------------------------------- the calibrator's modules


def test_each_calibrator_module_stays_under_400_lines_and_run_only_schedules():
    """No module of dispatch/calibrate passes 400 lines; Run takes typed Settings and measures nothing
    itself (points, gates and entries are series.Measurer's and gate.Gates')."""
    folder = os.path.dirname(calibrate.__file__)
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                assert len(f.readlines()) <= 400, name
    own = {n for n, v in vars(runner.Run).items() if callable(v) and not n.startswith("__")}
    assert own == {"plan_tasks", "_done", "_complete", "left", "run", "_store", "document"}, own
    argv = ["--ops", "fused_mlp", "--backends", "eager", "--tokens", "8", "1"]
    settings = cli.settings_of(cli.parse_args(argv))
    assert settings == runner.Settings(ops=("fused_mlp",), modes=plan.MODES, backends=frozenset({"eager"}),
                                       tokens=(1, 8))  # fmt: skip


def test_each_op_is_calibrated_at_its_own_activations(user_dir):
    """By default an op's series cover its own activations (fused_mlp's gated ones too); --activations
    keeps only those of the op's own it names."""
    p = plan.default_plan(CPU, True, 10.0, ["fused_mlp", "bias_act_dropout"])
    fams = [plan.Family("fused_mlp", torch.float32, "inference", False),
            plan.Family("bias_act_dropout", torch.float32, "inference", False)]  # fmt: skip

    def reps(*argv):
        settings = cli.settings_of(cli.parse_args(["--ops", "fused_mlp", "bias_act_dropout", *argv]))
        run = runner.Run(p, settings, None, None)
        run.plan_tasks(fams)
        return {f.op: {t.series.rep for t in q} for f, q in run.queue.items()}

    assert reps() == {"fused_mlp": {"gelu_tanh", "swiglu"}, "bias_act_dropout": {"gelu", "relu"}}
    only = {"fused_mlp": {"swiglu", "relu"}, "bias_act_dropout": {"relu"}}  # swiglu is fused_mlp's alone
    assert reps("--activations", "swiglu", "relu") == only


# ----------------------------------------------------------------------------- budget and resume


def test_budget_is_shared_by_the_families_and_resume_continues(user_dir, clocks):
    """flat's first call at each size sleeps 0.7 s in the training families (a compile), the first of
    them first in line: they cannot measure every series in a 7 s budget, but every family is measured
    (the one that has spent least per planned series goes next), the fast ones whole, and a --resume
    measures what was left, keeping the rest as it was."""
    _, _, delay = clocks
    delay[("flat", True, True)] = delay[("flat", True, False)] = 0.7
    out = user_dir / "t.json"
    many = dict(modes=("inference", "training"), acts=("gelu", "relu"), features=("32", "40", "48"))
    assert calibrate.main(args(out, "--budget", "7", **many)) == 0
    data = heuristics.load_table(str(out)).data
    fams = data["settings"]["families"]
    assert len(fams) == 4 and data["settings"]["stopped_by_budget"]
    measured = {(e["mode"], e["dropout"]) for e in data["entries"]}
    assert measured == {("inference", False), ("inference", True), ("training", False), ("training", True)}
    for label, f in fams.items():
        assert ("training" in label) == (f["series_left"] > 0), (label, f)
    first = {heuristics.EntryId.of_entry(e): e for e in data["entries"]}
    assert calibrate.main(args(out, "--resume", "--budget", "600", **many)) == 0
    data = heuristics.load_table(str(out)).data
    assert not data["settings"]["stopped_by_budget"]
    assert all(f["series_left"] == 0 for f in data["settings"]["families"].values())
    assert [(r["run"], r["parts"]) for r in data["settings"]["runs"]] == [("quick", 2)]
    resumed = {heuristics.EntryId.of_entry(e): e for e in data["entries"]}
    assert len(resumed) == 4 * 2 * 3 and all(resumed[k] == e for k, e in first.items())


def test_a_run_the_budget_stops_has_whole_classes(user_dir, clocks):
    """A series' members are checked right after it, also past the deadline: each first call sleeps
    0.4 s (a compile), so a 3 s budget stops the run partway through its sizes, and every measured
    representative has every member of its class beside it, with its winners checked ('flat' compiles
    nothing, so its checks run past the deadline too)."""
    _, _, delay = clocks
    delay[("flat", False, False)] = delay[("eager", False, False)] = 0.4
    out = user_dir / "t.json"
    acts = ("gelu", "gelu_tanh", "silu", "relu", "identity")
    assert calibrate.main(args(out, "--budget", "3", acts=acts, features=("32", "40", "48", "56"))) == 0
    data = heuristics.load_table(str(out)).data
    assert data["settings"]["stopped_by_budget"]
    have = {(e["activation"], e["features"][0], e["dropout"]): e for e in data["entries"]}
    reps = {(a, n, d) for a, n, d in have if a in ("gelu", "relu")}
    assert {(a, n) for a, n, d in reps if not d} and len(reps) < 16  # stopped partway
    for rep, n, d in reps:
        cls = next(c for c in ops.get("bias_act_dropout").grid.classes if rep in c)
        assert {(a, n, d) for a in cls if a in acts} <= set(have), (rep, n, d, sorted(have))
        if "flat" in {s["backend"] for s in have[(rep, n, d)]["segments"]}:
            for a in (a for a in cls[1:] if a in acts):
                assert "flat" in {s["backend"] for s in have[(a, n, d)]["segments"]}, (a, n, d)


def test_a_check_skipped_past_the_deadline_is_made_by_resume(user_dir, clocks, monkeypatch):
    """'fast' compiles per kind of call and wins everywhere: past the deadline a member's check by it is
    skipped (it would compile), so the member runs eager there and the run says it stopped; --resume
    checks it and the member gets 'fast' as its representative did."""
    gpu, host, _ = clocks
    register(monkeypatch, eager_twin("fast", compiles=True))
    gpu["fast"], host["fast"] = (lambda m: 1.0), (lambda m: 1.0)
    out = user_dir / "t.json"
    monkeypatch.setattr(runner, "END_S", 0.0)
    # the deadline passes once the first series has its entry
    monkeypatch.setattr(runner.Run, "left", lambda self: -1.0 if self.entries else 1.0)
    many = dict(acts=("gelu", "gelu_tanh"), backends=("fast",))
    assert calibrate.main(args(out, "--budget", "600", **many)) == 0
    data = heuristics.load_table(str(out)).data
    member = next(e for e in data["entries"] if e["activation"] == "gelu_tanh" and not e["dropout"])
    assert [s["backend"] for s in member["segments"]] == ["eager"] and data["settings"]["stopped_by_budget"]
    assert gate.UNCHECKED in {why for p in member["points"] for why in p["rejected"].values()}
    monkeypatch.undo()
    register(monkeypatch, eager_twin("fast", compiles=True))
    assert calibrate.main(args(out, "--resume", "--budget", "600", **many)) == 0
    data = heuristics.load_table(str(out)).data
    member = next(e for e in data["entries"] if e["activation"] == "gelu_tanh" and not e["dropout"])
    assert {s["backend"] for s in member["segments"]} == {"fast"}
    assert not data["settings"]["stopped_by_budget"]


def test_agree_without_refit_is_refused():
    with pytest.raises(SystemExit, match="--refit"):
        calibrate.main(["--agree", "x.json"])


def test_refresh_measures_the_selected_families_again_and_keeps_the_rest(user_dir, clocks):
    gpu, _, _ = clocks
    out = user_dir / "t.json"
    both = dict(modes=("inference", "training"))
    assert calibrate.main(args(out, **both)) == 0
    first = {e["mode"]: e for e in heuristics.load_table(str(out)).data["entries"] if not e["dropout"]}
    gpu["flat"] = lambda m: 1e4  # flat now loses everywhere
    assert calibrate.main(args(out, "--refresh", modes=("training",))) == 0
    data = heuristics.load_table(str(out)).data
    again = {e["mode"]: e for e in data["entries"] if not e["dropout"]}
    assert again["inference"] == first["inference"]
    assert [b for _, b in segments(again["training"])] == ["eager"] and segments(first["training"])[-1][
        1
    ] == "flat"
    assert [r["run"] for r in data["settings"]["runs"]] == ["quick", "refresh"]
    st = data["settings"]
    assert st["series_measured"] == st["series_planned"] == 2  # training's two, not inference's kept ones
    assert "refreshed since: bias_act_dropout float32 training" in "\n".join(
        table_cli.provenance(heuristics.load_table(str(out)))
    )


def test_a_slim_table_cannot_be_resumed(user_dir, clocks):
    out, slim = user_dir / "raw.json", user_dir / "slim.json"
    assert calibrate.main(args(out, "--slim-out", str(slim))) == 0
    thin = json.loads(slim.read_text())
    assert thin["raw_points"]["file"] == str(out) and all("points" not in e for e in thin["entries"])
    assert all(e["segments"][0]["gpu_us"] for e in thin["entries"])  # both clocks stay per segment
    with pytest.raises(SystemExit, match="keeps no raw measured points"):
        calibrate.main(args(slim, "--resume"))


def test_a_run_over_an_existing_table_keeps_what_it_does_not_measure_again(user_dir, clocks, capsys):
    """A plain run whose --out holds this device's table measures its own selection again and keeps
    every other entry, saying how many; the table's history names the run."""
    out = user_dir / "t.json"
    assert calibrate.main(args(out, modes=("inference", "training"))) == 0
    first = {heuristics.EntryId.of_entry(e): e for e in heuristics.load_table(str(out)).data["entries"]}
    capsys.readouterr()
    assert calibrate.main(args(out, modes=("training",))) == 0
    printed = capsys.readouterr().out
    data = heuristics.load_table(str(out)).data
    now = {heuristics.EntryId.of_entry(e): e for e in data["entries"]}
    assert now.keys() == first.keys() and len(now) == 4
    inference = [k for k in first if k.key.mode == "inference"]
    assert len(inference) == 2 and all(now[k] == first[k] for k in inference)
    assert "kept 2 of the 4 entries of the table already there; the other 2 measured again" in printed
    assert [(r["run"], r.get("families")) for r in data["settings"]["runs"]] == [
        ("quick", None), ("quick", ["bias_act_dropout float32 training"])]  # fmt: skip
    assert "measured again since by quick: bias_act_dropout float32 training" in "\n".join(
        table_cli.provenance(heuristics.load_table(str(out)))
    )


def schema_1_table(info):
    seg = {"m_from": 1, "backend": "eager", "runner_up": None, "margin": None}
    entry = {"op": "bias_act_dropout", "dtype": "float32", "activation": "gelu", "mode": "inference",
             "dropout": False, "features": [32], "segments": [seg],
             "points": [{"m": 1, "ms": {"eager": 1.0}}]}  # fmt: skip
    return {"schema_version": 1, "device": info, "entries": [entry]}


@pytest.mark.parametrize("kind", ["other device", "schema 1", "not a table"])
def test_a_file_the_run_cannot_extend_is_never_overwritten(user_dir, clocks, kind):
    """Another device's table, a schema 1 table or a file that is no table at --out: the run stops
    before measuring, names the file and --out, and leaves the file as it was."""
    out = user_dir / "t.json"
    info = heuristics.device_info(CPU)
    if kind == "not a table":
        out.write_text("{ not json")
    elif kind == "schema 1":
        out.write_text(json.dumps(schema_1_table(info)))
    else:
        assert calibrate.main(args(out)) == 0
        doc = json.loads(out.read_text())
        doc["device"] = {"type": "cuda", "name": "NVIDIA H200", "slug": "nvidia-h200", "capability": [9, 0]}
        out.write_text(json.dumps(doc))
    before = out.read_text()
    why = {"other device": "is the table of NVIDIA H200", "schema 1": "is a schema 1 table",
           "not a table": "is not a heuristics table"}[kind]  # fmt: skip
    with pytest.raises(SystemExit, match=f"{why}.*not overwriting it: give another --out"):
        calibrate.main(args(out))
    assert out.read_text() == before


def test_a_table_of_other_versions_is_replaced_with_a_word(user_dir, clocks, capsys):
    out = user_dir / "t.json"
    assert calibrate.main(args(out, modes=("inference", "training"))) == 0
    doc = json.loads(out.read_text())
    doc["versions"]["torch"] = "0.1"
    out.write_text(json.dumps(doc))
    capsys.readouterr()
    assert calibrate.main(args(out, modes=("training",))) == 0
    assert "--out: " + str(out) + " was calibrated with torch 0.1" in capsys.readouterr().err
    assert {e["mode"] for e in heuristics.load_table(str(out)).data["entries"]} == {"training"}


def test_calibrate_ends_with_a_summary_and_the_table_prints_once(user_dir, clocks, capsys):
    """The README's ``python -m dispatch.calibrate --quick && python -m dispatch.table``: calibrate
    prints a summary with each self-check target's verdict and where the choice tables are; the
    tables print once, by dispatch.table (or by calibrate with --tables)."""
    out = user_dir / f"{heuristics.device_info(CPU)['slug']}.json"  # where lookups look first
    assert calibrate.main(args(out)) == 0
    printed = capsys.readouterr().out
    assert "cell:" not in printed and "activation gelu" not in printed, printed
    assert printed.rstrip().endswith("the choice tables: python -m dispatch.table"), printed
    assert "within 5% of the fastest: 100% (target >= 95%) ok" in printed, printed
    assert table_cli.main([]) == 0
    assert capsys.readouterr().out.count("bias_act_dropout  float32  inference") == 2  # dropout and not
    other = user_dir / "elsewhere.json"
    assert calibrate.main(args(other, "--tables")) == 0
    printed = capsys.readouterr().out
    assert "cell:" in printed and f"the choice tables: python -m dispatch.table --gpu {other}" in printed


def test_each_self_check_target_gets_its_own_verdict():
    """A table within 5% of the fastest at 98% of its points but 20% off at its worst: the regret
    target is the one missed, and the line says so."""
    r = {"points": 50, "within_5pct": 0.98, "worst_regret": 0.2, "worst_vs_pytorch": 0.01,
         "pick_not_runnable": 0, "targets": report.TARGETS, "by_gpu_time": None}  # fmt: skip
    r["meets_targets"] = all(ok for *_, ok in report.verdicts(r))
    text = report.format_self_check(r, gpu=False)
    lines = text.splitlines()
    assert lines[0] == "self-check on 50 held-out points, by wall time: MISS"
    assert lines[1:] == [
        "  within 5% of the fastest: 98% (target >= 95%) ok",
        "  worst regret: +20.0% (target <= +10%) MISS",
        "  worst vs plain PyTorch: +1.0% (target <= +3%) ok",
        "  picks that could not run: 0 (target 0) ok",
    ]
    r.update(worst_regret=0.02, pick_not_runnable=1, meets_targets=False)
    assert "  picks that could not run: 1 (target 0) MISS" in report.format_self_check(r).splitlines()
    assert "  worst regret: +2.0% (target <= +10%) ok" in report.format_self_check(r).splitlines()


# ----------------------------------------------------------------------------- real clocks on the CPU


def test_tiny_real_run_on_cpu(user_dir, capsys):
    """Eager and plain PyTorch, both ops and modes, real clocks: on the CPU both clocks are the wall time
    (no second self-check by GPU time: there is no capture); the choice tables show speedups over plain
    PyTorch."""
    out = user_dir / "tiny.json"
    argv = ["--quick", "--modes", "inference", "training", "--activations", "gelu", "--features", "64", "64,32",
            "--tokens", "1", "8", "--backends", "eager", "--out", str(out)]  # fmt: skip
    assert calibrate.main(argv) == 0
    ran = capsys.readouterr().out
    assert "self-check on" in ran and "by GPU time alone" not in ran
    table = heuristics.load_table(str(out))
    assert table.version == 2 and table.data["settings"]["timer"].startswith("gpu_us = host_us")
    ops = {(e["op"], e["mode"], e["dropout"]) for e in table.data["entries"]}
    assert len(ops) == 9  # every op x mode x dropout family
    for e in table.data["entries"]:
        for p in e["points"]:
            assert p["gpu_us"] == p["host_us"] and set(p["gpu_us"]) == {"eager", plan.BASELINE}, p
    log = table.data["settings"]["series_seconds"]
    assert len(log) == 9 and all(r["points"] >= 2 and r["timing_s"]["eager"] > 0 for r in log)
    capsys.readouterr()
    assert table_cli.main(["--gpu", str(out), "--op", "fused_linear"]) == 0
    printed = capsys.readouterr().out
    assert (
        "fused_linear  float32  training  activation gelu" in printed
        and "bias_act_dropout" not in printed.split("cell:")[0]
    )
    # one clock on a CPU: the wall time decides, and no GPU wording appears
    assert "speedup over plain PyTorch" in printed and "the fastest by wall time wins" in printed
    assert "GPU" not in printed and "host-bound" not in printed and "SMs" not in printed, printed
    assert "eager " in printed and "x" in printed.split("cell:")[0].splitlines()[3]


def test_host_clock_waits_for_no_gpu():
    """Clock.time on the CPU: interleaved rounds, a median per entry, the baseline timed alongside, an
    entry that raises reported, an entry refused a start (no budget) not run at all."""
    case = cases.Case("bias_act_dropout", torch.float32, "relu", False, False, 4, (8,), CPU)
    inp = cases.make_inputs(case, 0)
    ran = []
    timers = {n: measure.timer(n, case, inp) for n in ("eager", plan.BASELINE)}
    timers["broken"] = measure.Timer(lambda: 1 / 0, [], 1, "broken", case)
    timers["late"] = measure.Timer(lambda: ran.append(1), [], 1, "late", case)
    got, spent = measure.Clock(CPU, 3, True).time(timers, lambda n: n != "late")
    assert got["eager"].gpu_us == got["eager"].host_us > 0 and got[plan.BASELINE].how == "wall"
    assert isinstance(got["broken"], ZeroDivisionError) and "budget" in got["late"] and not ran
    assert spent["eager"] > 0


def test_clock_chains_a_short_point_alike_and_keeps_hopeless_entries_at_their_estimate(monkeypatch):
    """Clock.prepare: where the point's cheapest entry is estimated under CHAIN_BELOW_MS, every training
    entry still in the running (the baseline too) is rebuilt as TRAIN_CHAIN forwards per backward, so
    no point mixes chained and single timings; an entry at least SKIP_MS a call and over HOPELESS_X
    times the cheapest keeps its single-call estimate untimed; a point whose cheapest entry is at
    CHAIN_BELOW_MS or more is timed one forward per backward throughout."""
    case = cases.Case("fused_linear", torch.float32, "relu", True, False, 4, (8, 8), CPU)
    built = []

    def timer(name, est, chain=True, calls=1):  # chained: a little less per call (autograd's cost shared)
        t = measure.Timer(lambda: None, [], calls, name, case)
        if chain:
            t = t._replace(chained=lambda: built.append(name) or timer(name, est * 0.9, False, 4))
        est_of[id(t)] = est
        return t

    est_of = {}
    monkeypatch.setattr(measure.Clock, "first", lambda self, t: 0.0)
    monkeypatch.setattr(measure.Clock, "estimate_ms", lambda self, t: est_of[id(t)])
    slow = 3 * measure.HOPELESS_X * measure.SKIP_MS

    def prepare(cheapest):
        built.clear()
        near = 0.95 * measure.HOPELESS_X * cheapest  # within HOPELESS_X of the cheapest entry
        assert near >= measure.SKIP_MS
        timers = {"short": timer("short", cheapest), "near": timer("near", near, chain=False),
                  "hopeless": timer("hopeless", slow), plan.BASELINE: timer(plan.BASELINE, slow)}  # fmt: skip
        spent = dict.fromkeys(timers, 0.0)
        est, out = measure.Clock(CPU, 3, False).prepare(timers, lambda n: True, spent)
        assert set(est) == {"short", "near", plan.BASELINE}
        assert est["near"] == near and timers["near"].calls == 1
        assert out["hopeless"] == measure.Timed(slow * 1e3, slow * 1e3, "estimate", False)
        return est, timers

    short = 0.9 * measure.CHAIN_BELOW_MS
    est, timers = prepare(short)
    assert built == ["short", plan.BASELINE]
    assert [timers[n].calls for n in ("short", plan.BASELINE)] == [4, 4]
    assert est["short"] == pytest.approx(0.9 * short) and est[plan.BASELINE] == pytest.approx(0.9 * slow)
    long = 1.1 * measure.CHAIN_BELOW_MS
    est, timers = prepare(long)
    assert built == [] and est["short"] == long and est[plan.BASELINE] == slow
    assert [timers[n].calls for n in ("short", plan.BASELINE)] == [1, 1]


def test_cuda_clocks_retry_a_drained_queue_and_fall_back_where_capture_fails(monkeypatch):
    """The CUDA branch with a stand-in device: the host clock queues its calls behind a sleep kernel and,
    when the sleep ran out first, runs again with a 4x longer sleep and a quarter of the calls; a
    backend whose calls cannot be captured is timed by do_bench from then on, and the point says so."""
    import types

    from dispatch import timing

    sleeps, drained, captures = [], iter([True, False]), []

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def query(self):
            return next(drained)

    def gpu_ms(*a, **k):
        captures.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(timing, "gpu_ms", gpu_ms)
    monkeypatch.setattr(timing, "wall_ms", lambda *a, **k: 0.5)
    clock = measure.Clock(types.SimpleNamespace(type="cuda"), 3, True)
    clock._cycles_per_ms = 1e6
    case = cases.Case("fused_linear", torch.float32, "relu", True, False, 4, (8, 8), CPU)
    calls = []
    t = measure.Timer(lambda: calls.append(1), [], 4, "nvfuser", case)
    us, was_drained = clock.host_us(t, est_ms=0.01)  # 0.04 ms a run of 4 calls: 20 runs, then 5
    assert not was_drained and len(calls) == measure.HOST_RUNS + measure.HOST_RUNS // 4
    assert sleeps == [int(1e6 * (2 * 20 * 0.04 + 0.2)), int(1e6 * (2 * 4 * 20 * 0.04 + 0.2))]
    assert 0 < us < 1e3
    drained = iter([False] * 4)
    for _ in range(2):
        sample = clock.sample(t, 0.01)
        assert sample.gpu_us == 500.0 and sample.how.startswith("do_bench (capture failed: RuntimeError")
    assert len(captures) == 1  # tried once per backend and kind of call
    # a long call: events around back-to-back calls, read afresh in every one of SLOW_ROUNDS rounds
    # (the estimate it was planned by is one reading, taken right after its first call), each of about
    # SLOW_SAMPLE_MS of calls (9 ms a call: 5 of them), the median of the rounds kept
    readings = iter([9.0, 6.0, 8.0, 7.0, 6.5, 7.5, 30.0, 7.0])  # prepare's estimate, then one a round
    runs = []

    def estimate(self, t, n=2):
        runs.append(n)
        return next(readings)

    monkeypatch.setattr(measure.Clock, "first", lambda self, t: 0.0)
    monkeypatch.setattr(measure.Clock, "estimate_ms", estimate)
    monkeypatch.setattr(measure.Clock, "host_us", lambda self, t, est_ms: (50.0, False))
    served = cases.Case("fused_linear", torch.float32, "relu", False, False, 4, (8, 8), CPU)
    long = measure.Timer(lambda: None, [], 1, "eager", served)
    got, _ = clock.time({"eager": long})
    assert runs == [2] + [5] * measure.SLOW_ROUNDS and measure.SLOW_ROUNDS == 7
    assert got["eager"].how == "events" and got["eager"].gpu_us == 7000.0  # one stray 30 ms outvoted


@pytest.mark.gpu
def test_small_calibration_on_gpu(user_dir, capsys):
    """Every available backend, a few shapes, real clocks: GPU time from graphs (or the fallback named
    in the point), host cost behind a busy queue, the baseline at every point."""
    out = user_dir / "gpu.json"
    argv = [
        "--quick",
        "--features",
        "4096",
        "4096,1024",
        "--tokens",
        "1",
        "4096",
        "--budget",
        "120",
        "--out",
        str(out),
    ]
    assert calibrate.main(argv) == 0
    table = heuristics.load_table(str(out))
    assert table.data["device"]["type"] == "cuda" and table.data["device"]["measured_bandwidth_gbs"] > 0
    assert len(table.data["backends"]) >= 2 and table.data["entries"]
    for e in table.data["entries"]:
        for p in e["points"]:
            assert plan.BASELINE in p["gpu_us"] and p["gpu_us"].keys() == p["host_us"].keys(), p
            # the queue may drain only behind a call whose host cost outlasts any sleep sized for it
            # (nvfuser / inductor dropout training at 4096 x 4096 stalled the host 23-86 ms, H200)
            assert all(p["host_us"][name] > 1e3 * measure.HOST_CAP_MS for name in p.get("drained", [])), p
    assert "self-check" in capsys.readouterr().out


def test_host_cost_is_the_family_median_of_the_measured_series():
    """On a GPU each backend's host cost is the median of its samples over the measured series of one op,
    mode and dropout (any size, activation or dtype); an activation sharing a series' timings adds no
    samples of its own, and another family keeps its own."""

    def entry(features, act="gelu", rep="gelu", mode="inference", samples=None):
        points = [{"m": m, "gpu_us": {"eager": 1.0, "triton": 1.0}, "host_us": dict(s)} for m, s in samples]
        return {"op": "bias_act_dropout", "dtype": "bfloat16", "activation": act, "measured_as": rep, "mode": mode,
                "dropout": False, "features": [features], "points": points}  # fmt: skip

    a = entry(768, samples=[(1, {"eager": 10.0, "triton": 50.0}), (64, {"eager": 12.0, "triton": 48.0})])
    b = entry(4096, samples=[(1, {"eager": 30.0, "triton": 70.0})])
    member = entry(768, act="relu", samples=[(1, {"eager": 1000.0, "triton": 1000.0})])
    other = entry(768, mode="training", samples=[(1, {"eager": 200.0, "triton": 300.0})])
    plan.pool_host([a, b, member, other])
    for e in (a, b, member):
        assert all(p["host_us"] == {"eager": 12.0, "triton": 50.0} for p in e["points"]), e["points"]
    assert other["points"][0]["host_us"] == {"eager": 200.0, "triton": 300.0}
    assert member["points"][0]["host_us_measured"] == {"eager": 1000.0, "triton": 1000.0}  # the clock's reading kept


def test_compiling_ahead_gives_each_kind_of_call_to_one_worker():
    """warm.deal: an inductor graph per feature size, a Triton kernel per op, dtype, activation and
    direction whatever the size, each kind in one worker (no two compile it), the load spread, and each
    worker's calls in the run's order."""
    from dispatch.calibrate import warm

    todo = [["triton", "bias_act_dropout", "bfloat16", "gelu", t, False, m, [n]]
            for t in (False, True) for n in (768, 3072) for m in (1, 256)]  # fmt: skip
    todo += [["inductor", "fused_linear", "bfloat16", "relu", False, False, m, [n, 768]]
             for n in (768, 3072, 4096) for m in (1, 9)]  # fmt: skip
    chunks = warm.deal(todo, 4)  # five kinds of two compiles each: one worker takes two
    assert sorted(map(len, chunks)) == [2, 2, 4, 6] and sum(map(len, chunks)) == len(todo)
    for kind in ({(j[0], j[4]) for j in todo if j[0] == "triton"}):
        assert sum(any((j[0], j[4]) == kind for j in c) for c in chunks) == 1  # one worker a Triton kind
    for c in chunks:
        assert c == [j for j in todo if j in c]  # the run's order within a worker
    assert warm.deal(todo, 1) == [todo]


def test_torchrun_is_refused_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="one process"):
        calibrate.main(["--quick"])
