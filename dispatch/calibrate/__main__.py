"""python -m dispatch.calibrate: measure every backend here and write this device's heuristics table.

A series (one activation class of a family: op, dtype, mode, dropout; one real-model feature size)
times every backend serving its calls, and plain PyTorch, on both clocks over a coarse grid of token
counts M, bisecting where the winner changes. The next task goes to the family that has spent least per
planned series, so a loaded machine still covers every family. A backend enters a segment only after
matching the float64 reference there; a class's other activations and dtypes take the representative's
timings, each checked on its own. The table is written atomically, also every 30 s (``--resume``).
A run over an existing table of this device keeps the entries it does not measure again; a file it
could not extend (another device's table, another schema, not a table) is never overwritten.

    python -m dispatch.calibrate --quick                      # H200 ~2 min, 2 CPU cores < 3 min
    python -m dispatch.calibrate --out benchmarks/results/calibrate_points-nvidia-h200.json \\
        --slim-out heuristics/tables/nvidia-h200.json          # full: 124 series in 501 s on an H200
    python -m dispatch.calibrate --refit RAW [--agree OTHER]   # the current rule on measured points
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from dispatch import cases, heuristics, select, timing
from dispatch.calibrate import measure, report, warm
from dispatch.calibrate.plan import (
    BASELINE, MODES, NOISE, PREFERENCE, PREFERENCE_INFERENCE, Family, Plan, Series, compiling,
    contenders, default_plan, family_order, fit, held_out_ms, hopeless_in, preference, runs, series_of, spread, to_bisect,
)  # fmt: skip
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch import ops
from dispatch.heuristics import EntryId, EntryKey
from dispatch.registry import backends
from dispatch.table import runs_of

SAVE_EVERY_S = 30.0
UNCHECKED = "not parity-checked: the budget was spent"  # such an entry is measured again by --resume
END_S = 5.0  # kept from the budget (at most a tenth) for the self-check, the bandwidth probe, writing


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dispatch.calibrate", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--ops", nargs="+", choices=ops.names(), default=list(ops.names()))
    add("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
        help="measured dtypes (GPU: bfloat16, float16 sharing its timings, float32; CPU: float32, bfloat16)")
    add("--activations", nargs="+", choices=ACTIVATION_NAMES, default=list(ACTIVATION_NAMES))
    add("--modes", nargs="+", choices=MODES, default=list(MODES))
    add("--backends", nargs="+", help=f"time only these ({BASELINE}, the baseline, always)")
    add("--quick", action="store_true", help="a few feature sizes and token counts, one dtype")
    add("--budget", type=float, help="seconds for the whole run (default 550; quick 90 GPU, 150 CPU)")
    add("--features", nargs="+", help="feature sizes: N for bias_act_dropout, N,K for fused_linear")
    add("--tokens", nargs="+", type=int, help="the coarse grid of token counts M")
    add("--out", help="default: <user dir>/<device slug>.json, the first place lookup looks")
    add("--slim-out", help="also write the table without its raw points (as heuristics/tables/ ships it)")
    add("--resume", action="store_true", help="keep what --out has measured, measure the rest")
    add("--refresh", action="store_true", help="measure the selected families again, keep the rest of --out")
    add("--tables", action="store_true", help="print the choice tables at the end (python -m dispatch.table)")
    add("--workers", type=int, help="processes compiling ahead (GPU default: CPU cores - 1, at most 15)")
    add("--refit", metavar="RAW", help="measure nothing: fit RAW's points again by the current rule")
    add("--agree", metavar="OTHER", help="with --refit: the share of choice cells RAW and OTHER agree on")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace, device: torch.device) -> Plan:
    plan = default_plan(device, args.quick, args.budget, args.ops)
    if args.dtypes:
        plan.dtypes = tuple(getattr(torch, d) for d in args.dtypes)
        plan.shared = {d: tuple(s for s in ss if s not in plan.dtypes) for d, ss in plan.shared.items()}
    if args.features:
        sizes = [tuple(int(v) for v in f.split(",")) for f in args.features]
        plan.features = {op: [f for f in sizes if len(f) == ops.get(op).feature_dims] for op in args.ops}
        plan.float32_sizes = 0
    if args.tokens:
        plan.tokens = tuple(sorted(set(args.tokens)))
    return plan


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Run:
    """One calibration: the plan, the clocks, the task queues and the entries measured so far."""

    def __init__(self, plan: Plan, args: argparse.Namespace, previous: Optional[dict], bar: tqdm) -> None:
        self.plan, self.bar, self.start = plan, bar, time.monotonic()
        self.only = set(args.backends) if args.backends else None
        self.clock = measure.Clock(plan.device, plan.rounds, plan.quick)
        kept = (previous or {}).get("entries", [])
        self.entries: dict[EntryId, dict] = {EntryId.of_entry(e): e for e in kept}
        dtypes = {_dt(d) for d in plan.dtypes} | {_dt(s) for d in plan.dtypes for s in plan.shared.get(d, ())}
        # an existing table's entries of this run's selection are measured again, unless resumed
        again = bool(args.refresh or not args.resume)
        self.refresh = lambda e: again and e["op"] in args.ops and e["dtype"] in dtypes and (
            e["mode"] in args.modes and e["activation"] in args.activations)  # fmt: skip
        self.queue: dict[Family, list[tuple]] = {}  # (kind, series, features) in priority order
        self.planned: dict[Family, int] = {}
        self.series_keys: set[EntryId] = set()  # every planned series' own entry, measured or not
        self.spent: dict[Family, float] = defaultdict(float)
        self.deadline = plan.budget_s - min(END_S, plan.budget_s / 10)
        self.log: list[dict] = []  # per series: points, seconds, seconds per backend, backends left out
        self.cost: dict[str, float] = defaultdict(float)  # timing and check seconds per backend
        self.dropped: dict[tuple, set[str]] = {}  # (family, rep) -> backends its first size found hopeless
        self.gates: dict[tuple, list] = {}
        self._inputs: Optional[tuple] = None  # the last check's (case, inputs, refs, eager)

    def plan_tasks(self, families: list[Family], activations: tuple[str, ...]) -> list[tuple]:
        """Each family's tasks, those already measured left out; returns the (series, features) to warm."""
        work = []
        for fam in families:
            self.queue[fam], every = [], series_of(self.plan, fam, activations)
            for features in self.plan.sizes(fam.op, fam.dtype):
                for s in every:  # a series' task checks its members too (a stopped run has whole classes)
                    self.series_keys.add(self._entry_key(fam, s.rep, fam.dtype, features))
                    if not self._done(s, features, [(s.rep, fam.dtype)]):
                        self.queue[fam].append(("series", s, features))
                        work.append((s, features))
                    elif not self._done(s, features, s.members):
                        self.queue[fam].append(("members", s, features))
            self.planned[fam] = len(every) * len(self.plan.sizes(fam.op, fam.dtype))
        return work

    def _done(self, s: Series, features: tuple, members: list) -> bool:
        return all(self._complete(self._entry_key(s.family, a, d, features)) for a, d in members)

    def _complete(self, key: EntryId) -> bool:
        """Measured, not to be measured again (--refresh, or a run over an existing table), and no check
        left out for want of time."""
        e = self.entries.get(key)
        return e is not None and not self.refresh(e) and not _unchecked(e)

    def _entry_key(self, f: Family, act: str, dtype: torch.dtype, features: tuple) -> EntryId:
        return EntryId(EntryKey.make(f.op, _dt(dtype), act, f.mode, f.dropout), tuple(features))

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.start)

    def run(self, save: Callable[[], None]) -> None:
        """Task by task, each for the open family that has spent least per planned series."""
        saved = time.monotonic()
        while self.left() > 0 and any(self.queue.values()):
            fam = min((f for f in self.queue if self.queue[f]), key=lambda f: self.spent[f] / self.planned[f])
            kind, s, features = self.queue[fam].pop(0)
            start = time.monotonic()
            if kind == "series":
                self.series(s, features)
            # past the deadline too: the class has its entries, without checks that would compile
            # (--resume makes them)
            self.members(s, features)
            self.spent[fam] += time.monotonic() - start
            self.bar.update(kind == "series")
            if time.monotonic() - saved > SAVE_EVERY_S:
                save()
                saved = time.monotonic()

    def case(self, f: Family, act: str, dtype: torch.dtype, m: int, features: tuple) -> cases.Case:
        training = f.mode == "training"
        return cases.Case(f.op, dtype, act, training, f.dropout, m, tuple(features), self.plan.device)

    def names(self, case: cases.Case) -> list[str]:
        """Every backend that would serve this call on its own (never an interpreter), and the baseline."""
        call = case.call()
        ok = [n for n, b in backends().items() if not b.not_supported_reasons(call, explicit=False)]
        return [n for n in ok if self.only is None or n in self.only] + [BASELINE]

    def point(self, case: cases.Case, names: list[str], timed: dict[int, float]) -> dict:
        start = time.monotonic()
        dims = "x".join(map(str, (case.m, *case.features)))
        self.bar.set_description_str(f"{case.op} {_dt(case.dtype)} {case.activation} {dims}", False)
        # a first call (a compile) starts only while time is left; eager and the baseline compile nothing
        may_start = lambda n: n in ("eager", BASELINE) or self.left() > 0  # noqa: E731
        pt, spent = measure.point(case, names, self.clock, may_start)
        for n, t in spent.items():
            self.cost[n] += t
        timed[case.m] = round(time.monotonic() - start, 2)
        return pt

    def series(self, s: Series, features: tuple) -> None:
        """Largest M first, then the grid evenly, bisection where the winner changes, one held-out M for
        the self-check; then the parity checks and the entry."""
        f, start, before, timed = s.family, time.monotonic(), dict(self.cost), {}
        dropped = self.dropped.get((f, s.rep), set())
        grid = self.plan.grid(f.op, features, f.dtype)
        points: dict[int, dict] = {}
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
        self.add(s, s.rep, f.dtype, features, measured, held)
        spent = {n: round(t - before.get(n, 0.0), 2) for n, t in self.cost.items() if t > before.get(n, 0.0)}
        self.log.append({
            "series": s.label, "features": list(features), "points": len(measured) + len(held),
            "seconds": round(time.monotonic() - start, 2), "dropped_by_family": sorted(dropped),
            "timing_s": spent, "point_s": {str(m): t for m, t in sorted(timed.items())},
            "left_out": {n: why for p in measured for n, why in p["rejected"].items()},
        })  # fmt: skip

    def members(self, s: Series, features: tuple) -> None:
        """The activations and dtypes sharing the representative's timings: each keeps the timings of the
        backends that serve it, and its winners are checked at its own activation and dtype."""
        f = s.family
        rep = self.entries.get(self._entry_key(f, s.rep, f.dtype, features))
        for act, dtype in s.members if rep is not None else []:
            if self._complete(self._entry_key(f, act, dtype, features)):
                continue
            points = []
            for p in rep["points"]:
                serve = set(self.names(self.case(f, act, dtype, p["m"], features)))
                kept = {k: {n: v for n, v in p[k].items() if n in serve} for k in ("gpu_us", "host_us")}
                points.append({"m": p["m"], "err": {}, "rejected": {}, **kept})
            self.add(s, act, dtype, features, points, [], compiled=False)

    def gate(self, case: cases.Case, name: str, compiled: bool) -> list:
        """[passed, error, why] of ``name`` at ``case``, cached. A check by a backend that compiles per kind
        of call, at an activation or dtype it was not timed at (7-10 s for inductor on 2 CPU cores), runs
        only while time is left; otherwise the backend is left out there (UNCHECKED)."""
        key = (case, name)
        if key not in self.gates:
            if not compiled and name in compiling() and self.left() <= 0:
                return [False, None, UNCHECKED]
            start = time.monotonic()
            try:
                if self._inputs is None or self._inputs[0] != case:
                    self._inputs = None
                    self._inputs = (case, *cases.inputs(case))
                self.gates[key] = cases.gate(name, case, *self._inputs[1:])
            except Exception as exc:  # the reference or eager failed here (out of memory): nothing passes
                self.gates[key] = [False, None, timing.describe(exc)]
            self.cost[name] += time.monotonic() - start
        return self.gates[key]

    def checked(
        self, s: Series, act: str, dtype: torch.dtype, features: tuple, points: list, compiled: bool
    ) -> list:
        """Segments whose every winner, by cost and by GPU time alone (the captured pick; unchecked, refit
        dropped triton at 21 of 751 H200 points, up to 1.25x faster than eager), matched the reference at
        its run's smallest M and its largest M within the check cap (a member too: Triton's bias_act_dropout
        runs another kernel, compiled per activation, up to 64 rows); a failing winner leaves those points
        and the fit is redone."""
        f, order = s.family, preference(s.family.mode)
        cap = self.plan.check_cap(f.op, features)
        while True:
            todo = []
            for name, pts in runs(points, order=order) + runs(points, order=order, by_gpu=True):
                under = [p for p in pts if p["m"] <= cap]
                ends = (pts[0], under[-1] if under else pts[0])
                todo += [(name, p) for p in {id(p): p for p in ends}.values() if name not in p["err"]]
            if not todo:
                return fit(points, order)
            for name, p in todo:
                ok, err, why = self.gate(self.case(f, act, dtype, p["m"], features), name, compiled)
                if ok:
                    p["err"][name] = err
                else:
                    p["gpu_us"].pop(name, None)
                    p["host_us"].pop(name, None)
                    p["rejected"][name] = why

    def add(self, s: Series, act: str, dtype: torch.dtype, features: tuple, points: list, held: list,
            compiled: bool = True) -> None:  # fmt: skip
        segments = self.checked(s, act, dtype, features, points, compiled)
        if segments:
            f = s.family
            e = {"op": f.op, "dtype": _dt(dtype), "activation": act, "mode": f.mode, "dropout": f.dropout,
                 "features": list(features), "measured_as": s.rep}  # fmt: skip
            if dtype != f.dtype:
                e["measured_dtype"] = _dt(f.dtype)
            e.update(parity_checked=True, max_m=max(p["m"] for p in points), segments=segments)
            self.entries[EntryId.of_entry(e)] = {**e, "points": points, "held_out": held}

    def document(self, info: dict, in_progress: bool, extra: dict) -> dict:
        fields = ("op", "dtype", "mode", "dropout", "activation", "features")
        entries = sorted(self.entries.values(), key=lambda e: tuple(e[k] for k in fields))
        left = {f: sum(t[0] == "series" for t in q) for f, q in self.queue.items()}
        gpu = self.plan.device.type == "cuda"
        settings = {
            "quick": self.plan.quick, "noise": NOISE, "preference": list(PREFERENCE),
            "preference_inference": list(PREFERENCE_INFERENCE), "p_dropout": cases.P_DROPOUT,
            "rule": "cost = max(gpu_us, host_us); ties within noise go to preference "
                    "(preference_inference without autograd)",
            "baseline": "pytorch: F.dropout(act(x + b), p) / act(F.linear(x, w, b))",
            "timer": "gpu_us: triton.testing.do_bench_cudagraph (events at >= 5 ms); host_us: perf_counter "
                     "behind torch.cuda._sleep" if gpu else "gpu_us = host_us = perf_counter (no GPU clock)",
            "budget_s": self.plan.budget_s, "in_progress": in_progress,
            "stopped_by_budget": any(self.queue.values()) or any(map(_unchecked, entries)),
            # of this run's series: a run over an existing table keeps other entries too
            "series_measured": sum(k in self.entries for k in self.series_keys),
            "series_planned": sum(self.planned.values()),
            "families": {f.label: {"spent_s": round(self.spent[f], 1), "series_planned": self.planned[f],
                                   "series_left": left[f]} for f in self.queue},
            "graph_capture_failed": {" ".join(map(str, k)): v for k, v in self.clock.no_graph.items()},
            **extra, "seconds_by_backend": {n: round(t, 1) for n, t in sorted(self.cost.items())},
            "series_seconds": self.log,
        }  # fmt: skip
        served = {n for e in entries for p in e["points"] for n in p["gpu_us"]}
        return {
            "schema_version": heuristics.SCHEMA_VERSION, "device": info,
            "versions": {**heuristics.running_versions(), "python": platform.python_version()},
            "date": datetime.date.today().isoformat(), "settings": settings,
            "backends": {n: b.display_name() for n, b in sorted(backends().items()) if n in served},
            "entries": entries,
        }  # fmt: skip


