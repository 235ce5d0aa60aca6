"""python -m dispatch.calibrate: measure every backend here and write this device's heuristics table.

Each series (one activation class of one family (op, dtype, mode, dropout on/off) at one real-model
feature size) times every backend that can serve the call and plain PyTorch on the GPU and the host
clock (``measure``) at a coarse grid of token counts M, then bisects where the winner changes. The
budget is shared out per family in proportion to its planned series, and the next task always goes to
the family furthest behind its share: a loaded machine still covers every family, and what a finished
family leaves goes to the others. A backend enters a segment only after matching the float64
reference there (``Run.checked``); the activations and dtypes of a class then take the
representative's timings, each checked on its own. The table is written atomically, also every 30 s
while measuring, so ``--resume`` continues a stopped or killed run; the choice tables and the
self-check print last.

    python -m dispatch.calibrate --quick                      # H200 ~2 min, 2 CPU cores < 3 min
    python -m dispatch.calibrate --out benchmarks/results/calibrate_points-nvidia-h200.json \\
        --slim-out heuristics/tables/nvidia-h200.json          # full: --budget (default 560 s)
    python -m dispatch.calibrate --refresh --modes training --out ...   # those families again
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
from dispatch.calibrate import measure, ranks as ranking, refit, report
from dispatch.calibrate.plan import (
    BASELINE, FAMILY_ORDER, MODES, NOISE, PREFERENCE, PREFERENCE_INFERENCE, Family, Plan, Series, contenders,
    default_plan, fit, gpu_runs, held_out_ms, hopeless_in, preference, runs, series_of, smooth_host, spread,
    to_bisect,
)  # fmt: skip
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.registry import OPS, backends
from dispatch.table import runs_of

SAVE_EVERY_S = 30.0
END_S = 5.0  # kept from the budget (at most a tenth of it) for the self-check, the bandwidth probe, writing


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dispatch.calibrate", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--ops", nargs="+", choices=OPS, default=list(OPS))
    add("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
        help="measured dtypes (GPU: bfloat16, float16 sharing its timings, float32; CPU: float32, and bfloat16 "
        "without --quick)")  # fmt: skip
    add("--activations", nargs="+", choices=ACTIVATION_NAMES, default=list(ACTIVATION_NAMES))
    add("--modes", nargs="+", choices=MODES, default=list(MODES))
    add("--backends", nargs="+", help=f"time only these ({BASELINE}, the baseline, always)")
    add("--quick", action="store_true", help="a few feature sizes and token counts, one dtype")
    add("--budget", type=float, help="seconds for the whole run (default 560; quick 90 GPU, 150 CPU)")
    add("--features", nargs="+", help="feature sizes: N for bias_act_dropout, N,K for fused_linear")
    add("--tokens", nargs="+", type=int, help="the coarse grid of token counts M")
    add("--out", help="default: <user dir>/<device slug>.json, the first place lookup looks")
    add("--slim-out", help="also write the table without its raw points (as heuristics/tables/ ships it)")
    add("--resume", action="store_true", help="keep what --out has measured, measure the rest")
    add("--refresh", action="store_true",
        help="measure the selected --ops/--dtypes/--modes/--activations again, keep the rest of --out")  # fmt: skip
    add("--workers", type=int, help="processes compiling ahead (GPU default: CPU cores - 2, at most 12)")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace, device: torch.device) -> Plan:
    plan = default_plan(device, args.quick, args.budget)
    if args.dtypes:
        plan.dtypes = tuple(getattr(torch, d) for d in args.dtypes)
        plan.shared = {d: tuple(s for s in ss if s not in plan.dtypes) for d, ss in plan.shared.items()}
    if args.features:
        sizes = [tuple(int(v) for v in f.split(",")) for f in args.features]
        plan.features = {"bias_act_dropout": [f for f in sizes if len(f) == 1],
                         "fused_linear": [f for f in sizes if len(f) == 2]}  # fmt: skip
        plan.float32_sizes = 0
    if args.tokens:
        plan.tokens = tuple(sorted(set(args.tokens)))
    return plan


def _key(e: dict) -> tuple:
    return (e["op"], e["dtype"], e["activation"], e["mode"], e["dropout"], tuple(e["features"]))


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Run:
    """One calibration: the plan, the clocks, the per-family budget and the entries measured so far."""

    def __init__(
        self, plan: Plan, args: argparse.Namespace, previous: Optional[dict], bar: tqdm, info: dict
    ) -> None:
        self.plan, self.bar, self.info = plan, bar, info
        self.only = set(args.backends) if args.backends else None
        self.clock = measure.Clock(plan.device, plan.rounds, plan.quick)
        self.start = time.monotonic()
        self.entries: dict[tuple, dict] = {_key(e): e for e in (previous or {}).get("entries", [])}
        dtypes = {_dt(d) for d in plan.dtypes} | {_dt(s) for d in plan.dtypes for s in plan.shared.get(d, ())}
        self.refresh = lambda e: bool(args.refresh) and e["op"] in args.ops and e["dtype"] in dtypes and (
            e["mode"] in args.modes and e["activation"] in args.activations)  # fmt: skip
        self.queue: dict[Family, list[tuple]] = {}
        self.weight: dict[Family, int] = {}  # series left to measure: the family's share of the budget
        self.planned: dict[Family, int] = {}
        self.spent: dict[Family, float] = defaultdict(float)
        self.measure_s = plan.budget_s - min(END_S, plan.budget_s / 10)
        self.stopped = False
        self.log: list[dict] = []  # per series: points, seconds, seconds per backend, backends left out
        self.cost: dict[str, float] = defaultdict(float)  # timing seconds per backend, first calls included
        self.dropped: dict[tuple, set[str]] = {}  # (family, rep) -> backends its first size found hopeless
        self.gates: dict[tuple, list] = {}
        self._inputs: Optional[tuple] = None  # the last check's (case, inputs, refs, eager)
        self.point_s: dict[int, float] = {}  # the current series' seconds per point
        self.saved = time.monotonic()

    # --------------------------------------------------------------- the plan and the budget

    def plan_tasks(self, families: list[Family], activations: tuple[str, ...]) -> list[tuple]:
        """Each family's tasks in priority order, those already measured left out; returns the work
        (series, features) the warm-up compiles."""
        work = []
        for fam in families:
            tasks: list[tuple] = []
            all_series = series_of(self.plan, fam, activations)
            for features in self.plan.sizes(fam.op, fam.dtype):
                todo = [s for s in all_series if not self._done(s, features, [(s.rep, fam.dtype)])]
                tasks += [("series", s, features) for s in todo]
                tasks += [
                    ("members", s, features) for s in all_series if not self._done(s, features, s.members)
                ]
                work += [(s, features) for s in todo]
            self.weight[fam] = max(1, sum(t[0] == "series" for t in tasks))
            self.planned[fam] = len(all_series) * len(self.plan.sizes(fam.op, fam.dtype))
            self.queue[fam] = tasks
        return work

    def _done(self, s: Series, features: tuple, members: list) -> bool:
        f = s.family
        keys = [(f.op, _dt(d), a, f.mode, f.dropout, tuple(features)) for a, d in members]
        return all(k in self.entries and not self.refresh(self.entries[k]) for k in keys)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allowance(self, fam: Family) -> float:
        """The family's share of the measuring time: what the finished families left, split among the
        open ones by their planned series."""
        open_ = [f for f, q in self.queue.items() if q]
        pool = self.measure_s - sum(self.spent[f] for f, q in self.queue.items() if not q)
        return pool * self.weight[fam] / max(1, sum(self.weight[f] for f in open_))

    def left(self, fam: Family) -> float:
        return min(self.allowance(fam) - self.spent[fam], self.measure_s - self.elapsed())

    def run(self, save: Callable[[], None]) -> None:
        """Task by task, each time for the open family furthest behind its share (spent per planned
        series): a family of fast calls finishes early and leaves its time to the slow ones, and a slow
        one cannot starve the rest."""
        order = list(self.queue)
        while True:
            ready = [f for f in order if self.queue[f] and self.left(f) > 0]
            if not ready:
                break
            fam = min(ready, key=lambda f: self.spent[f] / self.weight[f])
            kind, s, features = self.queue[fam][0]
            start = time.monotonic()
            (self.series if kind == "series" else self.members)(s, features)
            self.spent[fam] += time.monotonic() - start
            self.queue[fam].pop(0)
            self.bar.update(kind == "series")
            if time.monotonic() - self.saved > SAVE_EVERY_S:
                save()
                self.saved = time.monotonic()
        self.stopped = any(self.queue.values())

    # --------------------------------------------------------------- measuring

    def case(self, f: Family, act: str, dtype: torch.dtype, m: int, features: tuple) -> cases.Case:
        return cases.Case(
            f.op, dtype, act, f.mode == "training", f.dropout, m, tuple(features), self.plan.device
        )

    def names(self, case: cases.Case) -> list[str]:
        """Every backend that would serve this call on its own (never an interpreter), and the baseline."""
        call = case.call()
        ok = [n for n, b in backends().items() if not b.not_supported_reasons(call, explicit=False)]
        return [n for n in ok if self.only is None or n in self.only] + [BASELINE]

    def point(self, fam: Family, case: cases.Case, names: list[str]) -> dict:
        start = time.monotonic()
        dims = "x".join(map(str, (case.m, *case.features)))
        self.bar.set_description_str(f"{fam.label} {case.activation} {dims}", False)
        # a first call (a compile) starts only while the family has time left; eager and the
        # baseline cost none
        pt, spent = measure.point(
            case, names, self.clock, lambda n: n in ("eager", BASELINE) or self.left(fam) > 0
        )
        for n, t in spent.items():
            self.cost[n] += t
        self.point_s[case.m] = round(time.monotonic() - start, 2)
        return pt

    def series(self, s: Series, features: tuple) -> None:
        """Largest M first, then the rest of the grid evenly, bisection where the winner changes, one
        held-out M for the self-check; then the parity checks and the entry."""
        f, start = s.family, time.monotonic()
        before, self.point_s = dict(self.cost), {}
        dropped = self.dropped.get((f, s.rep), set())
        grid = self.plan.grid(f.op, features, f.dtype)
        points: dict[int, dict] = {}
        pending = list(dict.fromkeys([grid[-1], *spread(grid)]))
        while pending:
            for m in pending:
                if points and self.left(f) <= 0:
                    break
                case = self.case(f, s.rep, f.dtype, m, features)
                names = [n for n in self.names(case) if n not in dropped]
                points[m] = self.point(f, case, contenders(names, points, s.partial))
            pending = [m for m in to_bisect(points, self.plan.ratio) if m not in points and self.left(f) > 0]
        held = []
        for m in held_out_ms(
            sorted(points), self.plan.m_cap(f.op, features, f.dtype), f"{s.label} {features}"
        ):
            if self.left(f) > 0:
                case = self.case(f, s.rep, f.dtype, m, features)
                held.append(self.point(f, case, [n for n in self.names(case) if n not in dropped]))
        measured = [points[m] for m in sorted(points)]
        if self.plan.device.type == "cuda":
            smooth_host(measured + held)
        self.dropped.setdefault((f, s.rep), hopeless_in(measured + held, s.partial))
        self.add(s, s.rep, f.dtype, features, measured, held)
        self.log.append({
            "series": s.label, "features": list(features), "points": len(measured) + len(held),
            "seconds": round(time.monotonic() - start, 2), "dropped_by_family": sorted(dropped),
            "timing_s": {n: round(t - before.get(n, 0.0), 2) for n, t in self.cost.items() if t > before.get(n, 0.0)},
            "point_s": {str(m): t for m, t in sorted(self.point_s.items())},
            "left_out": {n: why for p in measured for n, why in p["rejected"].items()},
        })  # fmt: skip

    def members(self, s: Series, features: tuple) -> None:
        """The activations and dtypes sharing the representative's timings: each keeps the timings of the
        backends that serve it, and its winners are checked at its own activation and dtype."""
        f = s.family
        rep = self.entries.get((f.op, _dt(f.dtype), s.rep, f.mode, f.dropout, tuple(features)))
        if rep is None:
            return
        for act, dtype in s.members:
            key = (f.op, _dt(dtype), act, f.mode, f.dropout, tuple(features))
            if key in self.entries and not self.refresh(self.entries[key]):
                continue
            points = []
            for p in rep["points"]:
                serve = set(self.names(self.case(f, act, dtype, p["m"], features)))
                points.append({
                    "m": p["m"], "err": {}, "rejected": {},
                    **{k: {n: v for n, v in p[k].items() if n in serve} for k in ("gpu_us", "host_us")},
                })  # fmt: skip
            self.add(s, act, dtype, features, points, [], compiled=False)

    # --------------------------------------------------------------- parity and entries

    def gate(self, case: cases.Case, name: str, fam: Family, compiled: bool) -> list:
        """[passed, error, why] of ``name`` at ``case``, cached. A check that may compile (a backend
        other than eager at an activation or dtype it was not timed at: 7-10 s for inductor on 2 CPU
        cores) runs only while the family has time left; otherwise the backend is left out there."""
        key = (case, name)
        if key in self.gates:
            return self.gates[key]
        if not compiled and name != "eager" and self.left(fam) <= 0:
            return [False, None, "not parity-checked: the family's budget was spent"]
        start = time.monotonic()
        try:
            if self._inputs is None or self._inputs[0] != case:
                self._inputs = None
                self._inputs = (case, *cases.inputs(case))
            result = cases.gate(name, case, *self._inputs[1:])
        except Exception as exc:  # the reference or eager failed here (out of memory): nothing passes
            result = [False, None, timing.describe(exc)]
        self.cost[name] += time.monotonic() - start
        self.gates[key] = result
        return result

    def checked(
        self, s: Series, act: str, dtype: torch.dtype, features: tuple, points: list[dict], compiled: bool
    ) -> list[dict]:
        """Segments whose every winner, by cost and by GPU time alone (the captured pick), matched the
        reference at its run's smallest M and at its largest M within the check cap; a failing winner
        leaves those points and the fit is redone. (Unchecked GPU-time winners were dropped when the
        table was refitted: triton at 21 of 751 H200 points, up to 1.25x faster than eager there.)"""
        f = s.family
        cap = self.plan.check_cap(f.op, features)
        order = preference(f.mode)
        while True:
            todo = []
            for name, pts in runs(points, order=order) + gpu_runs(points, order):
                under = [p for p in pts if p["m"] <= cap]
                for p in {id(p): p for p in (pts[0], under[-1] if under else pts[0])}.values():
                    if name not in p["err"]:
                        todo.append((name, p))
            if not todo:
                return fit(points, order)
            for name, p in todo:
                ok, err, why = self.gate(self.case(f, act, dtype, p["m"], features), name, f, compiled)
                if ok:
                    p["err"][name] = err
                else:
                    p["gpu_us"].pop(name, None)
                    p["host_us"].pop(name, None)
                    p["rejected"][name] = why

    def add(self, s: Series, act: str, dtype: torch.dtype, features: tuple, points: list, held: list,
            compiled: bool = True) -> None:  # fmt: skip
        segments = self.checked(s, act, dtype, features, points, compiled)
        if not segments:
            return
        f = s.family
        e = {"op": f.op, "dtype": _dt(dtype), "activation": act, "mode": f.mode, "dropout": f.dropout,
             "features": list(features), "measured_as": s.rep}  # fmt: skip
        if dtype != f.dtype:
            e["measured_dtype"] = _dt(f.dtype)
        e.update(parity_checked=True, max_m=max(p["m"] for p in points), segments=segments)
        e.update(points=points, held_out=held)
        self.entries[_key(e)] = e

    # --------------------------------------------------------------- the document

    def document(self, in_progress: bool = False, extra: Optional[dict] = None) -> dict:
        entries = sorted(
            self.entries.values(),
            key=lambda e: (e["op"], e["dtype"], e["mode"], e["dropout"], e["activation"], e["features"]),
        )
        families = {
            f.label: {"allotted_s": round(self.allowance(f) if q else self.spent[f], 1),
                      "spent_s": round(self.spent[f], 1), "series_planned": self.planned[f],
                      "series_left": sum(t[0] == "series" for t in q)}
            for f, q in self.queue.items()
        }  # fmt: skip
        gpu = self.plan.device.type == "cuda"
        planned = {(f.op, _dt(f.dtype), f.mode, f.dropout) for f in self.planned}
        settings = {
            "quick": self.plan.quick, "noise": NOISE, "preference": list(PREFERENCE),
            "preference_inference": list(PREFERENCE_INFERENCE), "p_dropout": cases.P_DROPOUT,
            "rule": "cost = max(gpu_us, host_us); ties within noise go to preference (preference_inference without autograd)",
            "baseline": "pytorch: F.dropout(act(x + b), p) / act(F.linear(x, w, b))",
            "timer": ("gpu_us: triton.testing.do_bench_cudagraph (events at >= 5 ms); host_us: perf_counter behind "
                      "torch.cuda._sleep" if gpu else "gpu_us = host_us = time.perf_counter median (no GPU clock)"),
            "budget_s": self.plan.budget_s, "in_progress": in_progress, "stopped_by_budget": self.stopped,
            "series_measured": sum(  # of this run's families: a refresh keeps the others' entries too
                e["activation"] == e["measured_as"] and "measured_dtype" not in e
                and (e["op"], e["dtype"], e["mode"], e["dropout"]) in planned for e in entries
            ),
            "series_planned": sum(self.planned.values()), "families": families,
            "graph_capture_failed": {" ".join(map(str, k)): v for k, v in self.clock.no_graph.items()},
            **(extra or {}),
            "ranks": int(os.environ.get("WORLD_SIZE", "1")),
            "seconds_by_backend": {n: round(t, 1) for n, t in sorted(self.cost.items())},
            "series_seconds": self.log,
        }  # fmt: skip
        return {
            "schema_version": heuristics.SCHEMA_VERSION,
            "device": self.info,
            "versions": {**heuristics.running_versions(), "python": platform.python_version()},
            "date": datetime.date.today().isoformat(),
            "settings": settings,
            "backends": {n: b.display_name() for n, b in sorted(backends().items()) if any(
                n in p["gpu_us"] for e in entries for p in e["points"])},
            "entries": entries,
        }  # fmt: skip


def _previous(path: str, info: dict) -> Optional[dict]:
    """--resume/--refresh: the table at ``path`` if it is this device's, of these versions, and keeps its
    raw points in this schema; else None (starting afresh)."""
    table = heuristics.load_table(path) if os.path.exists(path) else None
    if table is not None and any("points" not in e for e in table.data["entries"]):
        raw = (table.data.get("raw_points") or {}).get("file", "the table --out wrote")
        sys.exit(f"--resume/--refresh: {path} keeps no raw measured points; run on {raw} instead")
    why = (
        "no table" if table is None else "another device's table" if table.slug != info["slug"]
        else "a table of other versions" if table.version_mismatch()
        else "a schema 1 table (its points have no host clock)" if table.data["schema_version"] != heuristics.SCHEMA_VERSION
        else ""
    )  # fmt: skip
    if why:
        print(f"--resume/--refresh: {why} at {path}; starting afresh", file=sys.stderr)
        return None
    return table.data


def _runs(
    previous: Optional[dict], args: argparse.Namespace, plan: Plan, seconds: float, families: list
) -> list:
    """The table's history: a refresh is one more run, a resumed run one more part of the last one."""
    runs_ = [] if previous is None else runs_of(previous.get("settings", {}), previous.get("date"))
    this = {"date": datetime.date.today().isoformat(), "elapsed_s": round(seconds, 1)}
    if args.refresh:
        return runs_ + [{"run": "refresh", **this, "families": families}]
    if runs_:
        last = runs_[-1]
        return runs_[:-1] + [
            {**last, "elapsed_s": round(last["elapsed_s"] + seconds, 1), "parts": last.get("parts", 1) + 1}
        ]
    return [{"run": "quick" if plan.quick else "full", **this, "parts": 1}]


