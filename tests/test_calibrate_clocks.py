"""The calibrator's clocks and machinery: more rounds for slow calls, the host clock on the CPU,
short points chained alike, the CUDA branch on a stand-in device, real runs on the CPU (and on the GPU),
compiling ahead in workers, one process only; its modules stay small and Run only schedules."""

import os

import pytest
import torch

from dispatch import heuristics
from dispatch import calibrate, cases
from dispatch import table as table_cli
from dispatch.calibrate import __main__ as cli
from dispatch.calibrate import measure, plan
from dispatch.calibrate import run as runner
from calibration import CPU


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


def test_host_clock_waits_for_no_gpu():
    """Clock.time on the CPU: interleaved rounds, a median per entry, the baseline timed alongside, an
    entry that raises reported, an entry refused a start (no budget) not run at all."""
    case = cases.case("bias_act_dropout", torch.float32, "relu", False, False, 4, (8,), CPU)
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
    case = cases.case("fused_linear", torch.float32, "relu", True, False, 4, (8, 8), CPU)
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
    monkeypatch.setattr(timing, "sleep_cycles_per_ms", lambda device: 1e6)
    clock = measure.Clock(types.SimpleNamespace(type="cuda"), 3, True)
    case = cases.case("fused_linear", torch.float32, "relu", True, False, 4, (8, 8), CPU)
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
    served = cases.case("fused_linear", torch.float32, "relu", False, False, 4, (8, 8), CPU)
    long = measure.Timer(lambda: None, [], 1, "eager", served)
    got, _ = clock.time({"eager": long})
    assert runs == [2] + [5] * measure.SLOW_ROUNDS and measure.SLOW_ROUNDS == 7
    assert got["eager"].how == "events" and got["eager"].gpu_us == 7000.0  # one stray 30 ms outvoted


# ----------------------------------------------------------------------------- real clocks


def test_tiny_real_run_on_cpu(user_dir, capsys):
    """Eager and plain PyTorch, both ops and modes, real clocks: on the CPU both clocks are the wall time
    (no second self-check by GPU time: there is no capture); the choice tables show speedups over plain
    PyTorch."""
    out = user_dir / "tiny.json"
    argv = ["--quick", "--modes", "inference", "training", "--activations", "gelu", "--features", "64",
            "64,32", "--tokens", "1", "8", "--backends", "eager", "--out", str(out)]  # fmt: skip
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


@pytest.mark.gpu
@pytest.mark.long
def test_small_calibration_on_gpu(user_dir, capsys):
    """Every available backend, a few shapes, real clocks: GPU time from graphs (or the fallback named
    in the point), host cost behind a busy queue, the baseline at every point."""
    out = user_dir / "gpu.json"
    # the backends that compile nothing per kind of call: a compiling one takes minutes of this test
    argv = ["--quick", "--ops", "bias_act_dropout", "fused_linear", "--features", "4096", "4096,1024",
            "--tokens", "1", "4096", "--backends", "eager", "triton", "cublaslt", "--budget", "30",
            "--out", str(out)]  # fmt: skip
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


# ----------------------------------------------------------------------------- the calibrator's modules


def test_each_calibrator_module_stays_under_400_lines_and_run_only_schedules():
    """No module of dispatch/calibrate passes 400 lines; Run takes typed Settings and measures nothing
    itself (points, gates and entries are series.Measurer's and gate.Gates')."""
    folder = os.path.dirname(calibrate.__file__)
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                assert len(f.readlines()) <= 400, name
    own = {n for n, v in vars(runner.Run).items() if callable(v) and not n.startswith("_")}
    assert own == {"plan_tasks", "left", "run", "document"}, own
    # the clocks, the cases and the gates are series.Measurer's: the scheduler's module imports none
    assert not {"measure", "timing", "cases", "Gates", "Clock"} & set(vars(runner)), sorted(vars(runner))
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

    assert reps() == {"fused_mlp": {"gelu_tanh", "gelu", "swiglu"}, "bias_act_dropout": {"gelu", "relu"}}
    only = {"fused_mlp": {"swiglu", "relu"}, "bias_act_dropout": {"relu"}}  # swiglu is fused_mlp's alone
    assert reps("--activations", "swiglu", "relu") == only


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
    for kind in {(j[0], j[4]) for j in todo if j[0] == "triton"}:
        assert sum(any((j[0], j[4]) == kind for j in c) for c in chunks) == 1  # one worker a Triton kind
    for c in chunks:
        assert c == [j for j in todo if j in c]  # the run's order within a worker
    assert warm.deal(todo, 1) == [todo]


def test_torchrun_is_refused_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="one process"):
        calibrate.main(["--quick"])
