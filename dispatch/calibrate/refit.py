"""python -m dispatch.calibrate.refit: a calibration's raw points fitted again by today's rule, no timing.

For a change of the decision rule (``plan.fit``, ``plan.pool_host``), the measured points of a full
run are fitted again instead of measured again: on a GPU each point's host costs become its family's
medians (the clock's readings stay under ``host_us_measured``), the segments are refitted, and the
self-check runs on the held-out points; ``python -m dispatch.calibrate`` ends with the same fit. A backend
wins a segment only where it passed a parity check somewhere in its entry (``err``) or is eager, the
reference: the calibrator checked only the winners it found, and a new winner would be unchecked. The
document notes the refit under ``settings.refit``. ``--agree OTHER`` prints the share of choice cells
(every entry at M = 1, 4, ..., 65536) on which the refitted table and OTHER, refitted too, agree.

    python -m dispatch.calibrate.refit benchmarks/results/calibrate_points-nvidia-h200.json \\
        --slim-out heuristics/tables/nvidia-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Optional, Sequence

from dispatch import heuristics
from dispatch.calibrate import report
from dispatch.calibrate.plan import (
    BASELINE, NOISE, PREFERENCE, PREFERENCE_INFERENCE, fit, pool_host, preference,
)  # fmt: skip

RULE_GPU = "host cost = the family's median (plan.pool_host); segments by plan.fit"


def refit_entries(entries: list[dict], gpu: bool) -> None:
    """Each entry's segments fitted again from its points, in place: on a GPU with its family's host
    costs (``plan.pool_host``). A winner must have passed its parity check in the entry, or be eager."""
    if any("points" not in e for e in entries):
        raise ValueError("the document keeps no raw points (a slim table): refit its raw_points file")
    if gpu:
        pool_host(entries)
    for e in entries:
        checked = {n for p in e["points"] for n in p.get("err", {})} | {"eager", BASELINE}
        points = [
            {**p, **{k: {n: v for n, v in p[k].items() if n in checked} for k in ("gpu_us", "host_us")}}
            for p in e["points"]
        ]
        e["segments"] = fit(points, preference(e["mode"]))


def refit(doc: dict) -> dict:
    """``doc`` (a schema-2 calibration with raw points) with its segments and self-check refitted."""
    gpu = doc["device"].get("type") == "cuda"
    refit_entries(doc["entries"], gpu)
    doc["settings"].update(
        noise=NOISE, preference=list(PREFERENCE), preference_inference=list(PREFERENCE_INFERENCE)
    )
    doc["settings"]["refit"] = {"date": datetime.date.today().isoformat(), "rule": RULE_GPU if gpu else "plan.fit"}
    doc["self_check"] = report.self_check(doc)
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dispatch.calibrate.refit", description=__doc__.split("\n")[0])
    p.add_argument("raw", help="a calibration document with raw points (calibrate --out)")
    p.add_argument("--out", help="where the refitted document goes (default: over RAW)")
    p.add_argument("--slim-out", help="also write the table without its raw points")
    p.add_argument("--agree", help="another calibration of the same GPU: the share of choice cells both agree on")
    args = p.parse_args(argv)
    table = heuristics.load_table(args.raw)
    if table is None or table.data.get("schema_version") != heuristics.SCHEMA_VERSION:
        print(f"{args.raw}: not a schema {heuristics.SCHEMA_VERSION} calibration document", file=sys.stderr)
        return 1
    out = args.out or args.raw
    try:
        doc = refit(table.data)
    except ValueError as exc:
        print(f"{args.raw}: {exc}", file=sys.stderr)
        return 1
    heuristics.save_table(doc, out)
    if args.slim_out:
        heuristics.save_table(heuristics.slim(doc, out), args.slim_out)
    print(report.format_self_check(doc["self_check"]))
    if args.agree:
        other = heuristics.load_table(args.agree)
        if other is None:
            return 1
        share, cells = report.agreement(doc, refit(other.data))
        print(f"choice cells agreeing with {args.agree} (refitted): {share:.1%} of {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