def _bandwidth_gbs(device: torch.device) -> Optional[float]:
    """Measured device-to-device copy bandwidth (read + write) of 1 GiB."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**28, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timing.gpu_ms(lambda: dst.copy_(src), 20.0)
    return round(2 * src.numel() * 4 / ms / 1e6, 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    ranks = ranking.setup()  # before the device: each rank takes its own GPU
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    plan = make_plan(args, device)
    info = heuristics.device_info(device)
    out = args.out or os.path.join(heuristics.user_dir(), info["slug"] + ".json")
    previous = _previous(out, info) if args.resume or args.refresh else None
    stopped_ranks = ranking.checkpointed_entries(out) if args.resume else []
    if stopped_ranks:  # a sharded run that stopped: what its ranks had measured
        previous = dict(previous or {})
        previous["entries"] = list(previous.get("entries", [])) + stopped_ranks
    families = [Family(op, dt, mode, drop) for dt in plan.dtypes for mode, op, drop in FAMILY_ORDER
                if op in args.ops and mode in args.modes and plan.features.get(op)]  # fmt: skip
    backends()  # imports every backend before the clock starts
    print(
        f"calibrating {info['name']} ({info['slug']}) -> {out}; budget {plan.budget_s:.0f} s", file=sys.stderr
    )
    with tqdm(unit="series", file=sys.stderr, dynamic_ncols=True, mininterval=1.0) as bar:
        run = Run(plan, args, previous, bar, info)
        work = run.plan_tasks(families, tuple(args.activations))
        if ranks.world > 1:  # this rank's share of the series; its budget is the whole run's
            run.queue = ranking.deal(run.queue, ranks)
            run.weight = {f: max(1, sum(t[0] == "series" for t in q)) for f, q in run.queue.items()}
            mine = {(id(t[1]), t[2]) for q in run.queue.values() for t in q}
            work = [(s_, f_) for s_, f_ in work if (id(s_), f_) in mine]
        bar.reset(total=sum(run.weight[f] for f in families if run.queue[f]))
        warmed = None
        from dispatch.calibrate import warm

        workers = warm.workers(args.workers, device)
        if workers and work:
            bar.set_description_str(f"compiling ahead in {workers} processes", False)
            warmed = warm.warm(warm.jobs(work, plan, run.only), workers, plan.budget_s / 4, device)
        labels = sorted({f"{f.op} {_dt(f.dtype)} {f.mode}" for f in families})

        def history() -> dict:
            runs_ = _runs(previous, args, plan, run.elapsed(), labels)
            return {"warm_up": warmed, "runs": runs_, "elapsed_s": runs_[-1]["elapsed_s"]}

        run.run(lambda: heuristics.save_table(run.document(True, history()), ranking.checkpoint_path(out, ranks)))
    if ranks.world > 1:
        heuristics.save_table(run.document(True, history()), ranking.checkpoint_path(out, ranks))
        everyone = ranking.gather(list(run.entries.values()), ranks)
        if not ranks.lead:
            path = ranking.announce(None, ranks)
            print(f"rank {ranks.rank}: {len(run.entries)} entries measured here; the table is {path}")
            ranking.finish(out, ranks)
            return 0
        run.entries = {_key(e): e for e in everyone}
    if cuda:  # every rank's series in hand: the family's host costs decide (plan.pool_host)
        refit.refit_entries(list(run.entries.values()), gpu=True)
    done = history()
    run.info = {**info, "measured_bandwidth_gbs": _bandwidth_gbs(device)}
    doc = run.document(extra=done)
    doc["self_check"] = report.self_check(doc)
    heuristics.save_table(doc, out)
    if args.slim_out:
        heuristics.save_table(heuristics.slim(doc, out), args.slim_out)
    heuristics.reload()
    select.clear_cache()
    from dispatch import table as table_cli

    print(table_cli.render(heuristics.Table(doc, out)))
    print(report.format_self_check(doc["self_check"]))
    print(report.format_costs(doc["settings"]))
    state = "stopped by the budget after" if run.stopped else "finished in"
    st = doc["settings"]
    print(f"{state} {run.elapsed():.0f} s: {st['series_measured']} of {st['series_planned']} series measured, "
          f"{len(doc['entries'])} entries; wrote {out}" + (" (run again with --resume to extend it)" if run.stopped else ""))  # fmt: skip
    if ranks.world > 1:
        ranking.announce(out, ranks)
        ranking.finish(out, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
