"""python -m dispatch.calibrate.refit: a calibration's raw points fitted again by today's rule, no timing.

For a change of the decision rule (``plan.fit``, ``plan.smooth_host``), the measured points of a full
run are fitted again instead of measured again: on a GPU each series' host costs become the series'
medians (the clock's readings stay under ``host_us_measured``), the segments are refitted, and the
self-check runs on the held-out points. A backend wins a segment only where it passed a parity check
somewhere in its entry (``err``) or is eager, the reference: the calibrator checked only the winners it
found, and a new winner would be unchecked. The document notes the refit under ``settings.refit``.

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
from dispatch.calibrate.plan import BASELINE, fit, smooth_host


def refit(doc: dict) -> dict:
    """``doc`` (a schema-2 calibration with raw points) with its segments and self-check refitted."""
    gpu = doc["device"].get("type") == "cuda"
    for e in doc["entries"]:
        if "points" not in e:
            raise ValueError("the document keeps no raw points (a slim table): refit its raw_points file")
        if gpu:
            smooth_host(e["points"] + e.get("held_out", []))
        checked = {n for p in e["points"] for n in p.get("err", {})} | {"eager", BASELINE}
        points = [
            {**p, **{k: {n: v for n, v in p[k].items() if n in checked} for k in ("gpu_us", "host_us")}}
            for p in e["points"]
        ]
        e["segments"] = fit(points)
    doc["settings"]["refit"] = {
        "date": datetime.date.today().isoformat(),
        "rule": "host cost = the series' median (plan.smooth_host); segments by plan.fit" if gpu else "plan.fit",
    }
    doc["self_check"] = report.self_check(doc)
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dispatch.calibrate.refit", description=__doc__.split("\n")[0])
    p.add_argument("raw", help="a calibration document with raw points (calibrate --out)")
    p.add_argument("--out", help="where the refitted document goes (default: over RAW)")
    p.add_argument("--slim-out", help="also write the table without its raw points")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
