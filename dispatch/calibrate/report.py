"""The end of ``python -m dispatch.calibrate``: the self-check on held-out points and where the time went.

The self-check asks the written table for its pick at each held-out point (one token count per series
that the fit never saw) and compares it with the timings there, twice: by the rule's cost
(max(gpu_us, host_us)) and, for its pick under CUDA-graph capture, by GPU time alone.
"""

from __future__ import annotations

from typing import Optional

import torch

from dispatch import heuristics, select
from dispatch.cases import Case
from dispatch.calibrate.plan import BASELINE, costs, estimated

TARGETS = {"within_5pct": 0.95, "worst_regret": 0.10, "worst_vs_pytorch": 0.03}
WITHIN = 0.05


def case_of(e: dict, m: int) -> Case:
    """The case of a table entry at M = m (on the CPU: only the key matters for a lookup)."""
    dtype = getattr(torch, e["dtype"])
    return Case(
        e["op"],
        dtype,
        e["activation"],
        e["mode"] == "training",
        e["dropout"],
        m,
        tuple(e["features"]),
        torch.device("cpu"),
    )


def picks(doc: dict) -> list[tuple[dict, dict, Optional[str], Optional[str]]]:
    """(entry, held-out point, the table's pick there, its pick for a call captured in a CUDA graph)
    for every held-out point with timings."""
    table = heuristics.Table(doc, "<calibration>")
    out = []
    for e in doc["entries"]:
        for pt in e.get("held_out", []):
            if costs(pt):
                choice = table.choose(case_of(e, pt["m"]).call())
                pick = choice.backend if choice else None
                captured = select.capture_pick(choice, {})[0] if choice else None  # measured: it serves
                out.append((e, pt, pick, captured.name if captured is not None else pick))
    return out


AGREE_M = tuple(4**i for i in range(9))  # 1 .. 65536: the choice tables' token counts, every other one


def agreement(a: dict, b: dict) -> tuple[float, int]:
    """The share of cells (each entry both documents have, at each of AGREE_M) where their tables pick
    the same backend, and the number of cells."""
    ta, tb = heuristics.Table(a, "<a>"), heuristics.Table(b, "<b>")
    keys = {(e["op"], e["dtype"], e["activation"], e["mode"], e["dropout"], tuple(e["features"])): e for e in a["entries"]}
    cells = same = 0
    for e in b["entries"]:
        if (e["op"], e["dtype"], e["activation"], e["mode"], e["dropout"], tuple(e["features"])) not in keys:
            continue
        for m in AGREE_M:
            call = case_of(e, m).call()
            ca, cb = ta.choose(call), tb.choose(call)
            cells += 1
            same += (ca and ca.backend) == (cb and cb.backend)
    return (same / cells if cells else 0.0), cells


def _stats(found: list[tuple[dict[str, float], Optional[float], Optional[str]]]) -> dict:
    """Over (each backend's time, the baseline's, the pick): the share within 5% of the fastest, the
    worst regret, the worst slowdown against plain PyTorch."""
    regrets, vs_base, missing = [], [], 0
    for t, base, chosen in found:
        if chosen not in t:
            missing += 1  # the pick failed its check here or could not run
            continue
        regrets.append(t[chosen] / min(t.values()) - 1)
        if base:
            vs_base.append(t[chosen] / base - 1)
    n = len(regrets) + missing
    return {
        "points": n,
        "within_5pct": round(sum(r <= WITHIN for r in regrets) / n, 4) if n else None,
        "worst_regret": round(max(regrets), 4) if regrets else None,
        "worst_vs_pytorch": round(max(vs_base), 4) if vs_base else None,
        "pick_not_runnable": missing,
    }


def self_check(doc: dict) -> dict:
    """The table's picks on the held-out points against TARGETS, by cost and, with the pick for calls
    captured in a CUDA graph, by GPU time alone."""
    found = picks(doc)
    by_cost = [
        (costs(pt), max(pt["gpu_us"].get(BASELINE, 0), pt["host_us"].get(BASELINE, 0)), c)
        for _, pt, c, _ in found
    ]
    # GPU time alone: an untimed hopeless entry's estimate is no GPU time (it holds the host's), so a
    # point whose pick was estimated is left out, and estimated others are not the fastest
    by_gpu = []
    for _, pt, _, c in found:
        guessed = estimated(pt)
        if c not in guessed:
            by_gpu.append(({n: pt["gpu_us"][n] for n in costs(pt) if n not in guessed}, pt["gpu_us"].get(BASELINE), c))
    result = _stats(by_cost)
    result["by_gpu_time"] = _stats(by_gpu)
    result["targets"] = TARGETS
    result["meets_targets"] = bool(
        result["points"]
        and not result["pick_not_runnable"]
        and result["within_5pct"] >= TARGETS["within_5pct"]
        and result["worst_regret"] <= TARGETS["worst_regret"]
        and (result["worst_vs_pytorch"] or 0) <= TARGETS["worst_vs_pytorch"]
    )
    return result


def _line(r: dict) -> str:
    return (
        f"{r['within_5pct']:.0%} within 5% of the fastest, worst regret {r['worst_regret'] or 0:+.1%}, "
        f"worst vs plain PyTorch {r['worst_vs_pytorch'] or 0:+.1%}, pick unrunnable at {r['pick_not_runnable']}"
    )


def format_self_check(r: dict) -> str:
    if not r["points"]:
        return "self-check: no held-out points were measured"
    t = r["targets"]
    verdict = "PASS" if r["meets_targets"] else "MISS"
    return (
        f"self-check on {r['points']} held-out points, by max(GPU, host): {_line(r)}: {verdict} (targets "
        f">= {t['within_5pct']:.0%}, <= {t['worst_regret']:+.0%}, <= {t['worst_vs_pytorch']:+.0%})\n"
        f"  by GPU time alone: {_line(r['by_gpu_time'])}"
    )


def format_costs(settings: dict) -> str:
    """Where the time went: compiling ahead, each family's share, each backend's timing and checks."""
    parts = []
    w = settings.get("warm_up")
    if w:
        by = ", ".join(f"{n} {t:.0f}" for n, t in w["worker_seconds"].items())
        parts.append(
            f"compiling ahead {w['seconds']:.0f} s ({w['calls']} calls in {w['workers']} processes; {by})"
        )
    fams = settings.get("families", {})
    if fams:
        parts.append("families (spent/allotted s, series left): " + ", ".join(
            f"{k} {v['spent_s']:.0f}/{v['allotted_s']:.0f} {v['series_left']}" for k, v in fams.items()))  # fmt: skip
    by = settings.get("seconds_by_backend", {})
    if by:
        parts.append(
            "backends (timing and checks, first calls included): "
            + ", ".join(f"{n} {t:.0f} s" for n, t in by.items())
        )
    for what, why in settings.get("graph_capture_failed", {}).items():
        parts.append(f"no CUDA graph for {what} (timed by do_bench): {why}")
    return "time spent: " + "\n  ".join(parts) if parts else ""
