"""The checks of ``python -m dispatch.calibrate`` after its series are timed: parity checks deferred to
the worker processes (``check_deferred``), the activations that share a representative's timings
(``check_members``), and the self-check's points at feature sizes the plan does not measure."""

from __future__ import annotations

import time
from typing import Optional

import torch

from dispatch import calibrate_bench as bench
from dispatch import calibrate_workers, timing
from dispatch.calibrate_plan import Series, fit, held_out_sizes, rank
from dispatch.calibrate_run import Run, member_points


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
            points = member_points(rep["points"], e["op"], e["activation"])
            todo.append((s, e["activation"], tuple(e["features"]), points))
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


UNFINISHED = [False, None, "its parity check did not finish"]


def check_deferred(run: Run, deadline_s: float) -> Optional[dict]:
    """With workers: parity-check the timed points in the worker processes, drop the backends that
    failed from those points, and refit every entry.

    Only a winner enters a table's cell, so a fit point checks its winner; when that fails, the next
    best is checked here, and so on. The backends not checked stay listed in the point's
    ``unchecked`` (a later phase or run that changes the winner, ``confirm_narrow``, has it checked
    first). A held-out point checks every backend: the self-check compares them all. A backend that
    ran out of memory in a worker (they share the device) is checked again here, within the deadline;
    a point whose worker was stopped or died counts as failed for every backend asked (a worker that
    crashed may have met a backend that breaks the CUDA context: not run here again)."""
    pending: list[tuple[dict, dict, list[str]]] = []  # (entry, point, the backends asked)
    fits: set[int] = set()  # the fit points among them, by id
    for e in run.entries.values():
        if e["activation"] == e["measured_as"]:
            for p in e["points"]:
                if (w := _winner(p)) in p.get("unchecked", ()):
                    pending.append((e, p, [w]))
                    fits.add(id(p))
            pending += [(e, p, list(p["unchecked"])) for p in e["held_out"] if p.get("unchecked")]
    for h in run.held_sizes:
        if h["point"].get("unchecked"):
            pending.append((h, h["point"], list(h["point"]["unchecked"])))
    if not pending:
        return None
    run.bar.reset(total=len(pending))
    run.bar.unit = "point"
    run.bar.set_description_str(f"parity checks in {run.workers} processes", False)
    jobs = []
    for i, (e, p, names) in enumerate(pending):
        case = bench.Case.of_entry(e, p["m"], run.plan.device)
        jobs.append([i, *calibrate_workers.case_job(case), names])
    start = time.monotonic()
    try:
        results, summary = calibrate_workers.check(jobs, run.workers, deadline_s, run.plan.device, run.bar)
        spawned = True
    except OSError as exc:  # no processes to be had: everything is checked here, as without workers
        results, spawned = {}, False
        summary = {"points": len(jobs), "workers": 0, "seconds": 0.0, "spawn_failed": str(exc)}
    redo = 0

    def in_time() -> bool:
        return time.monotonic() - start < deadline_s + 60.0

    for i, (e, p, names) in enumerate(pending):
        got = dict(results.get(i, {}))
        here = not spawned or i in results  # out of memory in a worker, or no workers at all
        left = [n for n in names if n not in got]
        if left and here and in_time():
            got.update(check_here(run, jobs[i], left))
            redo += 1
        for name in names:
            _settle(p, name, got.get(name, UNFINISHED))
        # a fit point whose winner failed: the next best, checked here
        while id(p) in fits and p["ms"] and (w := _winner(p)) in p.get("unchecked", ()):
            got = check_here(run, jobs[i], [w]) if here and in_time() else {}
            redo += bool(got)
            _settle(p, w, got.get(w, UNFINISHED))
    summary["checked_in_this_process"] = redo
    for key, e in list(run.entries.items()):
        rep = run.entries.get((*key[:2], e["measured_as"], *key[3:]))
        if not e["parity_checked"] and rep is not None and rep is not e:
            # a member not checked yet follows its representative's checks (until its own, if any)
            e["points"] = member_points(rep["points"], e["op"], e["activation"])
        segments = fit(e["points"])
        if segments:
            e["segments"] = segments
        else:
            del run.entries[key]
    run.bar.update(len(pending))
    return summary


def _winner(p: dict) -> Optional[str]:
    return rank(p["ms"])[0] if p["ms"] else None


def _settle(p: dict, name: str, result: list) -> None:
    """Records a deferred gate result in ``p`` and takes ``name`` off its ``unchecked`` list (the
    last one checked removes the list)."""
    Run.verdict(p, name, result)
    left = [n for n in p.get("unchecked", ()) if n != name]
    if left:
        p["unchecked"] = left
    else:
        p.pop("unchecked", None)


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


CONFIRM_ROUNDS = 3 * timing.ROUNDS  # a point's usual rounds (and time) three times, when timed again
# A fit point where a backend beats eager by less than this, on a call shorter than SLOW_MS, is timed
# again before the fit keeps it: host-bound calls (every training call below M ~ 1000 on the H200,
# 0.5-1 ms of autograd and launches) repeat only within 5-10%, so a first-timing win of 3-10% over
# eager is as often noise as not, and a pick that loses to eager there misses the self-check's "never
# more than 3% slower than eager" (on the H200: nvfuser picked at M = 16 in float32 training by 3.5%,
# 5.1% slower than eager when timed again)
NARROW = 0.10


