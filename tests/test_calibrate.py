"""Calibration: the winner rule, bisection to the crossover, a tiny real run on CPU, the table CLI."""

import json
import time

import pytest
import torch

from dispatch import heuristics
from dispatch import calibrate, calibrate_bench, calibrate_checks, explain, registry, select, timing
from dispatch import table as table_cli
from dispatch.calibrate_plan import NOISE, fit, rank, spread, to_bisect
from dispatch.registry import Call


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(heuristics.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(heuristics, "SHIPPED_DIR", str(tmp_path / "none"))
    heuristics.reload()
    select.clear_cache()
    yield tmp_path
    heuristics.reload()
    select.clear_cache()


@pytest.fixture
def fake_backends(monkeypatch):
    """Two eager twins whose (synthetic) times cross over: 'flat' wins for large M, 'slow' never.
    The measurements still run the real parity gate; only the clock is replaced."""
    eager = registry.get("eager")
    for name in ("flat", "slow"):
        twin = registry.Backend(name, eager.ops, eager.devices, eager.dtypes, eager.activations, True, "twin")
        monkeypatch.setitem(registry._BACKENDS, name, twin)
    cost = {"eager": lambda m: 1 + 0.01 * m, "flat": lambda m: 2 + 0.001 * m, "slow": lambda m: 10 + m}
    extra = {"silu": 3.0}  # silu costs 3x under the synthetic clock, to be split off by the probe

    def timer(name, case, inp):
        return calibrate_bench.Timer((name, case), [])

    def per_call_ms(fn, leaves, device, quick, training, share=1.0, warm=True, calls=1):
        name, case = fn
        return cost[name](case.m) * extra.get(case.activation, 1.0)

    monkeypatch.setattr(calibrate_bench, "timer", timer)
    monkeypatch.setattr(timing, "per_call_ms", per_call_ms)
    return cost


def test_rank_breaks_ties_by_preference():
    assert rank({"triton": 1.0, "eager": 1.0 + NOISE / 2, "inductor": 0.99}) == [
        "eager",
        "inductor",
        "triton",
    ]
    assert rank({"triton": 1.0, "eager": 1.0 + 2 * NOISE}) == ["triton", "eager"]


def test_fit_and_bisect():
    def pt(m, eager, triton):
        return {"m": m, "ms": {"eager": eager, "triton": triton}, "err": {"eager": 0.0, "triton": 1e-7}}

    points = {1: pt(1, 1.0, 2.0), 64: pt(64, 2.0, 2.01), 4096: pt(4096, 10.0, 5.0)}
    assert to_bisect(points, 1.5) == [512]  # eager wins up to 64 (64 is a tie), triton at 4096
    segs = fit(list(points.values()))
    assert [(s["m_from"], s["backend"]) for s in segs] == [(1, "eager"), (512, "triton")]
    assert segs[0]["runner_up"] == "triton" and segs[0]["margin"] == pytest.approx(0.005)
    assert segs[1]["speedup"] == pytest.approx(2.0) and segs[1]["errors"]["triton"] == 1e-7
    assert to_bisect({1: pt(1, 1, 2), 2: pt(2, 2, 1)}, 1.5) == []  # adjacent: nothing in between


def test_spread_covers_the_range_first():
    order = spread(list(range(9)))
    assert order[:3] == [4, 0, 8] and sorted(order) == list(range(9))


def test_bisection_finds_the_crossover(user_dir, fake_backends, capsys):
    args = [
        "--quick",
        "--dtypes",
        "float32",
        "--modes",
        "inference",
        "--activations",
        "gelu",
        "silu",
        "identity",
        "--features",
        "32",
        "32,16",
        "--tokens",
        "1",
        "16",
        "1024",
        "--backends",
        "flat",
        "slow",
        "--budget",
        "600",
    ]
    assert calibrate.main(args) == 0
    path = user_dir / f"{heuristics.device_info(torch.device('cpu'))['slug']}.json"
    doc = json.loads(path.read_text())
    # eager = 1 + 0.01 M, flat = 2 + 0.001 M: they cross at M = 111
    for e in doc["entries"]:
        segs = [(s["m_from"], s["backend"]) for s in e["segments"]]
        assert [b for _, b in segs] == ["eager", "flat"], e
        assert 64 <= segs[1][0] <= 200, segs
        assert all(p["ms"]["slow"] > p["ms"]["eager"] for p in e["points"] if "slow" in p["ms"])
    rep = next(
        e for e in doc["entries"] if e["activation"] == e["measured_as"] and e["op"] == "bias_act_dropout"
    )
    assert len(rep["points"]) > 3 and rep["points"][0]["err"]["flat"] < 1e-6  # bisected; gate errors stored
    assert {e["activation"] for e in doc["entries"]} == {"gelu", "silu", "identity"}
    assert doc["self_check"]["points"] > 0 and doc["self_check"]["within_5pct"] == 1.0
    # the written table is the one lookup uses
    call = Call("bias_act_dropout", torch.device("cpu"), torch.float32, (1000, 32), "silu", False, False)
    assert heuristics.lookup(call).backend == "flat"
    x = torch.randn(8, 32)
    assert explain("fused_bias_act_dropout", x, torch.randn(32), "gelu", 0.0).backend.name == "eager"
    assert explain("fused_bias_act_dropout", torch.randn(1000, 32), None, "gelu", 0.0).backend.name == "flat"
    out = capsys.readouterr().out
    assert "flat" in out and "self-check" in out and "PASS" in out


def test_full_mode_probe_splits_an_activation_of_other_cost(user_dir, fake_backends):
    args = [
        "--ops",
        "bias_act_dropout",
        "--dtypes",
        "float32",
        "--modes",
        "inference",
        "--activations",
        "gelu",
        "gelu_tanh",
        "silu",
        "--features",
        "32",
        "--tokens",  # the crossover is at M = 111; the largest M also caps the held-out sizes' M
        "1",
        "256",
        "--backends",
        "flat",
        "--probe",
        "--out",
        str(user_dir / "full.json"),
    ]
    assert calibrate.main(args) == 0
    doc = json.loads((user_dir / "full.json").read_text())
    measured = {e["activation"]: e["measured_as"] for e in doc["entries"] if not e["dropout"]}
    assert measured == {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu"}
    member = next(e for e in doc["entries"] if e["activation"] == "gelu_tanh" and not e["dropout"])
    assert member["parity_checked"] and all(seg["errors"] for seg in member["segments"])
    assert any(p["err"] for p in member["points"])
    # the self-check also measured each series once at a real-model size that was not measured
    reps = [e for e in doc["entries"] if e["activation"] == e["measured_as"]]
    assert len(doc["held_out_sizes"]) == len(reps) and all(h["features"] != [32] for h in doc["held_out_sizes"])
    assert all(h["point"]["ms"] for h in doc["held_out_sizes"])
    assert doc["self_check"]["points"] == len(reps) + sum(len(e["held_out"]) for e in reps)


def test_tiny_real_run_on_cpu(user_dir, capsys):
    out = user_dir / "tiny.json"
    args = [
        "--quick",
        "--ops",
        "bias_act_dropout",
        "fused_linear",
        "--modes",
        "inference",
        "--activations",
        "gelu",
        "--features",
        "64",
        "64,32",
        "--tokens",
        "1",
        "8",
        "--backends",
        "eager",
        "--out",
        str(out),
    ]
    assert calibrate.main(args) == 0
    table = heuristics.load_table(str(out))
    assert table.data["device"]["type"] == "cpu" and table.data["settings"]["timer"].startswith(
        "time.perf_counter"
    )
    assert {e["op"] for e in table.data["entries"]} == {"bias_act_dropout", "fused_linear"}
    for e in table.data["entries"]:
        assert all(p["ms"]["eager"] > 0 for p in e["points"])
    log = table.data["settings"]["series_seconds"]  # where the time went, series by series
    assert {tuple(r["features"]) for r in log} == {(64,), (64, 32)}
    assert len(log) == table.data["settings"]["series_measured"]
    assert all(r["points"] >= 2 and r["seconds"] > 0 and r["timing_s"]["eager"] > 0 for r in log)
    call = Call("fused_linear", torch.device("cpu"), torch.float32, (4, 64, 32), "gelu", False, False)
    assert table.choose(call).backend == "eager"
    capsys.readouterr()
    assert table_cli.main(["--gpu", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fused_linear  float32  inference  activation gelu" in printed and "64,32" in printed
    assert "eager 1.00x" in printed and "calibrated" in printed and table.data["date"] in printed
    assert table_cli.main(["--gpu", str(out), "--op", "fused_linear"]) == 0
    assert "bias_act_dropout" not in capsys.readouterr().out.split("cell:")[0]


def test_budget_stops_gracefully_and_resume_extends(user_dir, fake_backends):
    out = user_dir / "partial.json"
    args = [
        "--quick",
        "--dtypes",
        "float32",
        "--modes",
        "inference",
        "--ops",
        "bias_act_dropout",
        "--activations",
        "gelu",
        "--features",
        "32",
        "--tokens",
        "1",
        "64",
        "--backends",
        "flat",
        "--out",
        str(out),
    ]
    assert calibrate.main(args + ["--budget", "0"]) == 0
    table = heuristics.load_table(str(out))
    assert table.data["settings"]["stopped_by_budget"] and table.data["entries"] == []
    assert calibrate.main(args + ["--features", "32", "48"]) == 0
    first = {(e["features"][0], e["dropout"]): e for e in heuristics.load_table(str(out)).data["entries"]}
    assert set(first) == {(32, False), (32, True), (48, False), (48, True)}
    assert calibrate.main(args + ["--features", "32", "48", "96", "--resume"]) == 0
    data = heuristics.load_table(str(out)).data
    assert [(r["run"], r["parts"]) for r in data["settings"]["runs"]] == [("quick", 2)]  # one run, resumed
    resumed = {(e["features"][0], e["dropout"]): e for e in data["entries"]}
    assert set(resumed) == set(first) | {(96, False), (96, True)}
    assert all(resumed[k] == first[k] for k in first)  # kept, not measured again


def test_refresh_measures_the_selected_families_again_and_keeps_the_rest(
    user_dir, fake_backends, monkeypatch
):
    out = user_dir / "refresh.json"
    args = ["--quick", "--dtypes", "float32", "--ops", "bias_act_dropout", "--activations", "gelu",
            "--features", "32", "--tokens", "1", "4096", "--backends", "flat", "--out", str(out)]  # fmt: skip
    assert calibrate.main(args) == 0
    first = {(e["mode"], e["dropout"]): e for e in heuristics.load_table(str(out)).data["entries"]}
    assert {mode for mode, _ in first} == {"inference", "training"}
    assert all(e["segments"][-1]["backend"] == "flat" for e in first.values())
    monkeypatch.setitem(fake_backends, "flat", lambda m: 100.0)  # 'flat' now loses everywhere
    assert calibrate.main(args + ["--refresh", "--modes", "training"]) == 0
    data = heuristics.load_table(str(out)).data
    again = {(e["mode"], e["dropout"]): e for e in data["entries"]}
    assert set(again) == set(first)
    for key, e in again.items():
        if key[0] == "inference":
            assert e == first[key]  # kept as it was
        else:  # measured again, under the new clock
            assert [s["backend"] for s in e["segments"]] == ["eager"] and e != first[key]
    runs = data["settings"]["runs"]
    assert [r["run"] for r in runs] == ["quick", "refresh"]
    assert runs[1]["families"] == ["bias_act_dropout float32 training"]
    assert data["settings"]["elapsed_s"] == runs[1]["elapsed_s"]
    shown = "\n".join(table_cli.provenance(heuristics.load_table(str(out))))
    since = "refreshed since: bias_act_dropout float32 training"
    assert f"quick run of {runs[0]['elapsed_s']} s; {since}" in shown


def test_refresh_selects_by_op_dtype_mode_and_activation():
    record = {"op": "fused_linear", "dtype": "bfloat16", "activation": "gelu", "mode": "training"}
    record["dropout"] = False
    args = calibrate.parse_args(
        ["--refresh", "--modes", "training", "--dtypes", "bfloat16", "--ops", "fused_linear"]
    )
    selected = calibrate._selected(args, calibrate.make_plan(args, torch.device("cpu")))
    assert selected(record) and selected({**record, "dropout": True})
    assert not selected({**record, "mode": "inference"}) and not selected({**record, "dtype": "float16"})
    args = calibrate.parse_args(["--refresh", "--activations", "identity"])
    selected = calibrate._selected(args, calibrate.make_plan(args, torch.device("cpu")))
    assert not selected(record) and selected({**record, "activation": "identity", "dtype": "float32"})


def test_table_cli_unknown_device(user_dir, capsys):
    assert table_cli.main(["--gpu", "no such gpu"]) == 1
    assert "python -m dispatch.calibrate" in capsys.readouterr().err


@pytest.mark.gpu
def test_small_calibration_on_gpu(user_dir, capsys):
    """Every available backend, a few shapes: the table is written, loads, and serves lookups."""
    out = user_dir / "gpu.json"
    args = [
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
    assert calibrate.main(args) == 0
    table = heuristics.load_table(str(out))
    assert table.data["device"]["type"] == "cuda" and table.data["device"]["measured_bandwidth_gbs"] > 0
    assert len(table.data["backends"]) >= 2 and table.data["entries"]
    for e in table.data["entries"]:
        for p in (p for p in e["points"] if p["ms"] and e["parity_checked"]):
            # checked after timing (in worker processes): every winner; the rest stay listed as unchecked
            assert rank(p["ms"])[0] in p["err"], p
            assert set(p["ms"]) <= set(p["err"]) | set(p.get("unchecked", ())), p
    assert "self-check" in capsys.readouterr().out


def test_warm_up_groups_calls_by_kind_and_fills_the_compile_cache(tmp_path, monkeypatch):
    """Calls of one kind (backend, op, dtype, activation, mode, dropout, features) stay in one worker,
    so no two workers compile the same graph; a worker's compile lands in inductor's on-disk cache."""
    from dispatch import calibrate_workers

    calls = [
        ["inductor", "bias_act_dropout", "float32", act, False, False, m, [n]]
        for act in ("gelu", "relu")
        for n in (8, 16, 24)
        for m in (1, 4, 64)
    ]
    chunks = calibrate_workers._chunks(calls, 4, lambda c: (c[3], c[7][0]))
    assert sorted(map(tuple, sum(chunks, []))) == sorted(map(tuple, calls))
    owner = {}
    for i, chunk in enumerate(chunks):
        for c in chunk:
            assert owner.setdefault((c[3], c[7][0]), i) == i
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 3  # six kinds of three calls over 4 workers

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # fused_linear identity lowers to one extern addmm: dynamo, AOTAutograd and inductor compile it and
    # fill the FX graph cache, with no C++ kernel to build (bias_act_dropout relu's cost 10 of its 14 s
    # in g++ and inductor's C++ imports on 2 cores; this call ~4 s)
    one = [["inductor", "fused_linear", "float32", "identity", False, False, 4, [8, 8]]]
    summary = calibrate_workers.warm(one, 2, 300, torch.device("cpu"))
    assert summary["calls"] == 1 and summary["workers"] == 1, summary
    assert summary["failed_calls"] == 0 and summary["workers_stopped_at_deadline"] == 0, summary
    assert any(p.is_file() for p in (tmp_path / "inductor").rglob("*"))
    # the worker's seconds by backend: an inductor compile takes a measurable time
    assert set(summary["worker_seconds"]) == {"inductor"} and summary["worker_seconds"]["inductor"] > 0


def test_parity_checks_in_worker_processes(user_dir):
    """With --workers the run only times; the timed points are then parity-checked by a worker
    process before the table is fit: a fit point's winner (only a winner enters a cell), a held-out
    point's every backend (the self-check compares them all). A checked backend carries its measured
    error; the others stay listed as unchecked."""
    path = user_dir / "workers.json"
    args = ["--quick", "--ops", "bias_act_dropout", "--dtypes", "float32", "--modes", "inference",
            "--activations", "relu", "--features", "32", "--tokens", "1", "64", "--backends", "nvfuser",
            "--workers", "1", "--out", str(path)]
    assert calibrate.main(args) == 0
    doc = json.loads(path.read_text())
    checks = doc["settings"]["parallel_checks"]
    reps = [e for e in doc["entries"] if e["activation"] == e["measured_as"]]
    fits = [p for e in reps for p in e["points"]]
    held = [p for e in reps for p in e["held_out"]]
    assert checks["points"] == len(fits) + len(held) > 0 and held and checks["unfinished"] == 0, checks
    assert {"reference", "eager", "nvfuser"} <= set(checks["worker_seconds"]), checks
    for p in fits + held:
        winner = rank(p["ms"])[0]
        assert winner in p["err"] and set(p["err"]) | set(p.get("unchecked", ())) == set(p["ms"]), p
        # nvfuser may be dropped after the first point (contenders' HOPELESS), eager never
        assert "eager" in p["ms"] and set(p["ms"]) <= {"eager", "nvfuser"}, p
    for p in held:
        assert "unchecked" not in p and set(p["ms"]) == set(p["err"]), p
    assert "nvfuser" in max(fits, key=lambda p: p["m"])["ms"]  # the first point measured
    # both backends win somewhere in this run, so each fit point checked exactly one of them
    for p in (p for p in fits if len(p["ms"]) > 1):
        assert len(p["err"]) == 1 and len(p["unchecked"]) == len(p["ms"]) - 1, p


def test_deferred_check_failures_leave_the_table(monkeypatch, fake_backends):
    """A fit point's winner is checked; one that fails its deferred parity check loses that point's
    timing, the next best is checked in the measuring process, and the entry is refit. A backend a
    worker left out (out of memory) is checked again here; a point whose worker died counts as failed
    for every backend."""
    from tqdm import tqdm

    from dispatch import calibrate_workers
    from dispatch.calibrate_plan import Series, default_plan
    from dispatch.calibrate_run import Run, member_points

    run = Run(default_plan(torch.device("cpu"), True, None), None, tqdm(disable=True), workers=2)
    s = Series("bias_act_dropout", torch.float32, "inference", False, "gelu", ["silu"])
    pts = [
        {"m": m, "ms": {"eager": 2.0, "flat": 1.0}, "err": {}, "rejected": {}, "unchecked": ["eager", "flat"]}
        for m in (1, 64, 4096)
    ]
    run.add(s, "gelu", (32,), pts, [], True)
    run.add(s, "silu", (32,), member_points(pts, "bias_act_dropout", "silu"), [], False)

    def check(jobs, workers, deadline_s, device, bar=None):
        assert workers == 2 and [j[6] for j in jobs] == [1, 64, 4096] and all(j[3] == "gelu" for j in jobs)
        assert [j[-1] for j in jobs] == [["flat"]] * 3  # each point's winner only
        ok = {"flat": [True, 2e-7, ""]}
        # job 1: flat ran out of memory in the worker (left out); job 2: its worker died
        summary = {"points": 3, "workers": 1, "seconds": 0.0, "unfinished": 1}
        return {jobs[0][0]: ok, jobs[1][0]: {}}, summary

    redone = []

    def check_here(job, names):
        redone.append((job[6], names))
        verdicts = {"flat": [False, None, "max error 4.00x the tolerance"], "eager": [True, 1e-7, ""]}
        return {n: verdicts[n] for n in names}

    monkeypatch.setattr(calibrate_workers, "check", check)
    monkeypatch.setattr(calibrate_checks, "check_here", lambda run, job, names: check_here(job, names))
    summary = calibrate_checks.check_deferred(run, 60)
    assert summary["points"] == 3 and summary["checked_in_this_process"] == 2
    assert redone == [(64, ["flat"]), (64, ["eager"])]  # the failed winner's runner-up is checked next
    gelu = run.entries[("bias_act_dropout", "float32", "gelu", "inference", False, (32,))]
    assert [seg["backend"] for seg in gelu["segments"]] == ["flat", "eager"]
    first, mid, last = gelu["points"]
    assert first["err"] == {"flat": 2e-7} and first["unchecked"] == ["eager"]  # eager never won there
    assert mid["rejected"] == {"flat": "max error 4.00x the tolerance"} and mid["err"] == {"eager": 1e-7}
    assert "unchecked" not in mid
    assert last["ms"] == {} and set(last["rejected"]) == {"eager", "flat"} and "unchecked" not in last
    silu = run.entries[("bias_act_dropout", "float32", "silu", "inference", False, (32,))]
    # not checked yet: it follows its representative's checks ('flat' is a twin of eager that serves it)
    assert [seg["backend"] for seg in silu["segments"]] == ["flat", "eager"]
    assert [p["ms"] for p in silu["points"]] == [p["ms"] for p in gelu["points"]]
    assert all("unchecked" not in p for p in silu["points"])  # a member is checked on its own
    # a later phase that makes eager the winner at the first point has it checked before the fit
    first["ms"]["flat"] = 3.0
    redone.clear()
    eager_ok = {"eager": [True, 1e-7, ""]}
    monkeypatch.setattr(calibrate_workers, "check", lambda jobs, *a, **k: ({jobs[0][0]: eager_ok}, {}))
    calibrate_checks.check_deferred(run, 60)
    assert first["err"] == {"flat": 2e-7, "eager": 1e-7} and "unchecked" not in first and not redone


def test_member_check_drops_a_failing_winner_from_its_segment(monkeypatch):
    """A member is checked once per run of equal winners, at its largest M; a winner failing there
    leaves every point of that run and the next best is checked in turn."""
    from tqdm import tqdm

    from dispatch.calibrate_plan import Series, default_plan
    from dispatch.calibrate_run import Run

    run = Run(default_plan(torch.device("cpu"), True, None), None, tqdm(disable=True))
    monkeypatch.setattr(calibrate_bench, "make_inputs", lambda case, seed: None)
    monkeypatch.setattr(calibrate_bench, "reference", lambda case, inp: None)
    monkeypatch.setattr(calibrate_bench, "run_once", lambda name, case, inp: None)
    gated = []

    def gate(name, case, inp, refs, eager, point):
        gated.append((name, case.m))
        if name == "flat":  # wrong for this member
            point["rejected"][name] = "max error 9x the tolerance"
            return False
        point["err"][name] = 1e-6
        return True

    monkeypatch.setattr(run, "gate", gate)
    ms = [
        {"flat": 1.0, "eager": 2.0, "slow": 1.5},
        {"flat": 1.0, "eager": 2.0, "slow": 3.0},
        {"flat": 3.0, "eager": 1.0, "slow": 4.0},
    ]
    rep = [{"m": m, "ms": t, "err": {}, "rejected": {}} for m, t in zip((1, 16, 256), ms)]
    s = Series("bias_act_dropout", torch.float32, "inference", False, "gelu")
    points = calibrate_checks.check_member(run, s, "silu", (32,), rep)
    assert [rank(p["ms"])[0] for p in points] == ["slow", "eager", "eager"]
    assert gated == [("flat", 16), ("eager", 256), ("slow", 1)]  # eager's run now spans 16..256
    assert all("flat" in p["rejected"] for p in points[:2]) and "flat" in points[2]["ms"]
    assert rep[0]["ms"] == ms[0]  # the representative's points are left as they were
    # past the budget only checks already had are used: a missing one leaves the member unchecked
    known = {("flat", 16): [False, None, "max error 9x the tolerance"], ("eager", 256): [True, 1e-6, ""]}
    assert calibrate_checks.check_member(run, s, "silu", (32,), rep, known, local=False) is None
    known[("slow", 1)] = [True, 1e-6, ""]
    points = calibrate_checks.check_member(run, s, "silu", (32,), rep, known, local=False)
    assert [rank(p["ms"])[0] for p in points] == ["slow", "eager", "eager"]


def test_activation_classes_follow_cost_and_the_backends_that_serve_them():
    """fused_linear's cheap activations share relu's timings and its transcendental ones gelu_tanh's
    (their eager gradients differ 2x in cost); each representative is served by cuBLASLt, so its
    timings cover every member's backends; a member whose backends the representative lacks is
    measured alone."""
    from dispatch.calibrate_plan import classes, servers

    fl = classes("fused_linear", tuple(calibrate.ACTIVATION_NAMES))
    assert fl == [("identity",), ("relu", "leaky_relu", "squared_relu"), ("gelu_tanh", "gelu", "silu")]
    for cls in fl:
        assert all(servers("fused_linear", a) <= servers("fused_linear", cls[0]) for a in cls)
    assert "cublaslt" in servers("fused_linear", "relu") and "cublaslt" not in servers("fused_linear", "silu")
    assert classes("fused_linear", ("silu", "relu")) == [("relu",), ("silu",)]
    assert classes("fused_linear", ("gelu", "silu")) == [("gelu", "silu")]
    assert classes("bias_act_dropout", ("gelu", "silu")) == [("gelu", "silu")]


def test_a_member_keeps_the_timings_of_the_backends_that_serve_it(user_dir, fake_backends, monkeypatch):
    """'lt' serves relu only and is fastest: relu's entry picks it, leaky_relu (sharing relu's
    timings) never sees it."""
    eager = registry.get("eager")
    lt = registry.Backend("lt", eager.ops, eager.devices, eager.dtypes, ("relu",), True, "relu only")
    monkeypatch.setitem(registry._BACKENDS, "lt", lt)
    fake_backends["lt"] = lambda m: 0.5
    out = user_dir / "members.json"
    args = ["--quick", "--dtypes", "float32", "--ops", "fused_linear", "--modes", "inference",
            "--activations", "relu", "leaky_relu", "--features", "32,16", "--tokens", "1", "1024",
            "--backends", "flat", "lt", "--out", str(out)]  # fmt: skip
    assert calibrate.main(args) == 0
    entries = {e["activation"]: e for e in heuristics.load_table(str(out)).data["entries"]}
    assert entries["leaky_relu"]["measured_as"] == "relu"
    assert {s["backend"] for s in entries["relu"]["segments"]} == {"lt"}
    assert all("lt" in p["ms"] for p in entries["relu"]["points"])
    member = entries["leaky_relu"]
    assert all(p["ms"] and "lt" not in p["ms"] for p in member["points"])
    assert [s["backend"] for s in member["segments"]] == ["eager", "flat"]


def test_timing_rounds_interleave_the_backends(monkeypatch):
    """time_all times every backend once per round, rotating who goes first, and keeps the median of
    its rounds; a backend whose timing raises is reported, the others still timed."""
    calls = []
    values = {"a": [3.0, 1.0, 2.0], "b": [4.0, 4.0, 4.5], "c": []}

    def per_call_ms(fn, leaves, device, quick, training, share=1.0, warm=True, **kw):
        calls.append(fn)
        assert share == pytest.approx(1 / timing.ROUNDS)
        if fn == "c":
            raise RuntimeError("out of resources")
        return values[fn][sum(c == fn for c in calls) - 1]

    monkeypatch.setattr(timing, "per_call_ms", per_call_ms)
    timers = {name: calibrate_bench.Timer(name, []) for name in "abc"}
    times, spent = calibrate_bench.time_all(timers, torch.device("cpu"), True, False)
    assert calls == ["a", "b", "c", "b", "a", "a", "b"]  # rounds a b c, b (c) a, (c) a b
    assert times["a"] == 2.0 and times["b"] == 4.0 and isinstance(times["c"], RuntimeError)
    assert set(spent) == {"a", "b", "c"}


def test_member_checks_in_worker_processes(user_dir):
    """A full run with workers: the members' first check per segment runs in the workers, and every
    member ends parity-checked with its error recorded. Eager alone: the mechanism is the same for
    every backend, and nvfuser's compiles (one per M, 2-3 s each with dropout on 2 cores, in this
    process and again in each worker) were most of this test's 27 s."""
    path = user_dir / "members.json"
    args = ["--ops", "bias_act_dropout", "--dtypes", "float32", "--modes", "inference", "--activations",
            "gelu", "silu", "--features", "32", "--tokens", "1", "64", "--backends", "eager", "--workers", "1",
            "--out", str(path)]
    assert calibrate.main(args) == 0
    doc = json.loads(path.read_text())
    st = doc["settings"]
    assert st["members_unchecked"] == 0 and st["parallel_member_checks"]["points"] >= 2, st
    silu = [e for e in doc["entries"] if e["activation"] == "silu"]
    assert silu and all(e["measured_as"] == "gelu" and e["parity_checked"] for e in silu)
    assert all(seg["errors"] for e in silu for seg in e["segments"])


def test_a_failing_worker_is_reported_not_fatal():
    """A worker that dies (here: a device string torch rejects) leaves no results and its last
    stderr line in the summary; the caller goes on."""
    from dispatch import calibrate_workers

    class Nonsense:
        type = "cpu"

        def __str__(self) -> str:
            return "no-such-device"

    job = [0, "bias_act_dropout", "float32", "relu", False, False, 4, [8], ["eager"]]
    results, summary = calibrate_workers.check([job], 1, 120, Nonsense())
    assert results == {} and summary["unfinished"] == 1
    assert len(summary["worker_errors"]) == 1 and "no-such-device" in summary["worker_errors"][0]


def test_stream_timing_counts_host_time_and_clears_grads():
    """timing.stream_ms: back-to-back calls, so a host-bound call's host time is what it reports; grads
    cleared before each call as do_bench does; 3 calls for a long call, else as many as fill the
    budget by the first estimate (3 to 200)."""
    import time as _time

    leaf = torch.randn(3, requires_grad=True)
    seen = []

    def slow():  # longer than LONG_MS: three calls and done
        seen.append(leaf.grad is None)
        leaf.grad = torch.ones(3)
        _time.sleep(timing.LONG_MS * 2e-3)

    cpu = torch.device("cpu")
    ms = timing.stream_ms(slow, [leaf], budget_ms=100.0, device=cpu)
    assert len(seen) == 3 and all(seen)
    assert timing.LONG_MS * 2 <= ms < timing.LONG_MS * 20

    seen.clear()

    def short():
        seen.append(leaf.grad is None)
        leaf.grad = torch.ones(3)
        _time.sleep(0.1e-3)

    ms = timing.stream_ms(short, [leaf], budget_ms=3.0, device=cpu)
    assert 0.1 <= ms < timing.LONG_MS and all(seen)
    assert 3 + 3 <= len(seen) <= 3 + 30  # the second pass: about budget / first estimate calls
    seen.clear()
    timing.stream_ms(lambda: seen.append(1), [], budget_ms=1e6, device=cpu)
    assert len(seen) == 3 + 200


def test_time_all_passes_each_timers_call_count(monkeypatch):
    """time_all hands timing.per_call_ms a Timer's op calls per run (one unless it says more), so every
    time it reports is per op call."""
    seen = {}

    def per_call_ms(fn, leaves, device, quick, training, share=1.0, warm=True, calls=1):
        seen.setdefault(fn(), set()).add(calls)
        return 1.0

    monkeypatch.setattr(timing, "per_call_ms", per_call_ms)
    timer = calibrate_bench.Timer
    timers = {"chained": timer(lambda: "chained", [], 4), "single": timer(lambda: "single", [])}
    calibrate_bench.time_all(timers, torch.device("cpu"), False, True)
    assert seen == {"chained": {4}, "single": {1}}


def test_per_call_ms_is_per_op_call_on_cpu():
    """timing.per_call_ms divides by the op calls a run makes: a run of 4 sleeps of 2 ms is ~2 ms per
    call."""
    def run():
        for _ in range(4):
            time.sleep(0.002)

    ms = timing.per_call_ms(run, [], torch.device("cpu"), True, True, calls=4)
    assert 1.9 <= ms < 7.0  # undivided it would be >= 8 ms; a busy host oversleeps a little


def test_per_call_ms_cuda_branch_is_per_op_call(monkeypatch):
    """The CUDA branch's arithmetic with a stand-in device, clock and do_bench: a run of 4 op calls
    is reported per op call, its first estimate is one run, long calls skip do_bench, short ones take
    the larger of do_bench's device time and the wall time, both per op call."""
    import types

    import triton.testing

    cuda = types.SimpleNamespace(type="cuda")
    per_run = {"ms": 0.0}
    runs_asked = []

    def back_to_back(fn, leaves, runs, device):
        runs_asked.append(runs)
        return per_run["ms"]  # wall ms per run of fn

    def no_do_bench(*a, **k):
        raise AssertionError("do_bench is for calls shorter than LONG_MS")

    monkeypatch.setattr(timing, "back_to_back_ms", back_to_back)
    monkeypatch.setattr(triton.testing, "do_bench", no_do_bench)
    long_ms = timing.LONG_MS * 2
    per_run["ms"] = 4 * long_ms
    assert timing.per_call_ms(lambda: None, [], cuda, True, True, warm=False, calls=4) == long_ms
    assert runs_asked == [1]  # one run of 4 calls, about what 3 single calls cost before
    # short calls: do_bench's device time per run (4 calls) against the wall time per call
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: 40 * timing.LONG_MS)
    per_run["ms"] = 4 * 0.01
    got = timing.per_call_ms(lambda: None, [], cuda, True, True, warm=False, calls=4)
    assert got == 10 * timing.LONG_MS  # the device's 40 x LONG_MS a run over 4 calls


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["bias_act_dropout", "fused_linear"])
def test_training_timer_chains_calls_into_one_backward(op):
    """On CUDA a training timer runs TRAIN_CHAIN forwards and one backward: each leaf's grad is then
    TRAIN_CHAIN times one call's (same inputs, no dropout), so the timed work is TRAIN_CHAIN full calls."""
    features = (96,) if op == "bias_act_dropout" else (96, 80)
    case = calibrate_bench.Case(op, torch.float32, "gelu", True, False, 50, features, torch.device("cuda"))
    inp = calibrate_bench.make_inputs(case, seed=int(torch.randint(0, 2**30, ()).item()))
    single = calibrate_bench.run_once("eager", case, inp)[1:]
    fn, leaves, calls = calibrate_bench.timer("eager", case, inp)
    assert calls == calibrate_bench.TRAIN_CHAIN
    fn()
    for leaf, grad in zip(leaves, single):
        torch.testing.assert_close(leaf.grad, grad * calls, rtol=1e-5, atol=1e-5)


def test_slow_calls_get_one_timing_round(monkeypatch):
    """time_all: a backend whose first round took SLOW_MS or more is not timed again; the others get
    every round; the first round warms each backend up (warm=True), later rounds do not."""
    calls = []

    def fake_per_call_ms(fn, leaves, device, quick, training, share=1.0, warm=True, **kw):
        calls.append((fn(), warm))
        return {"slow": timing.SLOW_MS * 2, "fast": 0.1}[fn()]

    monkeypatch.setattr(timing, "per_call_ms", fake_per_call_ms)
    timer = calibrate_bench.Timer
    timers = {"slow": timer(lambda: "slow", []), "fast": timer(lambda: "fast", [])}
    out, _ = calibrate_bench.time_all(timers, torch.device("cpu"), False, False)
    assert out == {"slow": timing.SLOW_MS * 2, "fast": 0.1}
    assert [c for c in calls if c[0] == "slow"] == [("slow", True)]
    assert [w for n, w in calls if n == "fast"] == [True] + [False] * (timing.ROUNDS - 1)


def test_hopeless_in_needs_a_loss_beyond_hopeless_at_every_timed_point():
    from dispatch.calibrate_plan import HOPELESS, hopeless_in

    far = HOPELESS + 0.5
    points = [
        {"ms": {"eager": 1.0, "triton": 0.5, "nvfuser": 0.5 * far, "inductor": 0.5 * far}},
        {"ms": {"eager": 1.0, "triton": 0.9, "inductor": 0.95}},  # inductor close here; nvfuser not timed
        {"ms": {}},  # a point where every backend failed its gate
    ]
    assert hopeless_in(points) == {"nvfuser"}
    assert hopeless_in([{"ms": {"eager": far, "triton": 1.0}}]) == set()  # eager is never dropped


def test_a_familys_first_series_drops_its_hopeless_backends_from_the_later_ones(user_dir, fake_backends):
    """'slow' (10 + M ms against eager's 1 + M / 100) loses by more than HOPELESS everywhere at the
    first feature size, so the family's later sizes (held-out points included) never time it."""
    out = user_dir / "family.json"
    args = ["--quick", "--dtypes", "float32", "--ops", "bias_act_dropout", "--activations", "gelu",
            "--modes", "inference", "--features", "32", "48", "--tokens", "1", "64",
            "--backends", "flat", "slow", "--out", str(out)]  # fmt: skip
    assert calibrate.main(args) == 0
    data = heuristics.load_table(str(out)).data
    timed = {}
    for e in data["entries"]:
        for p in e["points"] + e["held_out"]:
            timed.setdefault((e["features"][0], e["dropout"]), set()).update(p["ms"])
    for dropout in (False, True):
        assert "slow" in timed[(32, dropout)] and "slow" not in timed[(48, dropout)]
        assert {"eager", "flat"} <= timed[(48, dropout)]
    later = [x for x in data["settings"]["series_seconds"] if x["features"] == [48]]
    assert later and all(x["skipped"] == ["slow"] for x in later)


def test_contenders_drop_clear_losers_after_two_points():
    from dispatch.calibrate_plan import HOPELESS, PRUNE, contenders

    names = ["eager", "triton", "nvfuser", "inductor"]
    slow = 1 + PRUNE + 0.05
    one = {256: {"ms": {"eager": 1.0, "triton": 0.5, "nvfuser": 0.5 * slow, "inductor": 0.6}}}
    assert contenders(names, one) == names  # one point is not enough to judge a loss below HOPELESS
    # ... but a loss above HOPELESS is (eager stays whatever its time)
    hopeless = {65536: {"ms": {"eager": 3.0, "triton": 1.0, "nvfuser": 2.0, "inductor": HOPELESS + 0.05}}}
    assert contenders(names, hopeless) == ["eager", "triton", "nvfuser"]
    two = {**one, 65536: {"ms": {"eager": 2.0, "triton": 1.0, "nvfuser": 1.0 * slow, "inductor": 0.9}}}
    # nvfuser lost by more than PRUNE at both; inductor lost at one and won at the other; eager stays
    assert contenders(names, two) == ["eager", "triton", "inductor"]
    # a backend absent from a point (rejected there) is judged on the points that timed it
    three = {**two, 1: {"ms": {"eager": 0.1, "triton": 0.1}}}
    assert contenders(names, three) == ["eager", "triton", "inductor"]
    near = {m: {"ms": {"eager": 1.0, "triton": 1.0 + PRUNE - 0.01}} for m in (1, 2)}
    assert contenders(["eager", "triton"], near) == ["eager", "triton"]


def test_bisection_points_are_multiples_of_16_where_one_fits():
    def two(a, b):
        return {a: {"ms": {"eager": 1.0, "triton": 2.0}}, b: {"ms": {"eager": 2.0, "triton": 1.0}}}

    assert to_bisect(two(4096, 6096), 1.2) == [4992]  # sqrt is 4997
    assert to_bisect(two(256, 4096), 1.5) == [1024]
    assert to_bisect(two(16, 32), 1.2) == [23]  # no multiple of 16 strictly between
    assert to_bisect(two(1, 16), 1.5) == [4]
    for a, b in [(17, 40), (100, 300), (33, 47)]:
        (m,) = to_bisect(two(a, b), 1.01)
        assert a < m < b


def test_missed_picks_are_timed_again_and_the_self_check_reports_both(user_dir, fake_backends):
    """A held-out point whose first timings flatter another backend (the minimum of noisy numbers) is
    timed again in more rounds; the verdict uses the new timings, the first ones stay on record."""
    from tqdm import tqdm

    from dispatch import calibrate_report
    from dispatch.calibrate_run import Run

    out = user_dir / "confirm.json"
    args = ["--quick", "--dtypes", "float32", "--ops", "bias_act_dropout", "--activations", "gelu",
            "--modes", "inference", "--features", "32", "--tokens", "1", "1024",
            "--backends", "flat", "--out", str(out)]  # fmt: skip
    assert calibrate.main(args) == 0
    doc = heuristics.load_table(str(out)).data
    assert doc["self_check"]["meets_targets"] and not doc["self_check"]["confirmed_points"]
    found = calibrate_report.picks(doc)
    e, pt, chosen = found[len(found) // 2]
    first = dict(pt["ms"])
    pt["ms"][chosen] = round(max(first.values()) * 1.5, 5)  # a slow phase hit the pick's first timing
    assert calibrate_report.suspect(pt, chosen)
    assert calibrate_report.self_check(doc)["worst_regret"] == pytest.approx(0.5, abs=1e-3)

    plan = calibrate.make_plan(calibrate.parse_args(args), torch.device("cpu"))
    with tqdm(disable=True) as bar:
        summary = calibrate_checks.confirm(Run(plan, None, bar), doc, 30.0)
    assert summary["points"] == 1 and summary["timed_again"] == 1
    assert pt["confirmed_ms"] == pytest.approx({n: fake_backends[n](pt["m"]) for n in first})
    check = calibrate_report.self_check(doc)
    assert check["confirmed_points"] == 1 and check["meets_targets"]
    assert check["first_timings"]["worst_regret"] == pytest.approx(0.5, abs=1e-3)
    with tqdm(disable=True) as bar:  # a later run (--refresh, --resume) keeps them
        assert calibrate_checks.confirm(Run(plan, None, bar), doc, 30.0) is None
    line = calibrate_report.format_self_check(check)
    assert "PASS" in line and "timed again" in line and "+50.0%" in line


def test_narrow_wins_over_eager_are_timed_again_before_the_fit(user_dir, fake_backends):
    """A measured point whose winner beats eager by less than NARROW on a short call is timed again
    before the fit keeps it: a first timing that flattered 'flat' (a noisy minimum) no longer moves
    the crossover, and the members sharing the point take the new timings of their own backends."""
    from tqdm import tqdm

    from dispatch.calibrate_run import Run

    out = user_dir / "narrow.json"
    args = ["--quick", "--dtypes", "float32", "--ops", "bias_act_dropout", "--modes", "inference",
            "--activations", "relu", "identity", "--features", "32", "--tokens", "1", "1024",
            "--backends", "flat", "--out", str(out)]  # fmt: skip
    assert calibrate.main(args) == 0
    doc = heuristics.load_table(str(out)).data
    # 'flat' overtakes eager near M = 111 under the synthetic clock; no point of this run is narrow,
    # so none was timed again
    assert doc["settings"]["narrow_wins_timed_again"] is None
    plan = calibrate.make_plan(calibrate.parse_args(args), torch.device("cpu"))
    with tqdm(disable=True) as bar:
        run = Run(plan, None, bar, doc)
    rep = next(e for e in run.entries.values() if e["activation"] == e["measured_as"] == "relu")
    member = next(e for e in run.entries.values() if e["activation"] == "identity")
    def picks(e):
        return [(s["m_from"], s["backend"]) for s in e["segments"]]

    assert picks(rep) == picks(member)
    # a slow phase hit eager's first timing at the largest point where eager still wins
    p = max((p for p in rep["points"] if rank(p["ms"])[0] == "eager"), key=lambda p: p["m"])
    true = {n: fake_backends[n](p["m"]) for n in p["ms"]}
    assert true["eager"] < true["flat"]
    for e in (rep, member):
        q = next(q for q in e["points"] if q["m"] == p["m"])
        q["ms"]["eager"] = round(true["flat"] * (1 + calibrate_checks.NARROW / 2), 5)
        e["segments"] = fit(e["points"])
    assert calibrate_checks.narrow(p) == pytest.approx(calibrate_checks.NARROW / 2, abs=1e-3)
    flattered = [s["m_from"] for s in rep["segments"] if s["backend"] == "flat"]
    member["parity_checked"] = True  # as if checked by an earlier part of a resumed run
    with tqdm(disable=True) as bar:
        run.bar = bar
        summary = calibrate_checks.confirm_narrow(run, 30.0)
    assert summary["points"] == 1 and summary["timed_again"] == 1 and summary["winner_changed"] == 1
    assert p["ms"] == pytest.approx(true) and p["first_ms"]["eager"] > true["flat"]
    moved = [s["m_from"] for s in rep["segments"] if s["backend"] == "flat"]
    assert moved[0] > flattered[0]  # the crossover moved back up to where 'flat' really wins
    q = next(q for q in member["points"] if q["m"] == p["m"])
    assert q["ms"] == pytest.approx(true) and "first_ms" in q
    assert picks(member) == picks(rep) and not member["parity_checked"]  # to be checked again
    with tqdm(disable=True) as bar:  # timed again once: a later part keeps the timings
        run.bar = bar
        assert calibrate_checks.confirm_narrow(run, 30.0) is None
