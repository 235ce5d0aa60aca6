"""One calibration's schedule: what the command line asked for (``Settings``), the tasks of each family and
the order they run in. The next task goes to the family that has spent least per planned series, so a
loaded machine still covers every family; ``series.Measurer`` measures each task's series.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from tqdm import tqdm

from dispatch import ops
from dispatch.calibrate import report
from dispatch.calibrate.gate import unchecked
from dispatch.calibrate.plan import Family, Plan, Series, series_of
from dispatch.calibrate.series import Measurer, dtype_name, entry_id
from dispatch.heuristics.schema import DeviceInfo, Document, EntryId, EntryRecord, variant_of

SAVE_EVERY_S = 30.0
END_S = 5.0  # kept from the budget (at most a tenth) for the self-check, the bandwidth probe, writing


@dataclass(frozen=True)
class Settings:
    """What a calibration is asked for: the command line, typed."""

    ops: tuple[str, ...]
    modes: tuple[str, ...]
    activations: Optional[tuple[str, ...]] = None  # variants (activations); None: each op's own
    backends: Optional[frozenset[str]] = None  # time only these, and the baseline (None: every one)
    quick: bool = False
    budget: Optional[float] = None  # seconds; None: the plan's default
    dtypes: Optional[tuple[torch.dtype, ...]] = None  # None: the plan's
    features: Optional[tuple[tuple[int, ...], ...]] = None  # None: each op's grid
    tokens: Optional[tuple[int, ...]] = None  # the coarse grid of M; None: the plan's
    resume: bool = False  # keep what the table at --out measured, measure the rest
    refresh: bool = False  # measure the selected families again, keep the rest
    workers: Optional[int] = None  # processes compiling ahead (None: warm.workers' default)

    def activations_of(self, op: str) -> tuple[Optional[str], ...]:
        """The values of the op's variant trait to measure: those asked for that it takes (an op
        without a variant has one, None, which only a run asking for none takes)."""
        own = ops.get(op).variants()
        return own if self.activations is None else tuple(a for a in self.activations if a in own)

    def selects(self, e: EntryRecord, dtypes: set[str]) -> bool:
        """Whether an existing table's entry is of this run's selection (``dtypes``: measured or shared)."""
        return e["op"] in self.ops and e["dtype"] in dtypes and e["mode"] in self.modes and (
            variant_of(e) in self.activations_of(e["op"]))  # fmt: skip


class Task(NamedTuple):
    kind: str  # "series": measure it and its members; "members": the series is measured, its members not
    series: Series
    features: tuple[int, ...]


class Run:
    """One calibration: the task queues, the clock of the budget and the entries measured so far."""

    def __init__(self, plan: Plan, settings: Settings, previous: Optional[Document], bar: tqdm) -> None:
        self.plan, self.settings, self.bar, self.start = plan, settings, bar, time.monotonic()
        self.measurer = Measurer(plan, settings.backends, lambda: self.left(), bar)
        kept = (previous or {}).get("entries", [])
        self.entries: dict[EntryId, EntryRecord] = {EntryId.of_entry(e): e for e in kept}
        self.dtypes = {dtype_name(d) for d in plan.dtypes} | {
            dtype_name(s) for d in plan.dtypes for s in plan.shared.get(d, ())}  # fmt: skip
        # an existing table's entries of this run's selection are measured again, unless resumed
        self.again = settings.refresh or not settings.resume
        self.queue: dict[Family, list[Task]] = {}  # in priority order
        self.planned: dict[Family, int] = {}
        self.series_keys: set[EntryId] = set()  # every planned series' own entry, measured or not
        self.spent: dict[Family, float] = defaultdict(float)
        self.deadline = plan.budget_s - min(END_S, plan.budget_s / 10)

    def plan_tasks(self, families: list[Family]) -> list[tuple[Series, tuple[int, ...]]]:
        """Each family's tasks, those already measured left out; returns the (series, features) to warm."""
        work = []
        for fam in families:
            self.queue[fam], every = [], series_of(self.plan, fam, self.settings.activations_of(fam.op))
            for features in self.plan.sizes(fam.op, fam.dtype):
                for s in every:  # a series' task checks its members too (a stopped run has whole classes)
                    self.series_keys.add(entry_id(fam, s.rep, fam.dtype, features))
                    if not self._done(s, features, [(s.rep, fam.dtype)]):
                        self.queue[fam].append(Task("series", s, features))
                        work.append((s, features))
                    elif not self._done(s, features, s.members):
                        self.queue[fam].append(Task("members", s, features))
            self.planned[fam] = len(every) * len(self.plan.sizes(fam.op, fam.dtype))
        return work

    def _done(self, s: Series, features: tuple[int, ...], members: list) -> bool:
        return all(self._complete(entry_id(s.family, a, d, features)) for a, d in members)

    def _complete(self, key: EntryId) -> bool:
        """Measured, not to be measured again (--refresh, or a run over an existing table), and no check
        left out for want of time."""
        e = self.entries.get(key)
        again = self.again and self.settings.selects(e, self.dtypes) if e is not None else False
        return e is not None and not again and not unchecked(e)

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.start)

    def run(self, save: Callable[[], None]) -> None:
        """Task by task, each for the open family that has spent least per planned series."""
        saved = time.monotonic()
        while self.left() > 0 and any(self.queue.values()):
            fam = min((f for f in self.queue if self.queue[f]), key=lambda f: self.spent[f] / self.planned[f])
            task = self.queue[fam].pop(0)
            s, features, start = task.series, task.features, time.monotonic()
            if task.kind == "series":
                self._store([self.measurer.series(s, features)])
            # past the deadline too: the class has its entries, without checks that would compile
            # (--resume makes them)
            rep = self.entries.get(entry_id(fam, s.rep, fam.dtype, features))
            if rep is not None:
                self._store(self.measurer.members(s, features, rep, self._complete))
            self.spent[fam] += time.monotonic() - start
            self.bar.update(task.kind == "series")
            if time.monotonic() - saved > SAVE_EVERY_S:
                save()
                saved = time.monotonic()

    def _store(self, entries: list[Optional[EntryRecord]]) -> None:
        for e in entries:
            if e is not None:
                self.entries[EntryId.of_entry(e)] = e

    def document(self, info: DeviceInfo, in_progress: bool, extra: dict) -> Document:
        """The table as it stands (``extra``: the run's history and warm-up, for its settings)."""
        entries = list(self.entries.values())
        left = {f: sum(t.kind == "series" for t in q) for f, q in self.queue.items()}
        m = self.measurer
        progress = {
            "budget_s": self.plan.budget_s, "in_progress": in_progress,
            "stopped_by_budget": any(self.queue.values()) or any(map(unchecked, entries)),
            # of this run's series: a run over an existing table keeps other entries too
            "series_measured": sum(k in self.entries for k in self.series_keys),
            "series_planned": sum(self.planned.values()),
            "families": {f.label: {"spent_s": round(self.spent[f], 1), "series_planned": self.planned[f],
                                   "series_left": left[f]} for f in self.queue},
            "graph_capture_failed": {" ".join(map(str, k)): v for k, v in m.clock.no_graph.items()},
            **extra, "seconds_by_backend": {n: round(t, 1) for n, t in sorted(m.cost.items())},
            "series_seconds": [log.to_json() for log in m.log],
        }  # fmt: skip
        return report.document(entries, info, self.plan, progress)
