"""The calibrator's rule on hand-made points: the cheapest by max(GPU time, host cost) wins, ties go by
the mode's order (plain PyTorch first), bisection where the winner changes, backends pruned only when
hopeless on both clocks, host costs pooled per series and per family, --refit's winners parity-checked,
and the self-check's verdicts."""

import pytest
import torch

from dispatch.calibrate import plan, report
from calibration import CPU


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


@pytest.mark.parametrize(
    "winners, starts",
    [
        (("pytorch", "fast"), [1, 16]),  # PyTorch at 4 keeps the gap up to 'fast''s measured 16
        (("fast", "pytorch"), [1, 5]),  # and from just past 'fast''s measured 4
        (("eager", "fast"), [1, 8]),  # between two others: the geometric middle
    ],
)
def test_plain_pytorch_keeps_the_unmeasured_gaps_it_borders(winners, starts):
    """Where the winner changes between two measured points, the boundary is a guess: where plain
    PyTorch wins one side, no call in the gap is routed off it on that guess."""

    def pt(m, winner):
        times = {n: 100.0 if n == winner else 200.0 for n in ("pytorch", "eager", "fast")}
        return {"m": m, "gpu_us": times, "host_us": dict(times), "err": {}}

    segments = plan.fit([pt(4, winners[0]), pt(16, winners[1])])
    assert [(s["m_from"], s["backend"]) for s in segments] == list(zip(starts, winners))


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


def test_host_cost_is_the_family_median_of_the_measured_series():
    """On a GPU each backend's host cost is the median of its samples over the measured series of one op,
    mode, dropout and class (any size, dtype or member of the class); an activation sharing a series'
    timings adds no samples of its own, and another family (another mode, another class) keeps its own."""

    def entry(features, act="gelu", rep="gelu", mode="inference", samples=None):
        points = [{"m": m, "gpu_us": {"eager": 1.0, "triton": 1.0}, "host_us": dict(s)} for m, s in samples]
        return {"op": "bias_act_dropout", "dtype": "bfloat16", "activation": act, "measured_as": rep, "mode": mode,
                "dropout": False, "features": [features], "points": points}  # fmt: skip

    a = entry(768, samples=[(1, {"eager": 10.0, "triton": 50.0}), (64, {"eager": 12.0, "triton": 48.0})])
    b = entry(4096, samples=[(1, {"eager": 30.0, "triton": 70.0})])
    member = entry(768, act="relu", samples=[(1, {"eager": 1000.0, "triton": 1000.0})])
    other = entry(768, mode="training", samples=[(1, {"eager": 200.0, "triton": 300.0})])
    relu = entry(768, act="relu", rep="relu", samples=[(1, {"eager": 3.0, "triton": 40.0})])
    plan.pool_host([a, b, member, other, relu])
    for e in (a, b, member):
        assert all(p["host_us"] == {"eager": 12.0, "triton": 50.0} for p in e["points"]), e["points"]
    assert other["points"][0]["host_us"] == {"eager": 200.0, "triton": 300.0}
    assert relu["points"][0]["host_us"] == {"eager": 3.0, "triton": 40.0}
    assert member["points"][0]["host_us_measured"] == {"eager": 1000.0, "triton": 1000.0}  # the clock's reading kept


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