def _unchecked(e: dict) -> bool:
    return any(why == UNCHECKED for p in e["points"] for why in p.get("rejected", {}).values())


def _flag(args: argparse.Namespace) -> str:
    return "--refresh" if args.refresh else "--resume" if args.resume else "--out"


def _previous(path: str, info: dict, flag: str = "--resume/--refresh") -> Optional[dict]:
    """The table already at ``path``, whose entries this run keeps where it does not measure them again;
    None where there is none or it is of other versions (replaced, said on stderr). A file this run
    could not extend (not a table, no raw points, another device's, schema 1) is never overwritten:
    the run stops, naming --out."""
    if not os.path.exists(path):
        if flag != "--out":
            print(f"{flag}: no table at {path}; starting afresh", file=sys.stderr)
        return None
    table, why = heuristics.read_table(path)
    refuse = f"not overwriting it: give another --out, or move {path} away"
    if table is None:
        sys.exit(f"{flag}: {path} is not a heuristics table ({why}); {refuse}")
    if any("points" not in e for e in table.data["entries"]):
        raw = (table.data.get("raw_points") or {}).get("file", "the table --out wrote")
        sys.exit(f"{flag}: {path} keeps no raw measured points; run on {raw} instead")
    if table.slug != info["slug"]:
        theirs, mine = f"{table.device['name']} ({table.slug})", f"{info['name']} ({info['slug']})"
        sys.exit(f"{flag}: {path} is the table of {theirs}, not of {mine}; {refuse}")
    if table.version != heuristics.SCHEMA_VERSION:
        sys.exit(f"{flag}: {path} is a schema {table.version} table (no host clock), not schema "
                 f"{heuristics.SCHEMA_VERSION}; {refuse}")  # fmt: skip
    if table.version_mismatch():
        print(f"{flag}: {path} was calibrated with {', '.join(table.version_mismatch())}: replacing its "
              f"{len(table.data['entries'])} entries", file=sys.stderr)  # fmt: skip
        return None
    return table.data


