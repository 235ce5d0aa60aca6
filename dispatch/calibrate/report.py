"""The end of a calibration: the document written, the self-check on held-out points, where the time
went, and the refit.

The self-check asks the written table for its pick at each held-out point (one token count per series
the fit never saw) and scores it against the timings there, by the rule's cost (max(gpu_us, host_us))
and, for the pick under CUDA-graph capture, by GPU time alone. The refit (``--refit RAW``) fits a
calibration's measured points again by the current rule, measuring nothing.
"""

from __future__ import annotations

import datetime
import platform
import sys
from typing import Optional

from dispatch import heuristics, select
from dispatch.calibrate.plan import (
    BASELINE, NOISE, PREFERENCE, PREFERENCE_INFERENCE, Plan, costs, estimated, fit, pool_host, preference,
    runs,
)  # fmt: skip
from dispatch.cases import P_DROPOUT
from dispatch.contracts.backend import Call
from dispatch.heuristics.schema import (
    DeviceInfo, Document, EntryKey, EntryRecord, Point, SelfCheck, variant_of,
)  # fmt: skip
from dispatch.registry import backends

TARGETS = {"within_5pct": 0.95, "worst_regret": 0.10, "worst_vs_pytorch": 0.03}
WITHIN = 0.05
AGREE_M = tuple(4**i for i in range(9))  # 1 .. 65536: every other token count of the choice tables
NOT_CHECKED = "refit: no parity check passed in this entry"


def document(entries: list[EntryRecord], info: DeviceInfo, plan: Plan, progress: dict) -> Document:
    """A calibration's document: ``entries``, the device ``info``, the rule and timers, and the run's
    ``progress`` (budget, families, seconds...) in its settings."""
    def order(e: EntryRecord) -> tuple:
        return e["op"], e["dtype"], e["mode"], e.get("dropout", False), str(variant_of(e)), e["features"]

    entries = sorted(entries, key=order)
    gpu = plan.device.type == "cuda"
    settings = {
        "quick": plan.quick, "noise": NOISE, "preference": list(PREFERENCE),
        "preference_inference": list(PREFERENCE_INFERENCE), "p_dropout": P_DROPOUT,
        "rule": "cost = max(gpu_us, host_us); ties within noise go to preference "
                "(preference_inference without autograd)",
        "baseline": f"{BASELINE}: the composite a user writes (F.dropout(act(x + b), p), "
                    "act(F.linear(x, w, b)), the MLP block), called directly; a contender, first in the ties",
        "timer": "gpu_us: triton.testing.do_bench_cudagraph (events at >= 5 ms); host_us: perf_counter "
                 "behind torch.cuda._sleep" if gpu else "gpu_us = host_us = perf_counter (no GPU clock)",
        **progress,
    }  # fmt: skip
    served = {n for e in entries for p in e["points"] for n in p["gpu_us"]}
    return {
        "schema_version": heuristics.SCHEMA_VERSION, "device": info,
        "versions": {**heuristics.running_versions(), "python": platform.python_version()},
        "date": datetime.date.today().isoformat(), "settings": settings,
        "backends": {n: b.display_name() for n, b in sorted(backends().items()) if n in served},
        "entries": entries,
    }  # fmt: skip


def call_of(e: EntryRecord, m: int) -> Call:
    """A call of a table entry's key at M = m (on the CPU: only the key matters for a lookup)."""
    return EntryKey.of_entry(e).call((m, *e["features"]))


def picks(doc: Document) -> list[tuple[EntryRecord, Point, Optional[str], Optional[str]]]:
    """(entry, held-out point, the table's pick there, its pick under capture) at each timed held-out M."""
    table = heuristics.Table(doc, "<calibration>")
    out = []
    for e in doc["entries"]:
        for pt in e.get("held_out", []):
            if costs(pt):
                choice = table.choose(call_of(e, pt["m"]))
                pick = choice.backend if choice else None
                captured = select.capture_pick(choice, {})[0] if choice else None
                out.append((e, pt, pick, captured.name if captured is not None else pick))
    return out


