"""The parity gate before a win: a series' winners, by cost and by GPU time alone, each checked against
the float64 reference (``dispatch.cases.gate``) at its run's ends, plain PyTorch like every backend; a
failing winner leaves those points and the fit is redone.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from dispatch import cases, timing
from dispatch.calibrate.plan import BASELINE, compiling, fit, runs
from dispatch.cases import Case, Gate
from dispatch.heuristics.schema import EntryRecord, Point, SegmentRecord

UNCHECKED = "not parity-checked: the budget was spent"  # such an entry is measured again by --resume


def unchecked(entry: EntryRecord) -> bool:
    """Whether an entry left a check out for want of time (``--resume`` measures it again)."""
    return any(why == UNCHECKED for p in entry["points"] for why in p.get("rejected", {}).values())


class Gates:
    """Parity checks, each made once per (case, backend); the last case's inputs, float64 reference and
    eager outputs are kept for the next check there. ``left()``: seconds of the budget left; ``cost``:
    seconds per backend, added to."""

    def __init__(self, left: Callable[[], float], cost: dict[str, float]) -> None:
        self.left, self.cost = left, cost
        self.done: dict[tuple[Case, str], Gate] = {}
        self._inputs: Optional[tuple] = None  # (case, inputs, refs, eager)

    def gate(self, case: Case, name: str, compiled: bool) -> Gate:
        """``name``'s gate at ``case``. A check by a backend that compiles per kind of call, at an
        activation or dtype it was not timed at (7-10 s for inductor on 2 CPU cores), runs only while
        time is left; otherwise the backend is left out there (UNCHECKED)."""
        key = (case, name)
        if key not in self.done:
            if not compiled and name in compiling() and self.left() <= 0:
                return Gate(False, None, UNCHECKED)
            start = time.monotonic()
            try:
                if self._inputs is None or self._inputs[0] != case:
                    self._inputs = None
                    self._inputs = (case, *cases.inputs(case))
                self.done[key] = cases.gate(name, case, *self._inputs[1:])
            except Exception as exc:  # the reference or eager failed here (out of memory): nothing passes
                self.done[key] = Gate(False, None, timing.describe(exc))
            self.cost[name] += time.monotonic() - start
        return self.done[key]

    def checked(
        self, points: list[Point], case_at: Callable[[int], Case], order: tuple[str, ...], cap: int,
        compiled: bool,
    ) -> list[SegmentRecord]:  # fmt: skip
        """Segments whose every winner, by cost and by GPU time alone (the captured pick; unchecked, refit
        dropped triton at 21 of 751 points, up to 1.25x faster than eager), matched the reference at
        its run's smallest M and its largest M within the check cap ``cap`` (a member too: Triton's
        bias_act_dropout runs another kernel, compiled per activation, up to 64 rows). ``case_at(m)``:
        the case checked at M = m. A failing winner leaves those points (plain PyTorch keeps its timings
        there, rejected, for the speedups) and the fit is redone."""
        while True:
            todo = []
            for name, pts in runs(points, order=order) + runs(points, order=order, by_gpu=True):
                under = [p for p in pts if p["m"] <= cap]
                ends = (pts[0], under[-1] if under else pts[0])
                todo += [(name, p) for p in {id(p): p for p in ends}.values() if name not in p["err"]]
            if not todo:
                return fit(points, order)
            for name, p in todo:
                passed, err, why = self.gate(case_at(p["m"]), name, compiled)
                if passed:
                    p["err"][name] = err  # type: ignore[assignment]
                    continue
                if name != BASELINE:
                    p["gpu_us"].pop(name, None)
                    p["host_us"].pop(name, None)
                p["rejected"][name] = why
