"""What the calibrator times and how: one timer per entry (a backend through the public ops, or the
baseline, ``plan.BASELINE``: the composite a user writes), and the two clocks, on ``dispatch.timing``.
The inputs and the parity check are ``dispatch.cases``'.

The clocks (``Clock``), per op call, each the median of interleaved rounds (A B C, B C A, ...):
- ``gpu_us``: the calls unrolled in a CUDA graph and replayed (``timing.gpu_ms``, triton's
  do_bench_cudagraph): the kernels alone. A backend whose calls cannot be captured falls back to
  ``timing.wall_ms`` (do_bench) and the point says so (``gpu_clock``). A call of SLOW_MS or more is
  timed by events around back-to-back calls (its host time hides behind it), afresh in every round:
  one reading, taken right after each entry's first call in a fixed order, put eager at 1.18-1.32x
  plain PyTorch's identical kernels in three held-out runs at 12288 x 24576 x 6144 gelu (H200). A
  point whose contenders include such a call takes SLOW_ROUNDS rounds of SLOW_SAMPLE_MS samples.
- ``host_us``: the host's cost of a call, ``time.perf_counter`` around back-to-back calls queued behind
  a ``torch.cuda._sleep`` kernel that outlasts them, so the host never waits on the GPU. If the sleep
  ran out first (the call synchronizes, or the launch queue filled), it is retried longer with fewer
  calls, and the point lists the backend under ``drained`` if that fails too.
An entry at least SKIP_MS a call and over HOPELESS_X times the cheapest backend's estimate is not timed
in rounds: it keeps its estimate on both clocks (``gpu_clock`` says "estimate"), it cannot win there.
On a CPU there is one clock: both are ``timing.cpu_ms``, wall time per call.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch import timing
from dispatch.api import fused_bias_act_dropout, fused_linear
from dispatch.calibrate.plan import BASELINE
from dispatch.cases import Case, Inputs, leaf_tensors, make_inputs
from dispatch.contracts.activations import ACTIVATIONS

SLOW_MS = timing.SLOW_MS  # 5 ms; on a CPU 50 ms (fused_linear 64 x 3072 x 768 takes ~5 ms on 2 cores)
CPU_SLOW_MS = 50.0
# Calls of SLOW_MS or more, read by events: eager against PyTorch's identical ops (OPT-13B 12288 x 20480 x
# 5120 identity training, 11 ms a call, H200) read 1.066x / 0.990x over 3 rounds of 2 / 8 back-to-back
# calls, 1.003x / 1.002x over 7; 8 held-out calls of 5 ms or more 0.909-1.076x with 3 rounds of 2, then
# 0.951-1.018x in two runs with these settings. The GPU's clock moves with power and temperature over a
# few hundred ms: more rounds, spread in time, outvote it.
SLOW_ROUNDS = 7
SLOW_SAMPLE_MS = 40.0  # back-to-back calls per events sample: about this long, 2 to 8 calls
SLOW_CONTENDER = 1.25  # entries within this factor of the cheapest estimate decide the point's rounds
# calls unrolled per graph: ~0.5 ms of them, replayed 10 times. Capturing costs the host's time per call
# (100-300 us for a training step on the H200 host), so a 1 ms graph of a 10 us call spent ~20 ms of host
# time per sample; at 0.5 ms the events' few us around a replay stay under 1% of it.
GRAPH_REP_MS = 0.5
HOST_WINDOW_MS = 1.0  # host clock: about this much host time of back-to-back calls per sample, at most
HOST_RUNS = 20  # ... this many runs: 20 chained training runs are ~500 launches queued behind the sleep
HOST_CAP_MS = 10.0  # ... sized by at most this per call (slower calls are GPU-bound by far)
# Training is timed as TRAIN_CHAIN forwards and one backward over all their outputs: a model calls
# backward once per step, and autograd's fixed cost per backward() (~0.5 ms on the H200 host) belongs to
# no single op. Timed one call per backward it swamped the backends' differences (the table sent GPT-2's
# c_fc to cublaslt; patched GPT-2 then trained at 0.86x eager, 1.21x once chained timings chose triton).
TRAIN_CHAIN = 4
# ... but only where that fixed cost weighs: a point whose cheapest entry's single-call estimate is
# CHAIN_BELOW_MS or more is timed one forward per backward (the GPU then runs 4x fewer calls per sample).
CHAIN_BELOW_MS = 1.0
# An entry whose estimate (about max(host, GPU) per call) is at least SKIP_MS and more than HOPELESS_X
# times the cheapest backend's is kept at its estimate, untimed: eager's dropout (the RNG spec in int64
# tensor ops) and traced-Philox dropout run 7-150x triton's time, and timing them in rounds at
# 65536 x 4096 cost ~3 s a point, most of a dropout series' time.
SKIP_MS = 1.0
HOPELESS_X = 2.0


# ----------------------------------------------------------------------------- what is timed


class Timer(NamedTuple):
    """``fn`` runs ``calls`` op calls of entry ``name`` at ``case``; ``leaves``' grads reset before it.
    ``chained`` builds the TRAIN_CHAIN version of a one-call training timer."""

    fn: Callable[[], object]
    leaves: list[Tensor]
    calls: int
    name: str
    case: Case
    chained: Optional[Callable[[], "Timer"]] = None


def _composite(case: Case) -> Callable:
    act = ACTIVATIONS[case.activation].forward
    if case.op == "bias_act_dropout":
        return lambda x, b: F.dropout(act(x + b), case.p, training=True) if case.p else act(x + b)
    return lambda x, w, b: act(F.linear(x, w, b))


def timer(name: str, case: Case, inp: Inputs, chain: int = 1) -> Timer:
    """The op on backend ``name`` (or the baseline composite): forward, or ``chain`` forwards and one
    backward over their outputs (on a CPU always one: a call there dwarfs autograd's fixed cost)."""
    leaves = leaf_tensors(case, inp)
    act, p = case.activation, case.p
    if name == BASELINE:
        composite = _composite(case)

        def forward() -> Tensor:
            return composite(*leaves)
    elif case.op == "bias_act_dropout":

        def forward() -> Tensor:
            return fused_bias_act_dropout(leaves[0], leaves[1], act, p, True, backend=name)
    else:

        def forward() -> Tensor:
            return fused_linear(*leaves, act, backend=name)

    if not case.training:
        return Timer(forward, [], 1, name, case)
    cuda = case.device.type == "cuda"
    chain = chain if cuda else 1

    def step() -> None:
        outs = [forward() for _ in range(chain)]
        torch.autograd.backward(outs, [inp.grad_y] * chain)

    longer = (lambda: timer(name, case, inp, TRAIN_CHAIN)) if cuda and chain == 1 else None
    return Timer(step, leaves, chain, name, case, longer)


# ----------------------------------------------------------------------------- the clocks


@dataclass
class Timed:
    gpu_us: float
    host_us: float
    how: str  # how gpu_us was taken: "graph", "events", "do_bench (...)" or "wall" (CPU)
    drained: bool  # the host clock's queue ran dry: host_us may include waiting on the GPU


class Clock:
    """Times entries on both clocks in interleaved rounds; remembers which backends cannot be captured."""

    def __init__(self, device: torch.device, rounds: int, quick: bool) -> None:
        self.device, self.rounds, self.quick = device, rounds, quick
        self.cuda = device.type == "cuda"
        self.no_graph: dict[tuple, str] = {}  # (backend, op, training, dropout) -> why capture failed
        self._cycles_per_ms: Optional[float] = None

    def first(self, t: Timer) -> float:
        """Seconds of the untimed first call (a JIT backend compiles there); raises what it raises."""
        start = time.perf_counter()
        timing.reset_grads(t.leaves)
        t.fn()
        timing.synchronize(self.device)
        return time.perf_counter() - start

    def estimate_ms(self, t: Timer, runs: int = 2) -> float:
        """ms per op call of ``runs`` back-to-back runs between events: about max(host, GPU). 0 on a CPU."""
        if not self.cuda:
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timing.synchronize(self.device)
        start.record()
        for _ in range(runs):
            timing.reset_grads(t.leaves)
            t.fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / (runs * t.calls)

    def rounds_for(self, est: dict[str, float]) -> int:
        """Rounds for a point with these estimates (ms per op call): SLOW_ROUNDS where an entry close to
        the cheapest is read by events (SLOW_MS or more), else the clock's own."""
        if not self.cuda or not est:
            return self.rounds
        best = min(est.values())
        slow = any(e >= SLOW_MS for e in est.values() if e <= SLOW_CONTENDER * best)
        return max(self.rounds, SLOW_ROUNDS) if slow else self.rounds

    def slow(self, sample: Optional[Timed]) -> bool:
        """Whether an entry gets one round only: on a CPU a call of CPU_SLOW_MS or more (its wall time
        is the one clock, and its spread is small next to it); on a GPU none is."""
        return not self.cuda and sample is not None and sample.gpu_us >= CPU_SLOW_MS * 1e3

    def sample(self, t: Timer, est_ms: float) -> Timed:
        """One round of one entry."""
        if not self.cuda:
            ms = timing.cpu_ms(t.fn, 30.0 if self.quick else 60.0, t.leaves, t.calls)
            return Timed(ms * 1e3, ms * 1e3, "wall", False)
        host, drained = self.host_us(t, est_ms)
        if est_ms >= SLOW_MS:
            runs = max(2, min(8, math.ceil(SLOW_SAMPLE_MS / (est_ms * t.calls))))
            return Timed(self.estimate_ms(t, runs) * 1e3, host, "events", drained)
        gpu, how = self.gpu_us(t)
        return Timed(gpu, host, how, drained)

    def gpu_us(self, t: Timer) -> tuple[float, str]:
        key = (t.name, t.case.op, t.case.training, t.case.dropout)
        if key not in self.no_graph:
            try:
                return timing.gpu_ms(t.fn, GRAPH_REP_MS, t.leaves, t.calls) * 1e3, "graph"
            except Exception as exc:  # a backend whose calls cannot be captured
                self.no_graph[key] = timing.describe(exc)
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:
                    pass
        ms = timing.wall_ms(t.fn, self.device, 10 * GRAPH_REP_MS, t.leaves, t.calls)
        return ms * 1e3, f"do_bench (capture failed: {self.no_graph[key]})"

    def cycles_per_ms(self) -> float:
        if self._cycles_per_ms is None:
            self._cycles_per_ms = timing.sleep_cycles_per_ms(self.device)
        return self._cycles_per_ms

    def host_us(self, t: Timer, est_ms: float) -> tuple[float, bool]:
        """us of host time per op call (``timing.host_ms``), and whether its queue drained."""
        per_run = min(max(est_ms, 1e-3) * t.calls, HOST_CAP_MS)  # >= the host's time per run
        runs = max(1, min(HOST_RUNS, int(HOST_WINDOW_MS / per_run)))
        ms, drained = timing.host_ms(t.fn, self.device, runs, t.leaves, per_run, self.cycles_per_ms())
        return ms * 1e3 / t.calls, drained

    def prepare(
        self, timers: dict[str, Timer], may_start: Callable[[str], bool], spent: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, Union[Timed, Exception, str]]]:
        """Each entry's first call and estimate (ms per op call); then one decision for the whole
        point: if its cheapest entry's estimate is under CHAIN_BELOW_MS every training entry still
        in the running is re-built chained (``timers`` is updated in place). Returns the estimates of
        the entries to time in rounds, and the outcome of the others: an exception, the reason it was
        not started, or, for a hopeless entry (SKIP_MS, HOPELESS_X; never the baseline), its estimate
        on both clocks."""
        out: dict[str, Union[Timed, Exception, str]] = {}
        est: dict[str, float] = {}

        def run(name: str, t: Timer) -> None:
            start = time.monotonic()
            try:
                self.first(t)  # a chained run's first call allocates four live outputs (cudaMalloc)
                est[name] = self.estimate_ms(t)
            except Exception as exc:
                timing.settle(self.device)
                est.pop(name, None)
                out[name] = exc
            spent[name] += time.monotonic() - start

        for name, t in list(timers.items()):
            if may_start(name):
                run(name, t)
            else:
                out[name] = "not started: the family's budget is spent"
        best = min((e for n, e in est.items() if n != BASELINE), default=0.0)

        def hopeless(name: str) -> bool:
            return name != BASELINE and est[name] >= SKIP_MS and est[name] > HOPELESS_X * best

        for name in [n for n in est if hopeless(n)]:
            try:  # two runs can catch a host stall: the lower of two estimates decides
                est[name] = min(est[name], self.estimate_ms(timers[name]))
            except Exception as exc:
                timing.settle(self.device)
                out[name] = exc
                del est[name]
                continue
            if hopeless(name):
                out[name] = Timed(est[name] * 1e3, est[name] * 1e3, "estimate", False)
                del est[name]
        # Chained or not for every entry alike: a chained run's time per call includes W.grad's
        # accumulation over four calls, so mixing clocks in one point misranks them (neox-20b's
        # 256 x 6144 x 24576 gelu training: eager 564 us a call chained, inductor 405 single, a
        # 1.38x "miss"; all within 2% when both are chained).
        if est and min(est.values()) < CHAIN_BELOW_MS:
            for name in list(est):
                if timers[name].chained is not None:
                    timers[name] = timers[name].chained()
                    run(name, timers[name])
        return est, out

    def time(
        self, timers: dict[str, Timer], may_start: Callable[[str], bool] = lambda name: True
    ) -> tuple[dict[str, Union[Timed, Exception, str]], dict[str, float]]:
        """Each entry's median over the rounds, an exception where it raised, or the reason it was not
        started (``may_start(name)`` is asked before each first call); and each entry's seconds."""
        timers = dict(timers)
        spent = dict.fromkeys(timers, 0.0)
        est, out = self.prepare(timers, may_start, spent)
        samples: dict[str, list[Timed]] = {n: [] for n in est}
        for _, name in timing.rotations(list(est), self.rounds_for(est)):
            got = samples[name]
            if name in out or (got and self.slow(got[0])):
                continue
            start = time.monotonic()
            try:
                with torch.set_grad_enabled(timers[name].case.training):
                    got.append(self.sample(timers[name], est[name]))
            except Exception as exc:
                timing.settle(self.device)
                out[name] = exc
            spent[name] += time.monotonic() - start
        for name, got in samples.items():
            if name not in out and got:
                out[name] = Timed(
                    statistics.median(s.gpu_us for s in got),
                    statistics.median(s.host_us for s in got),
                    got[0].how,
                    any(s.drained for s in got),
                )
        return out, spent


def point(case: Case, names: list[str], clock: Clock, may_start: Callable[[str], bool]) -> tuple[dict, dict]:
    """One measured point: each entry's gpu_us and host_us (the baseline among them), the entries that
    failed or were not started, how a GPU time was taken where not by a graph. And seconds per entry."""
    pt: dict = {"m": case.m, "gpu_us": {}, "host_us": {}, "err": {}, "rejected": {}}
    spent: dict[str, float] = {}
    try:
        inp = make_inputs(case, case.seed)
        with torch.set_grad_enabled(case.training):
            got, spent = clock.time({n: timer(n, case, inp) for n in names}, may_start)
        for name, r in got.items():
            if isinstance(r, Timed):
                pt["gpu_us"][name], pt["host_us"][name] = float(f"{r.gpu_us:.4g}"), float(f"{r.host_us:.4g}")
                if r.how not in ("graph", "wall"):
                    pt.setdefault("gpu_clock", {})[name] = r.how
                if r.drained:
                    pt.setdefault("drained", []).append(name)
            else:
                pt["rejected"][name] = r if isinstance(r, str) else timing.describe(r)
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        pt["skipped"] = timing.describe(exc)
    if case.device.type == "cuda":
        torch.cuda.empty_cache()
    return pt, spent
