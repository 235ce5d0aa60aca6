"""python -m dispatch.calibrate: measure every backend here and write this device's heuristics table.

A series (one activation class of a family: op, dtype, mode, dropout; one real-model feature size)
times plain PyTorch and every backend serving its calls on both clocks over a coarse grid of token
counts M, bisecting where the winner changes. The next task goes to the family that has spent least per
planned series, so a loaded machine still covers every family. A backend enters a segment only after
matching the float64 reference there; a class's other activations and dtypes take the representative's
timings, each checked on its own. The table is written atomically, also every 30 s (``--resume``).
A run over an existing table of this device keeps the entries it does not measure again; a file it
could not extend (another device's table, another schema, not a table) is never overwritten.

    python -m dispatch.calibrate --quick                      # a GPU ~2 min, 2 CPU cores < 3 min
    python -m dispatch.calibrate --out benchmarks/results/calibrate_points-nvidia-h200.json \\
        --slim-out dispatch/heuristics/tables/nvidia-h200.json          # full: 124 series in ~500 s on a GPU
    python -m dispatch.calibrate --refit RAW [--agree OTHER]   # the current rule on measured points
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from dispatch import heuristics, ops, select, timing
from dispatch.calibrate import report, warm
from dispatch.calibrate.plan import BASELINE, MODES, Family, Plan, default_plan, family_order
from dispatch.calibrate.run import Run, Settings
from dispatch.calibrate.series import dtype_name
from dispatch.contracts.compiled import CompileNotice
from dispatch.heuristics import DeviceInfo, Document, EntryId, EntryRecord
from dispatch.registry import backends
from dispatch.table import runs_of


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dispatch.calibrate", description=__doc__.split("\n")[0])
    add = p.add_argument
    every = list(dict.fromkeys(a for op in ops.all_specs() for a in op.variants() if a is not None))
    add("--ops", nargs="+", choices=ops.names(), default=list(ops.names()))
    add(
        "--dtypes",
        nargs="+",
        choices=["float32", "bfloat16", "float16"],
        help="measured dtypes (GPU: bfloat16, float16 sharing its timings, float32; CPU: float32, bfloat16)",
    )
    add("--activations", nargs="+", choices=every,
        help="values of the ops' variant traits, activations (an op takes only its own); default: all")
    add("--modes", nargs="+", choices=MODES, default=list(MODES))
    add("--backends", nargs="+", help=f"time only these ({BASELINE}, the baseline, always)")
    add("--quick", action="store_true", help="a few feature sizes and token counts, one dtype")
    add("--budget", type=float, help="seconds for the whole run (default 550; quick 90 GPU, 150 CPU)")
    add(
        "--features",
        nargs="+",
        help="feature sizes, the op's dims after M: N (bias_act_dropout), N,K (fused_linear), H,F (fused_mlp)",
    )
    add("--tokens", nargs="+", type=int, help="the coarse grid of token counts M")
    add("--out", help="default: <user dir>/<device slug>.json, the first place lookup looks")
    add("--slim-out", help="also write the table without its raw points (as dispatch/heuristics/tables/ ships it)")
    add("--resume", action="store_true", help="keep what --out has measured, measure the rest")
    add("--refresh", action="store_true", help="measure the selected families again, keep the rest of --out")
    add("--tables", action="store_true", help="print the choice tables at the end (python -m dispatch.table)")
    add("--workers", type=int, help="processes compiling ahead (GPU default: CPU cores - 1, at most 15)")
    add("--refit", metavar="RAW", help="measure nothing: fit RAW's points again by the current rule")
    add("--agree", metavar="OTHER", help="with --refit: the share of choice cells RAW and OTHER agree on")
    return p.parse_args(argv)


def settings_of(args: argparse.Namespace) -> Settings:
    tup = lambda v: tuple(v) if v else None  # noqa: E731
    return Settings(
        ops=tuple(args.ops), modes=tuple(args.modes), activations=tup(args.activations),
        backends=frozenset(args.backends) if args.backends else None, quick=args.quick, budget=args.budget,
        dtypes=tup([getattr(torch, d) for d in args.dtypes or ()]),
        features=tup([tuple(int(v) for v in f.split(",")) for f in args.features or ()]),
        tokens=tup(sorted(set(args.tokens or ()))), resume=args.resume, refresh=args.refresh,
        workers=args.workers,
    )  # fmt: skip


def make_plan(settings: Settings, device: torch.device) -> Plan:
    plan = default_plan(device, settings.quick, settings.budget, settings.ops)
    if settings.dtypes:
        plan.dtypes = settings.dtypes
        plan.shared = {d: tuple(s for s in ss if s not in plan.dtypes) for d, ss in plan.shared.items()}
    if settings.features:
        dims = lambda op: ops.get(op).feature_dims  # noqa: E731
        plan.features = {op: [f for f in settings.features if len(f) == dims(op)] for op in settings.ops}
        plan.float32_sizes = 0
    if settings.tokens:
        plan.tokens = settings.tokens
    return plan


def _flag(settings: Settings) -> str:
    return "--refresh" if settings.refresh else "--resume" if settings.resume else "--out"


def _previous(path: str, info: DeviceInfo, flag: str = "--resume/--refresh") -> Optional[Document]:
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


def _kept(previous: Document, entries: dict[EntryId, EntryRecord]) -> str:
    """How many of the existing table's entries the run kept as they were (not measured again)."""
    before = previous["entries"]
    kept = sum(entries.get(EntryId.of_entry(e)) is e for e in before)
    again = f"; the other {len(before) - kept} measured again" if kept < len(before) else ""
    return f"kept {kept} of the {len(before)} entries of the table already there{again}"


