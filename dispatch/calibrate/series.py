"""One series measured: its points along M, the entry they make once its winners pass their parity gates,
and its members' entries from the representative's timings; what each series spent goes in its log.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, cast

import torch
from tqdm import tqdm

from dispatch import cases
from dispatch.calibrate import measure
from dispatch.calibrate.gate import Gates
from dispatch.calibrate.plan import (
    BASELINE, Family, Plan, Series, contenders, held_out_ms, hopeless_in, preference, spread, to_bisect,
)  # fmt: skip
from dispatch.heuristics.schema import EntryId, EntryKey, EntryRecord, Point, key_fields
from dispatch.registry import backends


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entry_id(f: Family, act: Optional[str], dtype: torch.dtype, features: tuple[int, ...]) -> EntryId:
    """The id of the entry of family ``f`` at one variant (activation), dtype and feature size."""
    return EntryId(EntryKey.make(f.op, dtype_name(dtype), act, f.mode, f.dropout), tuple(features))


@dataclass
class SeriesLog:
    """What one measured series spent (a document's ``settings.series_seconds`` lists them)."""

    series: str
    features: list[int]
    points: int
    seconds: float
    dropped_by_family: list[str]  # backends the class's first size found hopeless
    timing_s: dict[str, float]  # timing and check seconds per backend
    point_s: dict[str, float]  # seconds per point, by M
    left_out: dict[str, str]  # backend -> why a point left it out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class Measurer:
    """Measures series of a plan on one clock. ``only``: the backends to time besides the baseline (None:
    every one); ``left()``: seconds of the budget left."""

    def __init__(
        self, plan: Plan, only: Optional[frozenset[str]], left: Callable[[], float], bar: tqdm
    ) -> None:
        self.plan, self.only, self.left, self.bar = plan, only, left, bar
        self.clock = measure.Clock(plan.device, plan.rounds, plan.quick)
        self.cost: dict[str, float] = defaultdict(float)  # timing and check seconds per backend
        self.gates = Gates(left, self.cost)
        self.dropped: dict[tuple, set[str]] = {}  # (family, rep) -> backends its first size found hopeless
        self.log: list[SeriesLog] = []

    def case(
        self, f: Family, act: Optional[str], dtype: torch.dtype, m: int, features: tuple[int, ...]
    ) -> cases.Case:
        return cases.case(f.op, dtype, act, f.mode == "training", f.dropout, m, features, self.plan.device)

    def names(self, case: cases.Case) -> list[str]:
        """The baseline, then every other backend that would serve this call on its own (never an
        interpreter), each once."""
        call = case.call()
        ok = [n for n, b in backends().items() if not b.not_supported_reasons(call, explicit=False)]
        return [BASELINE] + [n for n in ok if n != BASELINE and (self.only is None or n in self.only)]

    def point(self, case: cases.Case, names: list[str], timed: dict[int, float]) -> Point:
        """The point at ``case``; its seconds go in ``timed`` by M."""
        start = time.monotonic()
        dims = "x".join(map(str, (case.m, *case.features)))
        what = " ".join(filter(None, (case.op, dtype_name(case.dtype), case.variant, dims)))
        self.bar.set_description_str(what, False)
        # a first call (a compile) starts only while time is left; eager and the baseline compile nothing
        may_start = lambda n: n in ("eager", BASELINE) or self.left() > 0  # noqa: E731
        pt, spent = measure.point(case, names, self.clock, may_start)
        for n, t in spent.items():
            self.cost[n] += t
        timed[case.m] = round(time.monotonic() - start, 2)
        return pt

    def series(self, s: Series, features: tuple[int, ...]) -> Optional[EntryRecord]:
        """The representative's entry: largest M first, then the grid evenly, bisection where the winner
        changes, one held-out M for the self-check; then the parity gates. None where no winner passed."""
        f, start, before, timed = s.family, time.monotonic(), dict(self.cost), {}
        dropped = self.dropped.get((f, s.rep), set())
        grid = self.plan.grid(f.op, features, f.dtype)
        points: dict[int, Point] = {}
        pending = list(dict.fromkeys([grid[-1], *spread(grid)]))
        while pending:
            for m in pending:
                if points and self.left() <= 0:
                    break
                case = self.case(f, s.rep, f.dtype, m, features)
                names = [n for n in self.names(case) if n not in dropped]
                points[m] = self.point(case, contenders(names, points, s.partial), timed)
            new = to_bisect(points, self.plan.ratio, preference(f.mode), self.plan.device.type == "cuda")
            pending = [m for m in new if m not in points and self.left() > 0]
        held = []
        cap = self.plan.m_cap(f.op, features, f.dtype)
        for m in held_out_ms(sorted(points), cap, f"{s.label} {features}"):
            if self.left() > 0:
                case = self.case(f, s.rep, f.dtype, m, features)
                held.append(self.point(case, [n for n in self.names(case) if n not in dropped], timed))
        measured = [points[m] for m in sorted(points)]
        self.dropped.setdefault((f, s.rep), hopeless_in(measured + held, s.partial))
        e = self.entry(s, s.rep, f.dtype, features, measured, held)
        spent = {n: round(t - before.get(n, 0.0), 2) for n, t in self.cost.items() if t > before.get(n, 0.0)}
        self.log.append(SeriesLog(
            s.label, list(features), len(measured) + len(held), round(time.monotonic() - start, 2),
            sorted(dropped), spent, {str(m): t for m, t in sorted(timed.items())},
            {n: why for p in measured for n, why in p["rejected"].items()},
        ))  # fmt: skip
        return e

    def members(
        self, s: Series, features: tuple[int, ...], rep: EntryRecord, complete: Callable[[EntryId], bool]
    ) -> list[EntryRecord]:
        """The entries of the activations and dtypes sharing the representative's timings (``rep``: its
        entry), but those ``complete`` already: each keeps the timings of the backends that serve it, and
        its winners are checked at its own activation and dtype."""
        f, out = s.family, []
        for act, dtype in s.members:
            if complete(entry_id(f, act, dtype, features)):
                continue
            points: list[Point] = []
            for p in rep["points"]:
                serve = set(self.names(self.case(f, act, dtype, p["m"], features)))
                gpu = {n: v for n, v in p["gpu_us"].items() if n in serve}
                host = {n: v for n, v in p["host_us"].items() if n in serve}
                points.append({"m": p["m"], "err": {}, "rejected": {}, "gpu_us": gpu, "host_us": host})
            e = self.entry(s, act, dtype, features, points, [], compiled=False)
            out += [e] if e is not None else []
        return out

    def entry(
        self, s: Series, act: Optional[str], dtype: torch.dtype, features: tuple[int, ...],
        points: list[Point], held: list[Point], compiled: bool = True,
    ) -> Optional[EntryRecord]:  # fmt: skip
        """The entry of ``points`` once gated (``compiled``: the backends were timed at this variant and
        dtype, so a check compiles nothing new); None where no segment is left. Its key's fields are the
        op's (``schema.key_fields``); ``measured_as`` names the variant timed, for an op with one."""
        f = s.family
        case_at = lambda m: self.case(f, act, dtype, m, features)  # noqa: E731
        cap = self.plan.check_cap(f.op, features)
        segments = self.gates.checked(points, case_at, preference(f.mode), cap, compiled)
        if not segments:
            return None
        e = cast(EntryRecord, key_fields(f.op, dtype_name(dtype), act, f.mode, f.dropout))
        e["features"] = list(features)
        if s.rep is not None:
            e["measured_as"] = s.rep
        if dtype != f.dtype:
            e["measured_dtype"] = dtype_name(f.dtype)
        e.update(parity_checked=True, max_m=max(p["m"] for p in points), segments=segments)
        return {**e, "points": points, "held_out": held}
