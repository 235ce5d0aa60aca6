"""The checks of ``python -m dispatch.calibrate`` after its series are timed: parity checks deferred to
the worker processes (``check_deferred``), the activations that share a representative's timings
(``check_members``), and the self-check's points at feature sizes the plan does not measure."""

from __future__ import annotations

import time
from typing import Optional

import torch

from dispatch import calibrate_bench as bench
from dispatch import calibrate_workers
from dispatch.calibrate_plan import Series, fit, held_out_sizes, rank
from dispatch.calibrate_run import Run


def runs(points: list[dict]) -> list[list[dict]]:
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
    run: Run,
    s: Series,
    act: str,
    features: tuple[int, ...],
    rep_points: list[dict],
    known: Optional[dict[tuple[str, int], list]] = None,
    local: bool = True,
) -> Optional[list[dict]]:
    """A member shares its representative's timings. Each run of consecutive points with one
    winner (a segment) is parity-checked for the member at its largest M, where accumulated error
    is largest; a winner that fails there leaves that run's points and the next best is checked,
    until every run's winner has passed. ``known``: gate results already had, by (backend, M);
    without ``local``, a check not among them leaves the member unchecked (None)."""
    points = [{**p, "ms": dict(p["ms"]), "err": {}, "rejected": {}} for p in rep_points]
    checked: set[tuple[str, int]] = set()
    while True:
        todo = [
            (rank(r[-1]["ms"])[0], r)
            for r in runs(points)
            if (rank(r[-1]["ms"])[0], r[-1]["m"]) not in checked
        ]
        if not todo:
            return points
        for pick, segment in todo:
            probe = segment[-1]
            if known and (pick, probe["m"]) in known:
                ok = Run.verdict(probe, pick, known[(pick, probe["m"])])
            elif not local:
                return None
            else:
                case = run.case(s, act, probe["m"], features)
                inp, refs, eager = calibrate_workers.inputs(case)
                start = time.monotonic()
                ok = run.gate(pick, case, inp, refs, eager, probe)
                run.spent(pick, "check", start)
            checked.add((pick, probe["m"]))
            if not ok:
                for p in segment:
                    p["ms"].pop(pick, None)
                    p["rejected"].setdefault(pick, probe["rejected"][pick])


def check_members(run: Run) -> Optional[dict]:
    """Full runs, after every representative: parity-check each member (``check_member``). With
    workers, the first check of every segment runs in them, all at once; the rare fallback after
    a failed pick runs here. Returns the workers' summary, if they ran."""
    todo = []
    for key, e in list(run.entries.items()):
        rep = run.entries.get((*key[:2], e["measured_as"], *key[3:]))
        if not e["parity_checked"] and rep is not None:
            s = Series(e["op"], getattr(torch, e["dtype"]), e["mode"], e["dropout"], e["measured_as"])
            todo.append((s, e["activation"], tuple(e["features"]), rep["points"]))
    known: dict[tuple, list] = {}
    summary = None
    if run.workers and todo:
        jobs, where = [], []
        for s, act, feats, points in todo:
            for segment in runs(points):
                pick, m = rank(segment[-1]["ms"])[0], segment[-1]["m"]
                jobs.append([len(jobs), *calibrate_workers.case_job(run.case(s, act, m, feats)), [pick]])
                where.append((s.label, act, feats, pick, m))
        run.bar.set_description_str(f"member checks in {run.workers} processes", False)
        left = max(30.0, run.plan.budget_s - (time.monotonic() - run.start))
        try:
            results, summary = calibrate_workers.check(jobs, run.workers, left, run.plan.device, run.bar)
        except OSError as exc:  # no processes to be had: checked here, as without workers
            summary = {"points": len(jobs), "workers": 0, "seconds": 0.0, "spawn_failed": str(exc)}
            results = {}
        for (label, act, feats, pick, m), job in zip(where, jobs):
            if pick in results.get(job[0], {}):
                known[(label, act, feats, pick, m)] = results[job[0]][pick]
    for s, act, feats, points in todo:  # past the budget, only what the workers already checked
        mine = {
            (pick, m): r
            for (label, a, f, pick, m), r in known.items()
            if (label, a, f) == (s.label, act, feats)
        }
        checked = check_member(run, s, act, feats, points, mine, local=not run.over())
        if checked is not None:
            run.add(s, act, feats, checked, [], True)
        run.bar.update()
    return summary