def _kept(previous: dict, entries: dict) -> str:
    """How many of the existing table's entries the run kept as they were (not measured again)."""
    before = previous["entries"]
    kept = sum(entries.get(EntryId.of_entry(e)) is e for e in before)
    again = f"; the other {len(before) - kept} measured again" if kept < len(before) else ""
    return f"kept {kept} of the {len(before)} entries of the table already there{again}"


def _runs(
    previous: Optional[dict], args: argparse.Namespace, plan: Plan, seconds: float, families: list
) -> list:
    """The table's history: a refresh is one more run, a resumed run one more part of the last one, a
    run over an existing table one more run of its families."""
    done = [] if previous is None else runs_of(previous.get("settings", {}), previous.get("date"))
    this = {"date": datetime.date.today().isoformat(), "elapsed_s": round(seconds, 1)}
    kind = "quick" if plan.quick else "full"
    if args.refresh:
        return done + [{"run": "refresh", **this, "families": families}]
    if done and args.resume:
        last = done[-1]
        seconds += last["elapsed_s"]
        return done[:-1] + [{**last, "elapsed_s": round(seconds, 1), "parts": last.get("parts", 1) + 1}]
    if done:
        return done + [{"run": kind, **this, "parts": 1, "families": families}]
    return [{"run": kind, **this, "parts": 1}]


