"""What the calibrator times and how: one timer per entry (a backend through the public ops, or BASELINE,
the composite a user writes, called directly) and two clocks on ``dispatch.timing``, each the median of
interleaved rounds; ``point`` measures one point of a series.

- ``gpu_us``: calls unrolled in a CUDA graph (``timing.gpu_ms``, do_bench_cudagraph): the kernels alone.
  A backend that cannot be captured falls back to do_bench and the point says so (``gpu_clock``). A call
  of SLOW_MS or more is read by events around back-to-back calls, afresh in every round (one reading
  right after each first call put eager at 1.18-1.32x PyTorch's identical kernels).
- ``host_us``: the host's cost of a call, back-to-back calls queued behind a ``torch.cuda._sleep`` kernel
  (``timing.host_ms``), so the host never waits on the GPU; ``drained`` if the sleep ran out anyway.
On a CPU both are ``timing.cpu_ms``, the wall time.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from dispatch import ops, timing
from dispatch.calibrate.plan import BASELINE
from dispatch.cases import Case, Inputs, leaf_tensors, make_inputs
from dispatch.contracts.op import outputs_of
from dispatch.heuristics.schema import Point

SLOW_MS = timing.SLOW_MS  # 5 ms
CPU_SLOW_MS = 50.0  # on a CPU such a call gets one round (fused_linear 64 x 3072 x 768 takes ~5 ms)
# Points whose close contenders (within SLOW_CONTENDER of the cheapest) take SLOW_MS or more: SLOW_ROUNDS
# rounds of ~SLOW_SAMPLE_MS samples. Eager against PyTorch's identical ops at 12288 x 20480 x 5120 (11 ms
# a call) read 1.066x over 3 rounds of 2 calls, 1.003x over 7: the GPU's clock moves with power
# and temperature over a few hundred ms, and more rounds spread in time outvote it.
SLOW_ROUNDS = 7
SLOW_SAMPLE_MS = 40.0
SLOW_CONTENDER = 1.25
# ~0.5 ms of calls per graph, replayed 10 times: capture costs the host's time per call (100-300 us for a
# training step on a slow host), and the events around a replay stay under 1% of it.
GRAPH_REP_MS = 0.5
HOST_WINDOW_MS = 1.0  # host clock: about this much host time of back-to-back calls per sample,
HOST_RUNS = 20  # at most this many runs (20 chained training runs are ~500 launches behind the sleep),
HOST_CAP_MS = 10.0  # sized by at most this per call (slower calls are GPU-bound by far)
# Training: TRAIN_CHAIN forwards and one backward over their outputs, as a model steps: autograd's fixed
# cost per backward() (~0.5 ms on a slow host) belongs to no single op (timed one call per backward it
# sent GPT-2's c_fc to cublaslt, and patched GPT-2 trained at 0.86x eager). Only where that cost weighs:
# a point whose cheapest entry is estimated at CHAIN_BELOW_MS or more runs one forward per backward.
TRAIN_CHAIN = 4
CHAIN_BELOW_MS = 1.0
# An entry of SKIP_MS or more a call and over HOPELESS_X times the cheapest keeps its estimate, untimed:
# eager's and the traced-Philox dropouts run 7-150x triton's time (~3 s a point in rounds at 65536 x 4096).
SKIP_MS = 1.0
HOPELESS_X = 2.0


class Timer(NamedTuple):
    """``fn`` runs ``calls`` op calls of entry ``name`` at ``case``, ``leaves``' grads reset before it;
    ``chained`` builds the TRAIN_CHAIN version of a one-call training timer."""

    fn: Callable[[], object]
    leaves: list[Tensor]
    calls: int
    name: str
    case: Case
    chained: Optional[Callable[[], "Timer"]] = None


def timer(name: str, case: Case, inp: Inputs, chain: int = 1) -> Timer:
    """The op on backend ``name`` through its public function, or for BASELINE the composite called
    directly (the floor: the dispatcher's few us per call are alike for every backend): a forward, or
    ``chain`` forwards and one backward over their outputs (one on a CPU, where a call dwarfs autograd's
    fixed cost)."""
    leaves = leaf_tensors(case, inp)
    run, backend = ops.get(case.op).run_case, (None if name == BASELINE else name)

    def forward() -> Tensor:
        return run(case, leaves, backend, None)  # the default generator: capturable

    if not case.training:
        return Timer(forward, [], 1, name, case)
    cuda = case.device.type == "cuda"
    chain = chain if cuda else 1

    def step() -> None:
        torch.autograd.backward([y for _ in range(chain) for y in outputs_of(forward())], inp.grads * chain)

    longer = (lambda: timer(name, case, inp, TRAIN_CHAIN)) if cuda and chain == 1 else None
    return Timer(step, leaves, chain, name, case, longer)


@dataclass
class Timed:
    gpu_us: float
    host_us: float
    how: str  # how gpu_us was taken: "graph", "events", "do_bench (...)", "wall" (CPU) or "estimate"
    drained: bool  # the host clock's queue ran dry: host_us may include waiting on the GPU


Outcome = Union[Timed, Exception, str]


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
        """ms per op call of ``runs`` back-to-back runs between events (about max(host, GPU)); 0 on a CPU."""
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
        """SLOW_ROUNDS where an entry close to the cheapest is read by events, else the clock's own."""
        if not self.cuda or not est:
            return self.rounds
        best = min(est.values())
        slow = any(e >= SLOW_MS for e in est.values() if e <= SLOW_CONTENDER * best)
        return max(self.rounds, SLOW_ROUNDS) if slow else self.rounds

    def sample(self, t: Timer, est_ms: float) -> Timed:
        """One round of one entry."""
        if not self.cuda:
            ms = timing.cpu_ms(t.fn, 30.0 if self.quick else 60.0, t.leaves, t.calls)
            return Timed(ms * 1e3, ms * 1e3, "wall", False)
        host_us, drained = self.host_us(t, est_ms)
        if est_ms >= SLOW_MS:
            runs = max(2, min(8, math.ceil(SLOW_SAMPLE_MS / (est_ms * t.calls))))
            return Timed(self.estimate_ms(t, runs) * 1e3, host_us, "events", drained)
        key = (t.name, t.case.op, t.case.training, t.case.dropout)
        if key not in self.no_graph:
            try:
                gpu_us = timing.gpu_ms(t.fn, GRAPH_REP_MS, t.leaves, t.calls) * 1e3
                return Timed(gpu_us, host_us, "graph", drained)
            except Exception as exc:  # a backend whose calls cannot be captured
                self.no_graph[key] = timing.describe(exc)
                timing.settle(self.device)
        ms = timing.wall_ms(t.fn, self.device, 10 * GRAPH_REP_MS, t.leaves, t.calls)
        return Timed(ms * 1e3, host_us, f"do_bench (capture failed: {self.no_graph[key]})", drained)

    def host_us(self, t: Timer, est_ms: float) -> tuple[float, bool]:
        """us of host time per op call (``timing.host_ms``), and whether its queue drained."""
        if self._cycles_per_ms is None:
            self._cycles_per_ms = timing.sleep_cycles_per_ms(self.device)
        per_run = min(max(est_ms, 1e-3) * t.calls, HOST_CAP_MS)  # >= the host's time per run
        runs = max(1, min(HOST_RUNS, int(HOST_WINDOW_MS / per_run)))
        ms, drained = timing.host_ms(t.fn, self.device, runs, t.leaves, per_run, self._cycles_per_ms)
        return ms * 1e3 / t.calls, drained

    def prepare(
        self, timers: dict[str, Timer], may_start: Callable[[str], bool], spent: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, Outcome]]:
        """Each entry's first call and estimate (ms per op call), then one decision for the point: under
        CHAIN_BELOW_MS every training entry is re-built chained (``timers`` updated in place). Returns
        the estimates of the entries to time in rounds and the outcome of the others: an exception, why
        it was not started, or a hopeless entry's estimate (SKIP_MS, HOPELESS_X over the cheapest entry;
        never the baseline, which every point times for the speedups)."""
        out: dict[str, Outcome] = {}
        est: dict[str, float] = {}

        def run(name: str, t: Timer, again: bool = False) -> None:
            start = time.monotonic()
            try:
                if not again:
                    self.first(t)  # a chained run's first call allocates four live outputs
                est[name] = min(est[name], self.estimate_ms(t)) if again else self.estimate_ms(t)
            except Exception as exc:
                timing.settle(self.device)
                est.pop(name, None)
                out[name] = exc
            spent[name] += time.monotonic() - start

        for name, t in list(timers.items()):
            if may_start(name):
                run(name, t)
            else:
                out[name] = "not started: the budget is spent"
        best = min(est.values(), default=0.0)
        hopeless = lambda n: n != BASELINE and est[n] >= SKIP_MS and est[n] > HOPELESS_X * best  # noqa: E731
        for name in [n for n in est if hopeless(n)]:
            run(name, timers[name], again=True)  # the lower of two estimates: one can catch a host stall
            if name in est and hopeless(name):
                out[name] = Timed(est[name] * 1e3, est[name] * 1e3, "estimate", False)
                del est[name]
        # Chained or not, every entry alike: a chained call's time includes W.grad's sum over four calls
        # (neox-20b 256 x 6144 x 24576 gelu: eager 564 us chained, inductor 405 single, a false 1.38x).
        if est and min(est.values()) < CHAIN_BELOW_MS:
            for name in [n for n in est if timers[n].chained is not None]:
                timers[name] = timers[name].chained()  # type: ignore[misc]
                run(name, timers[name])
        return est, out

    def time(
        self, timers: dict[str, Timer], may_start: Callable[[str], bool] = lambda name: True
    ) -> tuple[dict[str, Outcome], dict[str, float]]:
        """Each entry's median over the rounds (or its outcome), and each entry's seconds."""
        timers = dict(timers)
        spent = dict.fromkeys(timers, 0.0)
        est, out = self.prepare(timers, may_start, spent)
        samples: dict[str, list[Timed]] = {n: [] for n in est}
        for _, name in timing.rotations(list(est), self.rounds_for(est)):
            got = samples[name]
            if name in out or (got and not self.cuda and got[0].gpu_us >= CPU_SLOW_MS * 1e3):
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
                med = [statistics.median(getattr(s, k) for s in got) for k in ("gpu_us", "host_us")]
                out[name] = Timed(*med, got[0].how, any(s.drained for s in got))
        return out, spent


def point(
    case: Case, names: list[str], clock: Clock, may_start: Callable[[str], bool]
) -> tuple[Point, dict[str, float]]:
    """One measured point (each entry's gpu_us and host_us, what failed or was not started, how a GPU time
    was taken where not by a graph) and the seconds per entry."""
    pt: Point = {"m": case.m, "gpu_us": {}, "host_us": {}, "err": {}, "rejected": {}}
    spent: dict[str, float] = {}
    try:
        inp = make_inputs(case, case.seed)
        with torch.set_grad_enabled(case.training):
            got, spent = clock.time({n: timer(n, case, inp) for n in names}, may_start)
        for name, r in got.items():
            if not isinstance(r, Timed):
                pt["rejected"][name] = r if isinstance(r, str) else timing.describe(r)
                continue
            pt["gpu_us"][name], pt["host_us"][name] = float(f"{r.gpu_us:.4g}"), float(f"{r.host_us:.4g}")
            if r.how not in ("graph", "wall"):
                pt.setdefault("gpu_clock", {})[name] = r.how
            if r.drained:
                pt.setdefault("drained", []).append(name)
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        pt["skipped"] = timing.describe(exc)
    if case.device.type == "cuda":
        torch.cuda.empty_cache()
    return pt, spent
