"""The end of ``python -m dispatch.calibrate``: the self-check on held-out points against the issue's
targets, and the lines that report it and where the time went."""

from __future__ import annotations

import torch

import heuristics
from dispatch import calibrate_bench as bench

TARGETS = {"within_5pct": 0.95, "worst_regret": 0.15, "worst_vs_eager": 0.03}


def self_check(doc: dict) -> dict:
    """On the held-out points: the share of calls whose chosen backend is within 5% of the fastest, the
    worst regret, and the worst slowdown against eager (the issue's targets: 95%, 15%, 3%)."""
    table = heuristics.Table(doc, "<calibration>")
    regrets, vs_eager, missing = [], [], 0
    held = [(e, pt) for e in doc["entries"] for pt in e["held_out"]]
    held += [(h, h["point"]) for h in doc.get("held_out_sizes", [])]  # at feature sizes not measured
    for e, pt in held:
        if not pt["ms"]:
            continue
        call = bench.Case.of_entry(e, pt["m"], torch.device("cpu")).call()
        chosen = table.choose(call).backend
        if chosen not in pt["ms"]:
            missing += 1  # the table's pick failed parity or could not run at this point
            continue
        best = min(pt["ms"].values())
        regrets.append(pt["ms"][chosen] / best - 1)
        if "eager" in pt["ms"]:
            vs_eager.append(pt["ms"][chosen] / pt["ms"]["eager"] - 1)
    n = len(regrets) + missing
    result = {
        "points": n,
        "within_5pct": round(sum(r <= 0.05 for r in regrets) / n, 4) if n else None,
        "worst_regret": round(max(regrets), 4) if regrets else None,
        "worst_vs_eager": round(max(vs_eager), 4) if vs_eager else None,
        "pick_not_runnable": missing,
        "targets": TARGETS,
    }
    result["meets_targets"] = (
        bool(n)
        and not missing
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
    )