def check_deferred(run: Run, deadline_s: float) -> Optional[dict]:
    """With workers: parity-check every timed point (fit points, held-out points) in the worker
    processes, drop the backends that failed from those points, and refit every entry. A backend
    that ran out of memory in a worker (they share the device) is checked again here, within the
    deadline; a point whose worker was stopped or died counts as failed for every backend (a worker
    that crashed may have met a backend that breaks the CUDA context: not run here again)."""
    pending: list[tuple[dict, dict]] = []
    for e in run.entries.values():
        for p in e["points"] + e["held_out"]:
            if "unchecked" in p and e["activation"] == e["measured_as"]:
                pending.append((e, p))
    pending += [(h, h["point"]) for h in run.held_sizes if "unchecked" in h["point"]]
    if not pending:
        return None
    run.bar.reset(total=len(pending))
    run.bar.unit = "point"
    run.bar.set_description_str(f"parity checks in {run.workers} processes", False)
    jobs = []
    for i, (e, p) in enumerate(pending):
        case = bench.Case.of_entry(e, p["m"], run.plan.device)
        jobs.append([i, *calibrate_workers.case_job(case), p["unchecked"]])
    start = time.monotonic()
    try:
        results, summary = calibrate_workers.check(jobs, run.workers, deadline_s, run.plan.device, run.bar)
        spawned = True
    except OSError as exc:  # no processes to be had: everything is checked here, as without workers
        results, spawned = {}, False
        summary = {"points": len(jobs), "workers": 0, "seconds": 0.0, "spawn_failed": str(exc)}
    redo = 0
    for i, (e, p) in enumerate(pending):
        got = dict(results.get(i, {}))
        names = p.pop("unchecked")
        left = [n for n in names if n not in got]
        here = not spawned or i in results  # out of memory in a worker, or no workers at all
        if left and here and time.monotonic() - start < deadline_s + 60.0:
            got.update(check_here(run, jobs[i], left))
            redo += 1
        for name in names:
            Run.verdict(p, name, got.get(name, [False, None, "its parity check did not finish"]))
    summary["checked_in_this_process"] = redo
    for key, e in list(run.entries.items()):
        for p in e["points"]:
            p.pop("unchecked", None)  # members' copies of their representative's points
        segments = fit(e["points"])
        if segments:
            e["segments"] = segments
        else:
            del run.entries[key]
    run.bar.update(len(pending))
    return summary


def check_here(run: Run, job: list, names: list[str]) -> dict[str, list]:
    """Gate results of a check job that the workers did not deliver (none if the case itself
    cannot run here)."""
    case = calibrate_workers.case_of(job[1:8], run.plan.device)
    try:
        inp, refs, eager = calibrate_workers.inputs(case)
        return {n: calibrate_workers.gate(n, case, inp, refs, eager) for n in names}
    except Exception as exc:  # the reference or eager itself failed here: nothing passes
        return {n: [False, None, bench.failure(exc)] for n in names}
    finally:
        if case.device.type == "cuda":
            torch.cuda.empty_cache()


def held_out_at_other_sizes(run: Run, series: list[Series]) -> None:
    """The self-check's points at feature sizes the plan does not measure (held_out_sizes): what
    the nearest-size lookup costs is measured, not assumed."""
    for s in series:
        for features, m in held_out_sizes(run.plan, s):
            if run.over():
                return
            case = run.case(s, s.rep, m, features)
            run.held_sizes.append(
                {
                    "op": s.op,
                    "dtype": str(s.dtype).removeprefix("torch."),
                    "activation": s.rep,
                    "mode": s.mode,
                    "dropout": s.dropout,
                    "features": list(features),
                    "point": run.measure(case, run.candidates(s, case)),
                }
            )
            run.bar.update()


CONFIRM_ROUNDS = 9  # three times a point's usual rounds (and time), for the points timed again


def confirm(run: Run, doc: dict, deadline_s: float) -> Optional[dict]:
    """Times again, every backend side by side in ``CONFIRM_ROUNDS`` interleaved rounds, each
    held-out point where the table's pick missed by the first timings (``calibrate_report.suspect``),
    and stores the result as the point's ``confirmed_ms``. Why: a point's fastest backend is the
    minimum of noisy numbers, so near-ties between backends that run the same kernels read as
    regrets of 10-20% at host-bound sizes (session 6's self-check). The first timings stay, and the
    self-check reports both. Points are taken worst first, until ``deadline_s`` has passed."""
    from dispatch import calibrate_report

    # a point timed again by an earlier run (an entry a --refresh or --resume kept) keeps its timings
    found = [
        (e, pt, c)
        for e, pt, c in calibrate_report.picks(doc)
        if "confirmed_ms" not in pt and calibrate_report.suspect(pt, c)
    ]
    if not found:
        return None
    found.sort(key=lambda f: f[1]["ms"][f[2]] / min(f[1]["ms"].values()), reverse=True)
    run.bar.reset(total=len(found))
    run.bar.unit = "point"
    run.bar.set_description_str("timing again the points whose pick missed", False)
    start, done = time.monotonic(), 0
    for e, pt, _ in found:
        if time.monotonic() - start > deadline_s:
            break
        case = bench.Case.of_entry(e, pt["m"], run.plan.device)
        try:
            inp = bench.make_inputs(case, pt["m"] + 1)  # fresh inputs, not the first timing's
            timers = {n: bench.timer(n, case, inp) for n in sorted(pt["ms"])}
            times, _ = bench.time_all(timers, case.device, run.plan.quick, case.training, CONFIRM_ROUNDS)
        except (torch.cuda.OutOfMemoryError, MemoryError):
            continue
        finally:
            if case.device.type == "cuda":
                torch.cuda.empty_cache()
        got = {n: float(f"{t:.5g}") for n, t in times.items() if not isinstance(t, Exception)}
        if got.keys() == pt["ms"].keys():  # a backend that raised now: the first timings stand
            pt["confirmed_ms"] = got
            done += 1
        run.bar.update()
    return {"points": len(found), "timed_again": done, "seconds": round(time.monotonic() - start, 1)}