def _time_again(run: Run, e: dict, pt: dict) -> Optional[dict[str, float]]:
    """Every backend timed at ``pt`` in ``pt`` side by side, ``CONFIRM_ROUNDS`` interleaved rounds, on
    fresh inputs (not the first timing's); None if any of them cannot be timed now (out of memory, or a
    backend that raised: the first timings then stand)."""
    case = bench.Case.of_entry(e, pt["m"], run.plan.device)
    try:
        inp = bench.make_inputs(case, pt["m"] + 1)
        timers = {n: bench.timer(n, case, inp) for n in sorted(pt["ms"])}
        times, _ = bench.time_all(timers, case.device, run.plan.quick, case.training, CONFIRM_ROUNDS)
    except (torch.cuda.OutOfMemoryError, MemoryError):
        return None
    finally:
        if case.device.type == "cuda":
            torch.cuda.empty_cache()
    got = {n: float(f"{t:.5g}") for n, t in times.items() if not isinstance(t, Exception)}
    return got if got.keys() == pt["ms"].keys() else None


def narrow(pt: dict) -> Optional[float]:
    """How much a point's winner beats eager by, if it is not eager and wins by less than ``NARROW``
    on a call shorter than ``timing.SLOW_MS``, and the point was not timed again already."""
    ms = pt["ms"]
    if "first_ms" in pt or "eager" not in ms or ms["eager"] >= timing.SLOW_MS:
        return None
    winner = rank(ms)[0]
    margin = ms["eager"] / ms[winner] - 1
    return margin if winner != "eager" and margin < NARROW else None


def confirm_narrow(run: Run, deadline_s: float) -> Optional[dict]:
    """Before the member checks: times again (``_time_again``) each measured point whose winner beats
    eager narrowly (``narrow``), narrowest first, until ``deadline_s`` has passed. The new timings
    become the point's ``ms`` (the first ones stay as ``first_ms``) and the entry is fit again; the
    members sharing it take the new timings of their own backends. A member already checked (an
    earlier part of a --resume) whose picks change this way is checked again."""
    found = [
        (margin, e, p)
        for e in run.entries.values()
        if e["activation"] == e["measured_as"]
        for p in e["points"]
        if (margin := narrow(p)) is not None
    ]
    if not found:
        return None
    found.sort(key=lambda f: f[0])
    checks = {id(e): _probes(e) for e in run.entries.values()}
    run.bar.reset(total=len(found))
    run.bar.unit = "point"
    run.bar.set_description_str("timing again the narrow wins over eager", False)
    start, done, changed = time.monotonic(), 0, 0
    for _, e, p in found:
        if time.monotonic() - start > deadline_s:
            break
        got = _time_again(run, e, p)
        run.bar.update()
        if got is None:
            continue
        winner = rank(p["ms"])[0]
        p["first_ms"], p["ms"] = p["ms"], got
        done += 1
        changed += rank(got)[0] != winner
        for member in _sharing(run, e):
            for q in member["points"]:
                if q["m"] == p["m"] and "first_ms" not in q:
                    q["first_ms"], q["ms"] = q["ms"], {n: t for n, t in got.items() if n in q["ms"]}
    for e in run.entries.values():
        if any("first_ms" in p for p in e["points"]):
            e["segments"] = fit(e["points"]) or e["segments"]
            if e["activation"] != e["measured_as"] and _probes(e) != checks[id(e)]:
                e["parity_checked"] = False
    return {
        "points": len(found),
        "timed_again": done,
        "winner_changed": changed,
        "seconds": round(time.monotonic() - start, 1),
    }


def _probes(e: dict) -> list[tuple[str, int]]:
    """Where ``check_member`` checks a member: each run's winner at the run's largest M."""
    return [(rank(r[-1]["ms"])[0], r[-1]["m"]) for r in runs(e["points"])]


def _sharing(run: Run, rep: dict) -> list[dict]:
    """The member entries that share ``rep``'s timings."""
    key = (rep["op"], rep["dtype"], rep["mode"], rep["dropout"], rep["features"])
    return [
        e
        for e in run.entries.values()
        if e["measured_as"] == rep["activation"] != e["activation"]
        and (e["op"], e["dtype"], e["mode"], e["dropout"], e["features"]) == key
    ]


def confirm(run: Run, doc: dict, deadline_s: float) -> Optional[dict]:
    """Times again (``_time_again``) each held-out point where the table's pick missed by the first
    timings (``calibrate_report.suspect``), and stores the result as the point's ``confirmed_ms``.
    Why: a point's fastest backend is the minimum of noisy numbers, so near-ties between backends that
    run the same kernels read as regrets of 10-20% at host-bound sizes in an H200 self-check). The
    first timings stay, and the self-check reports both. Points are taken worst first, until
    ``deadline_s`` has passed."""
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
        got = _time_again(run, e, pt)
        if got is not None:
            pt["confirmed_ms"] = got
            done += 1
        run.bar.update()
    return {"points": len(found), "timed_again": done, "seconds": round(time.monotonic() - start, 1)}