def _summary(doc: dict, out: str, seconds: float, kept: str) -> list[str]:
    """What the run did, in a few lines: the self-check, where the time went, what was written."""
    st = doc["settings"]
    stopped = st["stopped_by_budget"]
    state = "stopped by the budget after" if stopped else "finished in"
    extend = " (run again with --resume to extend it)" if stopped else ""
    lines = [
        report.format_self_check(doc["self_check"], doc["device"].get("type") == "cuda"),
        report.format_costs(st),
        f"{state} {seconds:.0f} s: {st['series_measured']} of {st['series_planned']} series measured, "
        f"{len(doc['entries'])} entries; wrote {out}{extend}",
        kept,
    ]
    default = os.path.join(heuristics.user_dir(), doc["device"]["slug"] + ".json")
    where = "" if os.path.abspath(out) == os.path.abspath(default) else f" --gpu {out}"
    lines.append(f"the choice tables: python -m dispatch.table{where}")
    return [line for line in lines if line]


def _bandwidth_gbs(device: torch.device) -> Optional[float]:
    """Measured device-to-device copy bandwidth (read + write) of 1 GiB."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**28, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return round(2 * src.numel() * 4 / timing.gpu_ms(lambda: dst.copy_(src), 20.0) / 1e6, 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.agree and not args.refit:
        sys.exit("--agree compares a refitted calibration with another: give --refit RAW too")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks would each measure and write the same table
        sys.exit("python -m dispatch.calibrate runs in one process: run it without torchrun, on one GPU")
    if args.refit:
        return report.refit_main(args.refit, args.out, args.slim_out, args.agree)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    plan, info = make_plan(args, device), heuristics.device_info(device)
    out = args.out or os.path.join(heuristics.user_dir(), info["slug"] + ".json")
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.exists(folder) and not os.path.isdir(folder):  # found before measuring, not at the first save
        named = "--out" if args.out else heuristics.ENV_DIR
        sys.exit(f"cannot write {out}: {folder} is a file, not a directory (named by {named})")
    previous = _previous(out, info, _flag(args))
    families = [Family(op, dt, mode, drop) for dt in plan.dtypes for mode, op, drop in family_order(args.ops)
                if mode in args.modes and plan.features.get(op)]  # fmt: skip
    labels = sorted({f"{f.op} {_dt(f.dtype)} {f.mode}" for f in families})
    backends()  # every backend imported before the clock starts
    threads = f" at {info['threads']} threads" if info["type"] == "cpu" else ""
    where = f"{info['name']}{threads} ({info['slug']}) -> {out}"
    print(f"calibrating {where}; budget {plan.budget_s:.0f} s", file=sys.stderr)
    with tqdm(unit="series", file=sys.stderr, dynamic_ncols=True, mininterval=1.0) as bar:
        run = Run(plan, args, previous, bar)
        work = run.plan_tasks(families, tuple(args.activations))
        bar.reset(total=sum(t[0] == "series" for q in run.queue.values() for t in q))
        workers, warmed = warm.workers(args.workers, device), None
        if workers and work:
            bar.set_description_str(f"compiling ahead in {workers} processes", False)
            warmed = warm.warm(warm.jobs(work, plan, run.only), workers, plan.budget_s / 4, device)

        def history() -> dict:
            runs_ = _runs(previous, args, plan, time.monotonic() - run.start, labels)
            return {"warm_up": warmed, "runs": runs_, "elapsed_s": runs_[-1]["elapsed_s"]}

        run.run(lambda: heuristics.save_table(run.document(info, True, history()), out))
    if device.type == "cuda":  # the family's host costs decide (plan.pool_host)
        report.refit_entries(list(run.entries.values()), gpu=True)
    measured = {"measured_bandwidth_gbs": _bandwidth_gbs(device)} if device.type == "cuda" else {}
    doc = run.document({**info, **measured}, False, history())
    doc["self_check"] = report.self_check(doc)
    heuristics.save_table(doc, out)
    if args.slim_out:
        heuristics.save_table(heuristics.slim(doc, out), args.slim_out)
    heuristics.reload()
    select.clear_cache()
    if args.tables:
        from dispatch import table as table_cli

        print(table_cli.render(heuristics.Table(doc, out)))
    kept = _kept(previous, run.entries) if previous is not None else ""
    print("\n".join(_summary(doc, out, time.monotonic() - run.start, kept)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
