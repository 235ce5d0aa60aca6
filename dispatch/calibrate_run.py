"""The measuring loop of ``python -m dispatch.calibrate``: one Run holds the plan, the clock, the
progress bar and the table entries, and measures series (one representative activation of one key
family at one feature size) point by point: parity gate first, then timing."""

from __future__ import annotations

import time
import zlib
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from dispatch import calibrate_bench as bench
from dispatch import calibrate_workers
from dispatch.calibrate_plan import (
    NOISE,
    Plan,
    Series,
    classes,
    contenders,
    fit,
    held_out_ms,
    hopeless_in,
    rank,
    servers,
    spread,
    to_bisect,
)
from dispatch.registry import backends


def member_points(points: list[dict], op: str, activation: str) -> list[dict]:
    """A representative's points as a member's start: the timings of the backends that serve the
    member (cuBLASLt's timings of relu are no timings of leaky_relu), none of the representative's
    gate results or its list of backends still to check (a member is checked on its own)."""
    serve = servers(op, activation)
    return [
        {
            **{k: v for k, v in p.items() if k != "unchecked"},
            "ms": {n: t for n, t in p["ms"].items() if n in serve},
            "err": {},
            "rejected": {},
        }
        for p in points
    ]


def _key(e: dict) -> tuple:
    return (e["op"], e["dtype"], e["activation"], e["mode"], e["dropout"], tuple(e["features"]))