def agreement(a: Document, b: Document) -> tuple[float, int]:
    """The share of cells (entries both documents have, at each of AGREE_M) where both pick alike."""
    ta, tb = heuristics.Table(a, "<a>"), heuristics.Table(b, "<b>")
    keys = {heuristics.EntryId.of_entry(e) for e in a["entries"]}
    cells = same = 0
    for e in b["entries"]:
        if heuristics.EntryId.of_entry(e) in keys:
            for m in AGREE_M:
                ca, cb = ta.choose(call_of(e, m)), tb.choose(call_of(e, m))
                cells += 1
                same += (ca and ca.backend) == (cb and cb.backend)
    return (same / cells if cells else 0.0), cells


def _stats(found: list[tuple[dict[str, float], Optional[float], Optional[str]]]) -> SelfCheck:
    """Over (each backend's time, the baseline's, the pick): the share within 5% of the fastest, the worst
    regret, the worst slowdown against plain PyTorch."""
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
        "points": n, "within_5pct": round(sum(r <= WITHIN for r in regrets) / n, 4) if n else None,
        "worst_regret": round(max(regrets), 4) if regrets else None,
        "worst_vs_pytorch": round(max(vs_base), 4) if vs_base else None, "pick_not_runnable": missing,
    }  # fmt: skip


def self_check(doc: Document) -> SelfCheck:
    """The table's picks on the held-out points against TARGETS, by cost and, on a GPU, (the pick under
    capture) by GPU time alone, where an untimed hopeless entry's estimate is no GPU time: left out. On a
    CPU there is no capture and no GPU clock (both clocks are the wall time): no second score."""
    found = picks(doc)
    base = lambda pt: max(pt["gpu_us"].get(BASELINE, 0), pt["host_us"].get(BASELINE, 0))  # noqa: E731
    by_cost = [(costs(pt), base(pt), c) for _, pt, c, _ in found]
    by_gpu = [
        ({n: pt["gpu_us"][n] for n in costs(pt) if n not in estimated(pt)}, pt["gpu_us"].get(BASELINE), c)
        for _, pt, _, c in found
        if c not in estimated(pt)
    ]
    gpu = doc["device"].get("type") == "cuda"
    r: SelfCheck = {**_stats(by_cost), "by_gpu_time": _stats(by_gpu) if gpu else None, "targets": TARGETS}
    r["meets_targets"] = bool(r["points"]) and all(ok for _, _, _, ok in verdicts(r))
    return r


def verdicts(r: SelfCheck) -> list[tuple[str, str, str, bool]]:
    """(what, measured, target, met) for each target of a self-check ``r`` with points."""
    t = r["targets"]
    within, regret, vs = r["within_5pct"] or 0.0, r["worst_regret"], r["worst_vs_pytorch"]
    return [
        (f"within {WITHIN:.0%} of the fastest", f"{within:.0%}", f">= {t['within_5pct']:.0%}",
         within >= t["within_5pct"]),
        ("worst regret", "-" if regret is None else f"{regret:+.1%}", f"<= {t['worst_regret']:+.0%}",
         regret is not None and regret <= t["worst_regret"]),
        ("worst vs plain PyTorch", "-" if vs is None else f"{vs:+.1%}", f"<= {t['worst_vs_pytorch']:+.0%}",
         (vs or 0) <= t["worst_vs_pytorch"]),
        ("picks that could not run", f"{r['pick_not_runnable']}", "0", not r["pick_not_runnable"]),
    ]  # fmt: skip


def _line(r: SelfCheck) -> str:
    regret, vs = r["worst_regret"] or 0, r["worst_vs_pytorch"] or 0
    return (
        f"{r['within_5pct']:.0%} within {WITHIN:.0%} of the fastest, worst regret {regret:+.1%}, "
        f"worst vs plain PyTorch {vs:+.1%}, {r['pick_not_runnable']} picks could not run"
    )


def format_self_check(r: SelfCheck, gpu: bool = True) -> str:
    """The self-check, one line per target with its own verdict; ``gpu``: scored by max(GPU time, host
    cost), with the capture's pick by GPU time alone below (no target); else by wall time."""
    if not r["points"]:
        return "self-check: no held-out points were measured"
    clock = "max(GPU time, host cost)" if gpu else "wall time"
    verdict = "PASS" if r["meets_targets"] else "MISS"
    lines = [f"self-check on {r['points']} held-out points, by {clock}: {verdict}"]
    for what, measured, target, ok in verdicts(r):
        lines.append(f"  {what}: {measured} (target {target}) {'ok' if ok else 'MISS'}")
    if r.get("by_gpu_time"):
        lines.append(f"  the pick under capture, by GPU time alone (no target): {_line(r['by_gpu_time'])}")
    return "\n".join(lines)


