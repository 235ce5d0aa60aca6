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
from dispatch import calibrate_workers as workers_
from dispatch.calibrate_plan import NOISE, Plan, Series, classes, fit, held_out_ms, held_out_sizes, rank, to_bisect
from dispatch.registry import backends


def _key(e: dict) -> tuple:
    return (e["op"], e["dtype"], e["activation"], e["mode"], e["dropout"], tuple(e["features"]))


class Run:
    """One calibration: the plan, the clock, the progress bar, and the entries measured so far."""

    def __init__(
        self, plan: Plan, only: Optional[set[str]], bar: tqdm, previous: Optional[dict] = None, workers: int = 0
    ) -> None:
        self.plan, self.only, self.bar = plan, only, bar
        # with worker processes, points are timed now and parity-checked by the workers afterwards
        # (check_deferred), before anything is fit for good; without, each point is checked first
        self.workers = workers
        self.start = time.monotonic()
        self.stopped = False
        self.entries: dict[tuple, dict] = {_key(e): e for e in (previous or {}).get("entries", [])}
        self.used: set[str] = set((previous or {}).get("backends", {}))
        # seconds spent per backend: "check" (parity gate, first-call compiles included) and "time"
        self.cost: dict[str, dict[str, float]] = {}
        self.held_sizes: list[dict] = list((previous or {}).get("held_out_sizes", []))

    def _spent(self, name: str, what: str, since: float) -> None:
        entry = self.cost.setdefault(name, {"check": 0.0, "time": 0.0})
        entry[what] += time.monotonic() - since

    def over(self) -> bool:
        if time.monotonic() - self.start > self.plan.budget_s:
            self.stopped = True
        return self.stopped

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

    def _gate(
        self, name: str, case: bench.Case, inp: bench.Inputs, refs: list, eager: list, point: dict
    ) -> bool:
        return self._verdict(point, name, workers_.gate(name, case, inp, refs, eager))

    @staticmethod
    def _verdict(point: dict, name: str, result: list) -> bool:
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
                inp, refs, eager = workers_.inputs(case)
                self._spent("reference", "check", start)
                passed = []
                for name in names:
                    start = time.monotonic()
                    if self._gate(name, case, inp, refs, eager, point):
                        passed.append(name)
                    self._spent(name, "check", start)
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

    @staticmethod
    def _runs(points: list[dict]) -> list[list[dict]]:
        """Consecutive points with one winner (the segments a fit would make), points without timings
        left out."""
        runs: list[list[dict]] = []
        for p in (p for p in points if p["ms"]):
            if runs and rank(runs[-1][-1]["ms"])[0] == rank(p["ms"])[0]:
                runs[-1].append(p)
            else:
                runs.append([p])
        return runs

    def check_member(
        self,
        s: Series,
        act: str,
        features: tuple[int, ...],
        rep_points: list[dict],
        known: Optional[dict[tuple[str, int], list]] = None,
    ) -> list[dict]:
        """A member shares its representative's timings. Each run of consecutive points with one
        winner (a segment) is parity-checked for the member at its largest M, where accumulated error
        is largest; a winner that fails there leaves that run's points and the next best is checked,
        until every run's winner has passed. ``known``: gate results already had, by (backend, M)."""
        points = [{**p, "ms": dict(p["ms"]), "err": {}, "rejected": {}} for p in rep_points]
        checked: set[tuple[str, int]] = set()
        while True:
            todo = [(rank(r[-1]["ms"])[0], r) for r in self._runs(points) if (rank(r[-1]["ms"])[0], r[-1]["m"]) not in checked]
            if not todo:
                return points
            for pick, run in todo:
                probe = run[-1]
                if known and (pick, probe["m"]) in known:
                    ok = self._verdict(probe, pick, known[(pick, probe["m"])])
                else:
                    case = self.case(s, act, probe["m"], features)
                    inp, refs, eager = workers_.inputs(case)
                    start = time.monotonic()
                    ok = self._gate(pick, case, inp, refs, eager, probe)
                    self._spent(pick, "check", start)
                checked.add((pick, probe["m"]))
                if not ok:
                    for p in run:
                        p["ms"].pop(pick, None)
                        p["rejected"].setdefault(pick, probe["rejected"][pick])

    def series(self, s: Series, features: tuple[int, ...]) -> None:
        """Coarse grid, bisection where the winner changes, held-out points; members share the result
        until the member phase checks them."""
        points: dict[int, dict] = {}
        pending = self.plan.grid(s.op, features)
        while pending and not self.over():
            for m in pending:
                if self.over():
                    break
                case = self.case(s, s.rep, m, features)
                points[m] = self.measure(case, self.names(case))
            pending = [m for m in to_bisect(points, self.plan.ratio) if m not in points]
        measured = sorted(points)
        held = []
        for m in held_out_ms(
            measured, self.plan.m_cap(s.op, features), self.plan.held_out, f"{s.label} {features}"
        ):
            if not self.over():
                case = self.case(s, s.rep, m, features)
                held.append(self.measure(case, self.names(case)))
        self.add(s, s.rep, features, [points[m] for m in measured], held, True)
        for member in s.members:
            self.add(
                s, member, features, [{**points[m], "err": {}, "rejected": {}} for m in measured], [], False
            )

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

    def members(self) -> Optional[dict]:
        """Full runs, after every representative: parity-check each member (``check_member``). With
        workers, the first check of every segment runs in them, all at once; the rare fallback after
        a failed pick runs here. Returns the workers' summary, if they ran."""
        todo = []
        for key, e in list(self.entries.items()):
            rep = self.entries.get((*key[:2], e["measured_as"], *key[3:]))
            if not e["parity_checked"] and rep is not None:
                s = Series(e["op"], getattr(torch, e["dtype"]), e["mode"], e["dropout"], e["measured_as"])
                todo.append((s, e["activation"], tuple(e["features"]), rep["points"]))
        known: dict[tuple, list] = {}
        summary = None
        if self.workers and todo:
            jobs, where = [], []
            for s, act, feats, points in todo:
                for run in self._runs(points):
                    pick, m = rank(run[-1]["ms"])[0], run[-1]["m"]
                    jobs.append([len(jobs), *workers_.case_job(self.case(s, act, m, feats)), [pick]])
                    where.append((s.label, act, feats, pick, m))
            self.bar.set_description_str(f"member checks in {self.workers} processes", False)
            left = max(60.0, self.plan.budget_s - (time.monotonic() - self.start))
            results, summary = workers_.check(jobs, self.workers, left, self.plan.device, self.bar)
            for (label, act, feats, pick, m), job in zip(where, jobs):
                if pick in results.get(job[0], {}):
                    known[(label, act, feats, pick, m)] = results[job[0]][pick]
        for s, act, feats, points in todo:
            if self.over():
                break
            mine = {(pick, m): r for (label, a, f, pick, m), r in known.items() if (label, a, f) == (s.label, act, feats)}
            self.add(s, act, feats, self.check_member(s, act, feats, points, mine), [], True)
            self.bar.update()
        return summary

    def check_deferred(self, deadline_s: float) -> Optional[dict]:
        """With workers: parity-check every timed point (fit points, held-out points) in the worker
        processes, drop the backends that failed from those points, and refit every entry. A backend
        whose check did not finish counts as failed there."""
        pending: list[tuple[dict, dict]] = []
        for e in self.entries.values():
            for p in e["points"] + e["held_out"]:
                if "unchecked" in p and e["activation"] == e["measured_as"]:
                    pending.append((e, p))
        pending += [(h, h["point"]) for h in self.held_sizes if "unchecked" in h["point"]]
        if not pending:
            return None
        self.bar.reset(total=len(pending))
        self.bar.unit = "point"
        self.bar.set_description_str(f"parity checks in {self.workers} processes", False)
        jobs = []
        for i, (e, p) in enumerate(pending):
            case = bench.Case(
                e["op"], getattr(torch, e["dtype"]), e["activation"], e["mode"] == "training", e["dropout"],
                p["m"], tuple(e["features"]), self.plan.device,
            )
            jobs.append([i, *workers_.case_job(case), p["unchecked"]])
        results, summary = workers_.check(jobs, self.workers, deadline_s, self.plan.device, self.bar)
        redo = 0
        for i, (e, p) in enumerate(pending):
            got = results.get(i)
            names = p.pop("unchecked")
            if got is None:  # the worker ran out of memory or time: checked here, as without workers
                got = self._check_here(jobs[i], names)
                redo += 1
            for name in names:
                self._verdict(p, name, got.get(name, [False, None, "its parity check did not finish"]))
        summary["checked_in_this_process"] = redo
        for key, e in list(self.entries.items()):
            for p in e["points"]:
                p.pop("unchecked", None)  # members' copies of their representative's points
            segments = fit(e["points"])
            if segments:
                e["segments"] = segments
            else:
                del self.entries[key]
        self.bar.update(len(pending))
        return summary

    def _check_here(self, job: list, names: list[str]) -> dict[str, list]:
        """Gate results of a check job that the workers did not deliver (none if the case itself
        cannot run here)."""
        case = workers_.case_of(job[1:8], self.plan.device)
        try:
            inp, refs, eager = workers_.inputs(case)
            return {n: workers_.gate(n, case, inp, refs, eager) for n in names}
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            return {n: [False, None, bench.failure(exc)] for n in names}
        finally:
            if case.device.type == "cuda":
                torch.cuda.empty_cache()

    def held_out_at_other_sizes(self, series: list[Series]) -> None:
        """The self-check's points at feature sizes the plan does not measure (held_out_sizes): what
        the nearest-size lookup costs is measured, not assumed."""
        for s in series:
            for features, m in held_out_sizes(self.plan, s):
                if self.over():
                    return
                case = self.case(s, s.rep, m, features)
                self.held_sizes.append(
                    {
                        "op": s.op,
                        "dtype": str(s.dtype).removeprefix("torch."),
                        "activation": s.rep,
                        "mode": s.mode,
                        "dropout": s.dropout,
                        "features": list(features),
                        "point": self.measure(case, self.names(case)),
                    }
                )
                self.bar.update()

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