class Run:
    """One calibration: the plan, the clock, the progress bar, and the entries measured so far."""

    def __init__(
        self,
        plan: Plan,
        only: Optional[set[str]],
        bar: tqdm,
        previous: Optional[dict] = None,
        workers: int = 0,
    ) -> None:
        self.plan, self.only, self.bar = plan, only, bar
        # with worker processes, points are timed now and parity-checked by the workers afterwards
        # (calibrate_checks.check_deferred), before anything is fit for good; without, each point is
        # checked first
        self.workers = workers
        self.start = time.monotonic()
        self.stopped = False  # whether the budget (or a phase's share of it) ever cut a phase short
        self.reserve = 0.0  # the share of the budget the current phase leaves to the later ones
        self.entries: dict[tuple, dict] = {_key(e): e for e in (previous or {}).get("entries", [])}
        self.used: set[str] = set((previous or {}).get("backends", {}))
        # seconds spent per backend: "check" (parity gate, first-call compiles included) and "time"
        self.cost: dict[str, dict[str, float]] = {}
        self.held_sizes: list[dict] = list((previous or {}).get("held_out_sizes", []))
        # per series: its label, sizes, points, wall seconds and timing seconds by backend (where a
        # full run's time goes; settings.series_seconds in the table)
        self.series_log: list[dict] = []
        # per family (op, dtype, mode, dropout, measured activation): the backends its first series
        # found hopeless everywhere, left out of its later series (calibrate_plan.hopeless_in)
        self.dropped: dict[tuple, set[str]] = {}

    def spent(self, name: str, what: str, since: float) -> None:
        entry = self.cost.setdefault(name, {"check": 0.0, "time": 0.0})
        entry[what] += time.monotonic() - since

    def over(self) -> bool:
        """Past the budget, less the share ``reserve`` kept for the phases still to come."""
        if time.monotonic() - self.start > self.plan.budget_s * (1.0 - self.reserve):
            self.stopped = True
            return True
        return False

    def case(self, s: Series, activation: str, m: int, features: tuple[int, ...]) -> bench.Case:
        return bench.Case(
            s.op, s.dtype, activation, s.mode == "training", s.dropout, m, features, self.plan.device
        )

    def names(self, case: bench.Case) -> list[str]:
        """eager first, then every backend that would serve this call on its own (never an interpreter)."""
        call = case.call()
        ok = [n for n, b in backends().items() if not b.not_supported_reasons(call, explicit=False)]
        return sorted(
            (n for n in ok if self.only is None or n in self.only or n == "eager"), key=lambda n: n != "eager"
        )

    def candidates(self, s: Series, case: bench.Case) -> list[str]:
        """``names`` less the backends ``s``'s family has dropped."""
        dropped = self.dropped.get((s.op, s.dtype, s.mode, s.dropout, s.rep), set())
        return [n for n in self.names(case) if n not in dropped]

    def gate(
        self, name: str, case: bench.Case, inp: bench.Inputs, refs: list, eager: list, point: dict
    ) -> bool:
        return self.verdict(point, name, calibrate_workers.gate(name, case, inp, refs, eager))

    @staticmethod
    def verdict(point: dict, name: str, result: list) -> bool:
        """Records a gate result ([passed, error, why]) in ``point``; a failed backend leaves its timings."""
        ok, error, why = result
        if ok:
            point["err"][name] = error
        else:
            point["ms"].pop(name, None)
            point["rejected"][name] = why
        return ok

    def measure(self, case: bench.Case, names: Sequence[str]) -> dict:
        """Parity-check each backend at this shape, then time those that passed."""
        mode = "training" if case.training else "inference"
        dims = "x".join(map(str, (case.m, *case.features)))
        drop = " dropout" if case.dropout else ""
        self.bar.set_description_str(
            f"{case.op} {str(case.dtype)[6:]} {case.activation} {mode}{drop} {dims}", False
        )
        point: dict = {"m": case.m, "ms": {}, "err": {}, "rejected": {}}
        try:
            if self.workers:
                inp, passed = bench.make_inputs(case, zlib.crc32(repr(case).encode())), list(names)
            else:
                start = time.monotonic()
                inp, refs, eager = calibrate_workers.inputs(case)
                self.spent("reference", "check", start)
                passed = []
                for name in names:
                    start = time.monotonic()
                    if self.gate(name, case, inp, refs, eager, point):
                        passed.append(name)
                    self.spent(name, "check", start)
                del refs, eager
            self.bar.set_postfix_str(", ".join(passed), refresh=True)
            timers = {name: bench.timer(name, case, inp) for name in passed}
            times, spent = bench.time_all(timers, case.device, self.plan.quick, case.training)
            for name, ms in times.items():
                if isinstance(ms, Exception):
                    point["rejected"][name] = bench.failure(ms)
                else:
                    point["ms"][name] = float(f"{ms:.5g}")
                self.cost.setdefault(name, {"check": 0.0, "time": 0.0})["time"] += spent[name]
            if self.workers:
                point["unchecked"] = sorted(point["ms"])
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            point["skipped"] = bench.failure(exc)
        self.used.update(point["ms"])
        if case.device.type == "cuda":
            torch.cuda.empty_cache()
        return point

    def series(self, s: Series, features: tuple[int, ...]) -> None:
        """Coarse grid, bisection where the winner changes, held-out points; members share the result
        until the member phase checks them."""
        points: dict[int, dict] = {}
        start = time.monotonic()
        before = {n: c["time"] for n, c in self.cost.items()}
        grid = self.plan.grid(s.op, features)
        # the largest M first, then the middle, then the rest evenly: see contenders()
        even = spread(grid)
        pending = list(dict.fromkeys([grid[-1], even[0], *even]))
        while pending and not self.over():
            for m in pending:
                if self.over():
                    break
                case = self.case(s, s.rep, m, features)
                points[m] = self.measure(case, contenders(self.candidates(s, case), points))
            pending = [m for m in to_bisect(points, self.plan.ratio) if m not in points]
        measured = sorted(points)
        held = []
        for m in held_out_ms(
            measured, self.plan.m_cap(s.op, features), self.plan.held_out, f"{s.label} {features}"
        ):
            if not self.over():
                case = self.case(s, s.rep, m, features)
                held.append(self.measure(case, self.candidates(s, case)))
        self.add(s, s.rep, features, [points[m] for m in measured], held, True)
        family = (s.op, s.dtype, s.mode, s.dropout, s.rep)
        skipped = sorted(self.dropped.get(family, ()))
        self.dropped.setdefault(family, hopeless_in([points[m] for m in measured] + held))
        timing = {n: round(c["time"] - before.get(n, 0.0), 2) for n, c in self.cost.items()}
        self.series_log.append(
            {
                "series": s.label,
                "features": list(features),
                "points": len(measured) + len(held),
                "seconds": round(time.monotonic() - start, 2),
                "timing_s": {n: t for n, t in timing.items() if t},
                "skipped": skipped,  # dropped by the family's first series
            }
        )
        for member in s.members:
            shared = member_points([points[m] for m in measured], s.op, member)
            self.add(s, member, features, shared, [], False)

    def add(
        self,
        s: Series,
        act: str,
        features: tuple[int, ...],
        points: list[dict],
        held: list[dict],
        checked: bool,
    ) -> None:
        segments = fit(points)
        if segments:
            e = {
                "op": s.op,
                "dtype": str(s.dtype).removeprefix("torch."),
                "activation": act,
                "mode": s.mode,
                "dropout": s.dropout,
                "features": list(features),
                "measured_as": s.rep,
                "parity_checked": checked,
                "segments": segments,
                "points": points,
                "held_out": held,
            }
            self.entries[_key(e)] = e

    def probe(
        self, op: str, dtype: torch.dtype, mode: str, dropout: bool, acts: tuple[str, ...]
    ) -> list[Series]:
        """With --probe: time every activation at one mid shape; members that differ are measured alone."""
        out = []
        features = self.plan.features[op][0]
        m = min(4096, self.plan.m_cap(op, features))
        for cls in classes(op, acts):
            s = Series(op, dtype, mode, dropout, cls[0], [])
            if not self.plan.probe or len(cls) == 1 or self.over():
                out.append(Series(op, dtype, mode, dropout, cls[0], list(cls[1:])))
                continue
            timed = {
                a: self.measure(self.case(s, a, m, features), self.names(self.case(s, a, m, features)))["ms"]
                for a in cls
            }
            for a in cls[1:]:
                rep, mine = timed[cls[0]], timed[a]
                same = (
                    rep
                    and mine
                    and rank(rep)[0] == rank(mine)[0]
                    and all(abs(mine[b] / rep[b] - 1) <= 2 * NOISE for b in rep.keys() & mine.keys())
                )
                (s.members if same else out).append(a if same else Series(op, dtype, mode, dropout, a, []))
            out.append(s)
        return out