def format_costs(settings: dict) -> str:
    """Where the time went: compiling ahead, each family, each backend's timing and checks."""
    parts = []
    w = settings.get("warm_up")
    if w:
        by = ", ".join(f"{n} {t:.0f}" for n, t in w["worker_seconds"].items())
        calls = f"{w['calls']} calls in {w['workers']} processes"
        parts.append(f"compiling ahead {w['seconds']:.0f} s ({calls}; {by})")
    fams = settings.get("families", {})
    if fams:
        left = lambda v: f" ({v['series_left']} series left)" if v["series_left"] else ""  # noqa: E731
        spent = ", ".join(f"{k} {v['spent_s']:.0f}{left(v)}" for k, v in fams.items())
        parts.append(f"families (s): {spent}")
    by = settings.get("seconds_by_backend", {})
    if by:
        timed = ", ".join(f"{n} {t:.0f} s" for n, t in by.items())
        parts.append(f"backends (timing and checks, first calls included): {timed}")
    for what, why in settings.get("graph_capture_failed", {}).items():
        parts.append(f"no CUDA graph for {what} (timed by do_bench): {why}")
    return "time spent: " + "\n  ".join(parts) if parts else ""


def refit_entries(entries: list[EntryRecord], gpu: bool) -> None:
    """Each entry's segments fitted again from its points, in place (on a GPU with its family's host costs,
    ``plan.pool_host``). A winner, by cost or by GPU time alone, must have passed its parity check in the
    entry, or be eager: one that has not is rejected at every point of the entry (its timings kept: plain
    PyTorch stays the speedups' floor) and the fit is redone; one that wins nowhere may be a runner-up."""
    if any("points" not in e for e in entries):
        raise ValueError("the document keeps no raw points (a slim table): refit its raw_points file")
    if gpu:
        pool_host(entries)
    for e in entries:
        checked = {n for p in e["points"] for n in p.get("err", {})} | {"eager"}
        order = preference(e["mode"])
        points: list[Point] = [{**p, "rejected": dict(p.get("rejected", {}))} for p in e["points"]]
        while True:
            won = {n for n, _ in runs(points, order=order) + runs(points, order=order, by_gpu=True)} - checked
            if not won:
                break
            for p in points:
                p["rejected"].update({n: NOT_CHECKED for n in won if n in p["gpu_us"]})
        e["segments"] = fit(points, order)


def refit(doc: Document) -> Document:
    """``doc`` (a schema-2 calibration with raw points) with its segments and self-check refitted."""
    gpu = doc["device"].get("type") == "cuda"
    refit_entries(doc["entries"], gpu)
    prefer = {"preference": list(PREFERENCE), "preference_inference": list(PREFERENCE_INFERENCE)}
    doc["settings"].update(noise=NOISE, **prefer)
    rule = "host cost = the family's median (plan.pool_host); segments by plan.fit" if gpu else "plan.fit"
    doc["settings"]["refit"] = {"date": datetime.date.today().isoformat(), "rule": rule}
    doc["self_check"] = self_check(doc)
    return doc


def refit_main(raw: str, out: Optional[str], slim_out: Optional[str], agree: Optional[str]) -> int:
    """``--refit RAW``: RAW's segments fitted again and written (over RAW unless ``out``); ``agree``: the
    share of choice cells on which it and another calibration, refitted too, agree."""
    table = heuristics.load_table(raw)
    if table is None or table.data.get("schema_version") != heuristics.SCHEMA_VERSION:
        print(f"{raw}: not a schema {heuristics.SCHEMA_VERSION} calibration document", file=sys.stderr)
        return 1
    try:
        doc = refit(table.data)
    except ValueError as exc:
        print(f"{raw}: {exc}", file=sys.stderr)
        return 1
    heuristics.save_table(doc, out or raw)
    if slim_out:
        heuristics.save_table(heuristics.slim(doc, out or raw), slim_out)
    print(format_self_check(doc["self_check"], doc["device"].get("type") == "cuda"))
    if agree:
        other = heuristics.load_table(agree)
        if other is None:
            return 1
        share, cells = agreement(doc, refit(other.data))
        print(f"choice cells agreeing with {agree} (refitted): {share:.1%} of {cells}")
    return 0
