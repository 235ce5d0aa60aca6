"""The end of ``python -m dispatch.calibrate``: the self-check on held-out points against the
calibrator's targets (TARGETS), and the lines that report it and where the time went."""

from __future__ import annotations

import torch

from dispatch import heuristics
from dispatch import calibrate_bench as bench

TARGETS = {"within_5pct": 0.95, "worst_regret": 0.15, "worst_vs_eager": 0.03}
WITHIN = 0.05  # the self-check's "within 5% of the fastest"


def picks(doc: dict) -> list[tuple[dict, dict, str]]:
    """Every held-out point with a timing: (its entry or held-out-size record, the point, the
    backend the table picks there)."""
    table = heuristics.Table(doc, "<calibration>")
    held = [(e, pt) for e in doc["entries"] for pt in e["held_out"]]
    held += [(h, h["point"]) for h in doc.get("held_out_sizes", [])]  # at feature sizes not measured
    out = []
    for e, pt in held:
        if pt["ms"]:
            call = bench.Case.of_entry(e, pt["m"], torch.device("cpu")).call()
            out.append((e, pt, table.choose(call).backend))
    return out


def suspect(pt: dict, chosen: str) -> bool:
    """Whether the pick at this point misses by the first timings (more than 5% off the fastest or
    more than 3% behind eager): ``calibrate_checks.confirm`` times those again."""
    ms = pt["ms"]
    if chosen not in ms:
        return False
    over_eager = "eager" in ms and ms[chosen] > ms["eager"] * (1 + TARGETS["worst_vs_eager"])
    return ms[chosen] > min(ms.values()) * (1 + WITHIN) or over_eager


def _stats(points: list[tuple[dict, str]]) -> dict:
    regrets, vs_eager, missing = [], [], 0
    for ms, chosen in points:
        if chosen not in ms:
            missing += 1  # the table's pick failed parity or could not run at this point
            continue
        regrets.append(ms[chosen] / min(ms.values()) - 1)
        if "eager" in ms:
            vs_eager.append(ms[chosen] / ms["eager"] - 1)
    n = len(regrets) + missing
    return {
        "points": n,
        "within_5pct": round(sum(r <= WITHIN for r in regrets) / n, 4) if n else None,
        "worst_regret": round(max(regrets), 4) if regrets else None,
        "worst_vs_eager": round(max(vs_eager), 4) if vs_eager else None,
        "pick_not_runnable": missing,
    }


def self_check(doc: dict) -> dict:
    """On the held-out points: the share of calls whose chosen backend is within 5% of the fastest, the
    worst regret, and the worst slowdown against eager (TARGETS: 95%, 15%, 3%).

    A point whose first timings made the pick miss was timed again, all its backends side by side in
    more rounds (``confirmed_ms``, see ``calibrate_checks.confirm``): its fastest backend was picked by
    the minimum of noisy numbers, which flatters the winner. The verdict uses the confirmed timings
    where there are any; ``first_timings`` keeps what the first ones alone say."""
    found = picks(doc)
    result = _stats([(pt.get("confirmed_ms") or pt["ms"], chosen) for _, pt, chosen in found])
    result["confirmed_points"] = sum("confirmed_ms" in pt for _, pt, _ in found)
    result["first_timings"] = _stats([(pt["ms"], chosen) for _, pt, chosen in found])
    result["targets"] = TARGETS
    result["meets_targets"] = (
        bool(result["points"])
        and not result["pick_not_runnable"]
        and result["within_5pct"] >= TARGETS["within_5pct"]
        and result["worst_regret"] <= TARGETS["worst_regret"]
        and (result["worst_vs_eager"] or 0) <= TARGETS["worst_vs_eager"]
    )
    return result


def _by_backend(summary: dict) -> str:
    """"; worker seconds <backend> <s>, ..." of a worker phase's summary, or nothing."""
    by = ", ".join(f"{n} {t:.0f}" for n, t in summary.get("worker_seconds", {}).items())
    return f"; worker seconds {by}" if by else ""


def format_costs(settings: dict) -> str:
    """Where the time went: the warm-up, the checks in worker processes, then per backend its parity
    checks and its timing in this one."""
    parts = []
    w = settings.get("warm_up")
    if w:
        parts.append(
            f"compiling ahead {w['seconds']:.0f} s ({w['calls']} calls in {w['workers']} processes"
            f"{_by_backend(w)})"
        )
    c = settings.get("parallel_checks")
    if c:
        left = f", {c['unfinished']} left to this process" if c["unfinished"] else ""
        parts.append(
            f"parity checks {c['seconds']:.0f} s ({c['points']} points in {c['workers']} processes"
            f"{left}{_by_backend(c)})"
        )
    c = settings.get("parallel_member_checks")
    if c:
        parts.append(
            f"member checks {c['seconds']:.0f} s ({c['points']} segments in {c['workers']} processes"
            f"{_by_backend(c)})"
        )
    c = settings.get("narrow_wins_timed_again")
    if c:
        parts.append(
            f"timing again {c['timed_again']} of {c['points']} narrow wins over eager {c['seconds']:.0f} s "
            f"({c['winner_changed']} changed winner)"
        )
    c = settings.get("timed_again")
    if c:
        parts.append(f"timing again {c['timed_again']} of {c['points']} missed picks {c['seconds']:.0f} s")
    for name, c in settings.get("seconds_by_backend", {}).items():
        parts.append(f"{name} {c['check']:.0f} s checking + {c['time']:.0f} s timing")
    return "time spent: " + "; ".join(parts) if parts else ""


def format_self_check(r: dict) -> str:
    if not r["points"]:
        return "self-check: no held-out points were measured"
    t = r["targets"]
    verdict = "PASS" if r["meets_targets"] else "MISS"
    return (
        f"self-check on {r['points']} held-out points: {r['within_5pct']:.0%} within 5% of the fastest "
        f"(target >= {t['within_5pct']:.0%}), worst regret {r['worst_regret'] or 0:+.1%} "
        f"(target <= {t['worst_regret']:.0%}), worst vs eager {r['worst_vs_eager'] or 0:+.1%} "
        f"(target <= {t['worst_vs_eager']:+.0%}), "
        f"table's pick unrunnable at {r['pick_not_runnable']} of them: "
        f"{verdict}"
        + _first(r)
    )


def _first(r: dict) -> str:
    """What the first timings alone said, where some points were timed again."""
    f = r.get("first_timings")
    if not r.get("confirmed_points") or not f:
        return ""
    return (
        f"\n  ({r['confirmed_points']} points whose pick missed by their first timings were timed again; "
        f"the first timings alone: {f['within_5pct']:.0%} within 5%, worst regret "
        f"{f['worst_regret'] or 0:+.1%}, worst vs eager {f['worst_vs_eager'] or 0:+.1%})"
    )
