"""python -m dispatch.calibrate: measure every backend here and write this device's heuristics table.

For each op, dtype, mode (inference: forward without grad; training: forward + backward), dropout
on/off and activation class, and for each real-model feature size, it times every backend that can
serve the call at a coarse grid of token counts M, then bisects between neighbouring points whose
winners differ, so the table records where the crossovers are rather than a blind dense grid. A
backend enters a table's cell only after matching the float64 reference at the points that put
it there (its error is stored; with worker processes a point is timed first and checked after,
its winner at a fit point, every backend at a held-out one).
Activations of one class share timings but are each parity-checked, and keep their own keys.
The table is written atomically as JSON; the run ends with the choice tables and a self-check on
held-out measured points (a point where the table's pick misses by its first timings is timed again,
every backend side by side, and the self-check reports both). A measured point whose winner beats
eager by less than 10% on a short (host-bound) call is timed again the same way before the fit keeps
it. ``--budget`` stops measuring gracefully: what was measured is written.

    python -m dispatch.calibrate --quick                      # ~2 min on an H200, < 3 min on 2 CPU cores
    python -m dispatch.calibrate --out benchmarks/results/calibrate_points-nvidia-h200.json \
        --slim-out heuristics/tables/nvidia-h200.json                     # full (H200: 489-541 s)
    python -m dispatch.calibrate --refresh --modes training --out ...      # those families again

The table written at ``--out`` keeps every measured point (what --resume and --refresh need);
``--slim-out`` also writes it without them (heuristics.slim), as heuristics/tables/ ships it.

On a GPU the calls the run will make are first compiled by worker processes into inductor's and
Triton's on-disk caches, and the parity checks run there while this process only times
(``--workers``, dispatch.calibrate_workers).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from dispatch import heuristics
from dispatch import calibrate_bench as bench
from dispatch import calibrate_checks, calibrate_report, select, timing
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.calibrate_plan import MODES, NOISE, PREFERENCE, Plan, default_plan, held_out_sizes
from dispatch.calibrate_run import Run
from dispatch.registry import OPS, backends
from dispatch.table import runs_of

# Which families are measured first, breadth first (a budget may stop the run): inference before
# training, as its compiles are cheaper (on 2 CPU cores inductor compiled bias_act_dropout inference
# in ~10 s, training with dropout in ~75 s), so a stopped run still covers the most families.
FAMILY_ORDER = (
    ("inference", "bias_act_dropout", False),
    ("inference", "fused_linear", False),
    ("training", "bias_act_dropout", True),
    ("training", "fused_linear", False),
    ("training", "bias_act_dropout", False),
    ("inference", "bias_act_dropout", True),
)


def _bandwidth_gbs(device: torch.device) -> Optional[float]:
    """Measured device-to-device copy bandwidth (read + write) of 1 GiB."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**28, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timing.per_call_ms(lambda: dst.copy_(src), [], device, True, False)
    return round(2 * src.numel() * 4 / ms / 1e6, 1)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dispatch.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on GPU, float32 on CPU (--quick); more without",
    )
    p.add_argument("--activations", nargs="+", choices=ACTIVATION_NAMES, default=list(ACTIVATION_NAMES))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--backends", nargs="+", help="time only these (eager, the baseline, is always timed)")
    p.add_argument("--quick", action="store_true", help="a few feature sizes, token counts and one dtype")
    p.add_argument("--budget", type=float, help="seconds of measuring; then the measured part is written")
    p.add_argument(
        "--features", nargs="+", help="feature sizes: N for bias_act_dropout, N,K for fused_linear"
    )
    p.add_argument("--tokens", nargs="+", type=int, help="the coarse grid of token counts M")
    p.add_argument("--out", help="default: <user dir>/<device slug>.json, the first place lookup looks")
    p.add_argument(
        "--slim-out",
        help="also write the table without its raw measured points here (what heuristics/tables/ ships)",
    )
    p.add_argument("--resume", action="store_true", help="keep the series already in --out, measure the rest")
    p.add_argument(
        "--refresh",
        action="store_true",
        help="measure the selected --ops/--dtypes/--modes/--activations again, keeping the other entries "
        "of the table at --out (after a timer or backend change that touches only some families)",
    )
    p.add_argument(
        "--probe", action="store_true", help="time every activation once; measure apart those that differ"
    )
    p.add_argument(
        "--workers",
        type=int,
        help="processes that compile the JIT backends' calls ahead (into their on-disk caches) and run "
        "the parity checks while this one only times (default on GPU: CPU cores - 2, at most 12; on "
        "CPU 0: everything in this process)",
    )
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace, device: torch.device) -> Plan:
    plan = default_plan(device, args.quick, args.budget)
    if args.dtypes:
        plan.dtypes = tuple(getattr(torch, d) for d in args.dtypes)
    if args.features:
        sizes = [tuple(int(v) for v in f.split(",")) for f in args.features]
        plan.features = {
            "bias_act_dropout": [f for f in sizes if len(f) == 1],
            "fused_linear": [f for f in sizes if len(f) == 2],
        }
    if args.tokens:
        plan.tokens = tuple(sorted(set(args.tokens)))
    plan.probe = args.probe
    return plan