def _runs(
    previous: Optional[Document], settings: Settings, plan: Plan, seconds: float, families: list
) -> list:
    """The table's history: a refresh is one more run, a resumed run one more part of the last one, a
    run over an existing table one more run of its families."""
    done = [] if previous is None else runs_of(previous.get("settings", {}), previous.get("date"))
    this = {"date": datetime.date.today().isoformat(), "elapsed_s": round(seconds, 1)}
    kind = "quick" if plan.quick else "full"
    if settings.refresh:
        return done + [{"run": "refresh", **this, "families": families}]
    if done and settings.resume:
        last = done[-1]
        seconds += last["elapsed_s"]
        return done[:-1] + [{**last, "elapsed_s": round(seconds, 1), "parts": last.get("parts", 1) + 1}]
    if done:
        return done + [{"run": kind, **this, "parts": 1, "families": families}]
    return [{"run": kind, **this, "parts": 1}]


def _summary(doc: Document, out: str, seconds: float, kept: str, argv: Sequence[str]) -> list[str]:
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
    cut = {label: f["series_left"] for label, f in (st.get("families") or {}).items() if f.get("series_left")}
    if cut:
        listed = ", ".join(f"{label} ({n} series)" for label, n in sorted(cut.items()))
        again = " ".join(a for a in argv if a != "--resume")
        lines.append(f"not measured, the budget ran out: {listed}. Their calls run on plain PyTorch (explain() "
                     f"says 'not measured here'); measure them with: python -m dispatch.calibrate "
                     f"{again + ' ' if again else ''}--resume")  # fmt: skip
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
    warnings.simplefilter("ignore", CompileNotice)  # compiling every kind is what this command does
    if args.agree and not args.refit:
        sys.exit("--agree compares a refitted calibration with another: give --refit RAW too")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks would each measure and write the same table
        sys.exit("python -m dispatch.calibrate runs in one process: run it without torchrun, on one GPU")
    if args.refit:
        return report.refit_main(args.refit, args.out, args.slim_out, args.agree)
    settings = settings_of(args)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    plan, info = make_plan(settings, device), heuristics.device_info(device)
    out = args.out or os.path.join(heuristics.user_dir(), info["slug"] + ".json")
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.exists(folder) and not os.path.isdir(folder):  # found before measuring, not at the first save
        named = "--out" if args.out else heuristics.ENV_DIR
        sys.exit(f"cannot write {out}: {folder} is a file, not a directory (named by {named})")
    previous = _previous(out, info, _flag(settings))
    families = [Family(op, dt, mode, drop) for dt in plan.dtypes
                for mode, op, drop in family_order(settings.ops)
                if mode in settings.modes and plan.features.get(op)]  # fmt: skip
    labels = sorted({f"{f.op} {dtype_name(f.dtype)} {f.mode}" for f in families})
    backends()  # every backend imported before the clock starts
    threads = f" at {info['threads']} threads" if info["type"] == "cpu" else ""
    where = f"{info['name']}{threads} ({info['slug']}) -> {out}"
    print(f"calibrating {where}; budget {plan.budget_s:.0f} s", file=sys.stderr)
    with tqdm(unit="series", file=sys.stderr, dynamic_ncols=True, mininterval=1.0) as bar:
        run = Run(plan, settings, previous, bar)
        work = run.plan_tasks(families)
        bar.reset(total=sum(t.kind == "series" for q in run.queue.values() for t in q))
        workers, warmed = warm.workers(settings.workers, device), None
        if workers and work:
            bar.set_description_str(f"compiling ahead in {workers} processes", False)
            warmed = warm.warm(warm.jobs(work, plan, settings.backends), workers, plan.budget_s / 4, device)

        def history() -> dict:
            runs_ = _runs(previous, settings, plan, time.monotonic() - run.start, labels)
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
    argv = sys.argv[1:] if argv is None else argv
    print("\n".join(_summary(doc, out, time.monotonic() - run.start, kept, argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