def _previous(path: str, info: dict) -> Optional[dict]:
    """--resume: the table at ``path`` if it is this device's and of these versions, else None."""
    table = heuristics.load_table(path) if os.path.exists(path) else None
    if table is not None and any("points" not in e for e in table.data["entries"]):
        # starting afresh would write a table of the selected families only over a whole one
        raw = (table.data.get("raw_points") or {}).get("file", "the table --out wrote")
        sys.exit(f"--resume/--refresh: {path} keeps no raw measured points; run on {raw} instead")
    if table is None or table.slug != info["slug"] or table.version_mismatch():
        print(f"--resume: no table of this device and versions at {path}; starting afresh", file=sys.stderr)
        return None
    return table.data


def _selected(args: argparse.Namespace, plan: Plan) -> Callable[[dict], bool]:
    """Whether a table entry (or held-out record) belongs to the families this run's arguments select."""
    dtypes = {str(d).removeprefix("torch.") for d in plan.dtypes}

    def selected(e: dict) -> bool:
        return (
            e["op"] in args.ops
            and e["dtype"] in dtypes
            and e["mode"] in args.modes
            and e["activation"] in args.activations
        )

    return selected


def _runs(
    previous: Optional[dict], args: argparse.Namespace, plan: Plan, seconds: float, families: list
) -> list:
    """The table's history with this run: a refresh is one more run (with the families it measured
    again), a resumed run one more part of the last run, a fresh one the first run."""
    runs = [] if previous is None else runs_of(previous.get("settings", {}), previous.get("date"))
    today = datetime.date.today().isoformat()
    if args.refresh:
        return runs + [
            {"run": "refresh", "date": today, "elapsed_s": round(seconds, 1), "families": families}
        ]
    if runs:  # --resume
        last = runs[-1]
        parts = {"elapsed_s": round(last["elapsed_s"] + seconds, 1), "parts": last.get("parts", 1) + 1}
        return runs[:-1] + [{**last, **parts}]
    kind = "quick" if plan.quick else "full"
    return [{"run": kind, "date": today, "elapsed_s": round(seconds, 1), "parts": 1}]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    plan = make_plan(args, device)
    info = heuristics.device_info(device)
    out = args.out or os.path.join(heuristics.user_dir(), info["slug"] + ".json")
    previous = _previous(out, info) if args.resume or args.refresh else None
    # --refresh measures the selected series as if missing; each old entry stays until its new one
    # replaces it (a refresh stopped by its budget leaves a whole table), but the selected families'
    # held-out records go now: the self-check must not compare old timings with new fits
    refresh = _selected(args, plan) if args.refresh else lambda e: False
    if previous is not None:
        previous = {
            **previous,
            "held_out_sizes": [h for h in previous.get("held_out_sizes", []) if not refresh(h)],
        }
    families = [
        (op, dt, mode, drop)
        for dt in plan.dtypes
        for mode, op, drop in FAMILY_ORDER
        if op in args.ops and plan.features.get(op) and mode in args.modes
    ]
    backends()  # imports every backend before the clock starts
    print(
        f"calibrating {info['name']} ({info['slug']}) -> {out}; budget {plan.budget_s:.0f} s", file=sys.stderr
    )
    with tqdm(total=len(families), unit="family", file=sys.stderr, dynamic_ncols=True) as bar:
        workers = _workers(args, plan)
        run = Run(plan, set(args.backends) if args.backends else None, bar, previous, workers)
        groups = [run.probe(*fam, tuple(args.activations)) for fam in families]
        # breadth first, so a run stopped by its budget has every family at some feature size
        depth = max(map(len, plan.features.values()), default=0)
        work = [
            (g[c], plan.features[g[c].op][r])
            for r in range(depth)
            for c in range(max(map(len, groups), default=0))
            for g in groups
            if c < len(g) and r < len(plan.features[g[c].op])
        ]
        done = {
            (e["op"], e["dtype"], e["mode"], e["dropout"], e["activation"], tuple(e["features"]))
            for e in run.entries.values()
            if e["activation"] == e["measured_as"] and not refresh(e)
        }
        todo = [(s, f) for s, f in work if (s.op, str(s.dtype)[6:], s.mode, s.dropout, s.rep, f) not in done]
        series = list({id(s): s for s, _ in work}.values())
        # what the run will compile: the series left, every series again if members are left to check
        # (a resumed run on a fresh machine), and the self-check's unmeasured sizes
        members_left = any(not e["parity_checked"] for e in run.entries.values())
        ahead = list(work) if members_left and not plan.quick else list(todo)
        # the self-check's points at unmeasured sizes, for the series that have none yet
        held = {(h["op"], h["dtype"], h["activation"], h["mode"], h["dropout"]) for h in run.held_sizes}
        unheld = (
            [s for s in series if (s.op, str(s.dtype)[6:], s.rep, s.mode, s.dropout) not in held]
            if plan.held_out_sizes
            else []
        )
        ahead += [(s, f) for s in unheld for f, _ in held_out_sizes(plan, s)]
        warmed = _warm(plan, run, ahead, bar)
        bar.reset(total=len(todo))
        bar.unit = "series"
        # a full run keeps 20% of its budget for what follows the series: the unmeasured sizes (to
        # 85%), the narrow wins timed again (to 88%), the deferred parity checks (to 95%) and the
        # member checks (to 100%). On the H200 a full run (489 s, 126 series) spent 380 s compiling
        # ahead and on the series, then 18 s on the unmeasured sizes, 54 s on the parity checks and
        # 34 s on the member checks; another (budget 535 s) 422 s, then 16, 64 and 31 s, when the
        # budget cut the member checks short (19 of 346 segments). The parity checks now check a fit
        # point's winner only (check_deferred): ~228 of those 404 worker seconds, by the latter's
        # table. A resumed run whose unmeasured sizes are done keeps 15%. A quick run with workers
        # keeps 30% for its deferred checks
        after = 0.2 if unheld else 0.15
        run.reserve = (0.3 if run.workers else 0.0) if plan.quick else after
        for s, features in todo:
            if run.over():
                break
            run.series(s, features)
            bar.update()
        run.reserve = 0.0 if plan.quick else 0.15
        if unheld and not run.over():
            bar.reset(total=len(unheld) * plan.held_out_sizes)
            bar.unit = "point"
            calibrate_checks.held_out_at_other_sizes(run, unheld)
        # the narrow wins over eager, timed again before the checks and the fit: to 88% of the budget,
        # at least 10 s, at most 30 s (10 quick); an H200 full table had 41 such points, and its resumed
        # run timed 22 of them in 30 s, narrowest first (6 changed winner)
        left = plan.budget_s * 0.88 - (time.monotonic() - run.start)
        narrow = calibrate_checks.confirm_narrow(run, min(max(left, 10.0), 10.0 if plan.quick else 30.0))
        member_checks = None
        run.reserve = 0.0
        # even past the budget: unchecked timings never reach a table
        share = 1.0 if plan.quick else 0.95
        left = plan.budget_s * share - (time.monotonic() - run.start)
        checked = calibrate_checks.check_deferred(run, max(30.0, left))
        if not plan.quick:  # past the budget, members keep only what the workers checked
            bar.reset(total=sum(not e["parity_checked"] for e in run.entries.values()))
            bar.unit = "member"
            member_checks = calibrate_checks.check_members(run)
        # the held-out points whose pick missed by their first timings, timed again (the self-check
        # reports both): within what is left of the budget, at least 15 s and at most 45 s (10 quick)
        left = plan.budget_s - (time.monotonic() - run.start)
        so_far = {  # what the self-check reads of the table (picks and held-out points)
            "schema_version": heuristics.SCHEMA_VERSION,
            "device": info,
            "entries": list(run.entries.values()),
            "held_out_sizes": run.held_sizes,
        }
        confirmed = calibrate_checks.confirm(run, so_far, min(max(left, 15.0), 10.0 if plan.quick else 45.0))
    this_run = time.monotonic() - run.start
    runs = _runs(
        previous, args, plan, this_run, sorted({f"{op} {str(dt)[6:]} {mode}" for op, dt, mode, _ in families})
    )
    elapsed = runs[-1]["elapsed_s"]
    entries = sorted(
        run.entries.values(),
        key=lambda e: (e["op"], e["dtype"], e["mode"], e["dropout"], e["activation"], e["features"]),
    )
    for e in entries:  # what lookup reads, also in a table without the points
        e["max_m"] = max((p["m"] for p in e["points"]), default=e["segments"][-1]["m_from"])
    doc = {
        "schema_version": heuristics.SCHEMA_VERSION,
        "device": {**info, "measured_bandwidth_gbs": _bandwidth_gbs(device)},
        "versions": {**heuristics.running_versions(), "python": platform.python_version()},
        "date": datetime.date.today().isoformat(),
        "settings": {
            "quick": plan.quick,
            "noise": NOISE,
            "preference": list(PREFERENCE),
            "p_dropout": bench.P_DROPOUT,
            "timer": "max(triton.testing.do_bench median, back-to-back wall time per call)"
            if device.type == "cuda"
            else "time.perf_counter median",
            "budget_s": plan.budget_s,
            "elapsed_s": elapsed,
            "runs": runs,
            "stopped_by_budget": run.stopped,
            "series_measured": sum(e["activation"] == e["measured_as"] for e in entries),
            "series_planned": len(work),
            "members_unchecked": sum(not e["parity_checked"] for e in entries),
            "warm_up": warmed,
            "parallel_checks": checked,
            "parallel_member_checks": member_checks,
            "timed_again": confirmed,
            "narrow_wins_timed_again": narrow,
            "series_seconds": run.series_log,
            "seconds_by_backend": {
                n: {k: round(v, 1) for k, v in c.items()} for n, c in sorted(run.cost.items())
            },
        },
        "backends": {n: backends()[n].display_name() for n in sorted(run.used) if n in backends()},
        "entries": entries,
        "held_out_sizes": run.held_sizes,
    }
    doc["self_check"] = calibrate_report.self_check(doc)
    heuristics.save_table(doc, out)
    if args.slim_out:
        heuristics.save_table(heuristics.slim(doc, out), args.slim_out)
    heuristics.reload()
    select.clear_cache()
    from dispatch import table as table_cli

    print(table_cli.render(heuristics.Table(doc, out)))
    print(calibrate_report.format_self_check(doc["self_check"]))
    print(calibrate_report.format_costs(doc["settings"]))
    st = doc["settings"]
    state = "stopped by the budget after" if run.stopped else "finished in"
    print(
        f"{state} {time.monotonic() - run.start:.0f} s: {len(run.series_log)}/{len(todo)} series measured "
        f"({st['series_measured']} in the table), "
        f"{st['members_unchecked']} activations sharing a representative's parity; wrote {out}"
        + (" (run again with --resume to extend it)" if run.stopped else "")
    )
    return 0


def _workers(args: argparse.Namespace, plan: Plan) -> int:
    if args.workers is not None:
        return max(args.workers, 0)
    return min(12, max((os.cpu_count() or 1) - 2, 0)) if plan.device.type == "cuda" else 0


def _warm(plan: Plan, run: Run, todo: list, bar: tqdm) -> Optional[dict]:
    """With workers, compile what the measuring will meet in them first (dispatch.calibrate_workers),
    within a third of the budget; the time counts against the budget."""
    if not run.workers or not todo:
        return None
    from dispatch import calibrate_workers

    calls = calibrate_workers.cases(todo, plan, run.only)
    if not calls:
        return None
    bar.set_description_str(f"compiling {len(calls)} calls ahead in {run.workers} processes", False)
    try:
        return calibrate_workers.warm(calls, run.workers, plan.budget_s / 3, plan.device, bar)
    except OSError as exc:  # no processes to be had: measuring still works, only slower
        print(f"compiling ahead failed ({exc}); measuring compiles as it goes", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
