"""python -m dispatch.table: print the backend-choice tables of a heuristics table.

Rows are token-count buckets M, columns feature sizes (the op's dims after M: N, or N,K for
fused_linear), each cell the backend lookup chooses there and its measured speedup over plain PyTorch
(the composite a user writes; schema 1 tables, which did not time it, over the eager backend).
Activations (an op's variant trait's values) whose cells are all equal share one table. ``--gpu`` takes
a device slug or name (nvidia-h200, "NVIDIA H200"), or a path.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import sys
from typing import Optional, Sequence

import torch
from tabulate import tabulate

from dispatch import heuristics, ops
from dispatch.contracts.shapes import TOKENS
from dispatch.heuristics.ranking import BASELINE, costs, preference, rank
from dispatch.heuristics.schema import DeviceInfo, EntryKey, EntryRecord, SegmentRecord, variant_of

LEGEND = (
    "cell: backend and its speedup over {base} measured at that M (~: at the nearest measured M where "
    "that backend was chosen; >: beyond the largest measured M, the last segment continues)"
)
HOST_LEGEND = "; h: host-bound there (the host's cost of a call exceeds its GPU time and decided)"
# a shipped table keeps no raw points (its raw_points file has them): a cell shows its segment's speedup
SLIM_LEGEND = "; >=: the smallest speedup measured in that segment (this table keeps no raw points)"


def _segment_at(entry: EntryRecord, m: int) -> SegmentRecord:
    segments = entry["segments"]
    return segments[max(bisect.bisect_right([s["m_from"] for s in segments], m) - 1, 0)]


def _speedup(entry: EntryRecord, m: int, backend: str, version: int) -> str:
    """' 1.85x' (schema 2: over plain PyTorch, 'h' where host-bound; schema 1: over eager)."""
    if "points" not in entry:
        seg = _segment_at(entry, m)
        host = "h" if seg.get("clock") == "host" else ""
        return f" >={seg['speedup']:.2f}x{host}" if seg["backend"] == backend and seg.get("speedup") else ""
    if version == 1:
        timed, has_base = (lambda p: p["ms"]), (lambda p: "eager" in p["ms"])
    else:
        timed, has_base = costs, (lambda p: BASELINE in p["gpu_us"] and BASELINE in p["host_us"])
    points = [p for p in entry["points"] if backend in timed(p) and has_base(p)]
    points = [p for p in points if rank(timed(p), preference(entry["mode"]))[0] == backend] or points
    if not points:
        return ""
    near = min(points, key=lambda p: abs(math.log(p["m"] / m)))
    near_mark = "" if near["m"] == m else "~"
    if version == 1:
        return f" {near_mark}{near['ms']['eager'] / near['ms'][backend]:.2f}x"
    base_cost = max(near["gpu_us"][BASELINE], near["host_us"][BASELINE])
    host = "h" if near["host_us"][backend] > near["gpu_us"][backend] else ""
    return f" {near_mark}{base_cost / costs(near)[backend]:.2f}x{host}"


def _grid(table: heuristics.Table, entries: list[EntryRecord]) -> tuple[list[str], list[list[str]]]:
    entries = sorted(entries, key=lambda e: e["features"])
    max_m = max(heuristics.max_measured_m(e) for e in entries)
    rows = []
    for m in [t for t in TOKENS if t <= max_m] + [t for t in TOKENS if t > max_m][:1]:
        row = [f"{'>' if m > max_m else ''}{m}"]
        for e in entries:
            choice = table.choose(EntryKey.of_entry(e).call((m, *e["features"])))
            row.append(f"{choice.backend}{_speedup(e, m, choice.backend, table.version)}" if choice else "-")
        rows.append(row)
    return ["M \\ " + ",".join(ops.get(entries[0]["op"]).dims[1:])] + [
        ",".join(map(str, e["features"])) for e in entries
    ], rows


def render(
    table: heuristics.Table,
    op: Optional[str] = None,
    dtype: Optional[str] = None,
    activation: Optional[str] = None,
    mode: Optional[str] = None,
) -> str:
    """Every choice table of ``table`` matching the filters, then the legend with its provenance."""
    families: dict[tuple, dict[Optional[str], list[EntryRecord]]] = {}
    for e in table.data["entries"]:
        if (
            (op or e["op"]) == e["op"]
            and (dtype or e["dtype"]) == e["dtype"]
            and activation in (None, variant_of(e))
            and (mode or e["mode"]) == e["mode"]
        ):
            fam = (e["op"], e["dtype"], e["mode"], e.get("dropout", False))
            families.setdefault(fam, {}).setdefault(variant_of(e), []).append(e)
    out = []
    for (fop, fdtype, fmode, fdrop), by_act in sorted(families.items()):
        shared: dict[str, tuple[list, list[str], list[list[str]]]] = {}
        for act, entries in by_act.items():
            headers, rows = _grid(table, entries)
            key = repr((headers, rows))
            shared.setdefault(key, ([], headers, rows))[0].append(act)
        variant = ops.get(fop).variant
        for acts, headers, rows in shared.values():
            measured = sorted(
                {
                    " ".join(filter(None, (e.get("measured_as", a), e.get("measured_dtype"))))
                    for a in acts
                    for e in by_act[a]
                }
                - {""}
            )
            title = f"{fop}  {fdtype}  {fmode}{'  dropout' if fdrop else ''}"
            title += f"  {variant} {', '.join(acts)}" if variant else ""
            timed = f"  (timed as {', '.join(measured)})" if measured else ""
            out += [f"{title}{timed}", tabulate(rows, headers=headers), ""]
    if not families:
        out.append("no entries match these filters")
    slim = any("points" not in e for e in table.data["entries"])
    legend = LEGEND.format(base="eager" if table.version == 1 else "plain PyTorch")
    legend += HOST_LEGEND if table.version >= 2 and not table.one_clock else ""
    legend += SLIM_LEGEND if slim else ""
    return "\n".join(out + [legend] + provenance(table))


def runs_of(settings: dict, date: Optional[str] = None) -> list[dict]:
    """A table's history (settings.runs: the run that started it, then its refreshes and the runs made
    over it); a table from before that history has its one run."""
    runs = [dict(r) for r in settings.get("runs") or []]
    kind = "quick" if settings.get("quick") else "full"
    return runs or [{"run": kind, "date": date, "elapsed_s": settings.get("elapsed_s", 0.0), "parts": 1}]


def _since(run: dict) -> str:
    return f"{', '.join(run.get('families') or ['?'])} ({run['elapsed_s']:.0f} s, {run.get('date')})"


def _history(settings: dict) -> str:
    """The table's runs in words: full run of 902 s in 2 parts; refreshed since: ..."""
    runs = runs_of(settings)
    first = runs[0]
    parts = f" in {first['parts']} parts" if first.get("parts", 1) > 1 else ""
    text = f"{first['run']} run of {first['elapsed_s']} s{parts}"
    refreshes = [_since(r) for r in runs[1:] if r["run"] == "refresh"]
    if refreshes:
        text += "; refreshed since: " + "; ".join(refreshes)
    # a plain run over an existing table measures its families again and keeps the other entries
    again = [f"{r['run']}: {_since(r)}" for r in runs[1:] if r["run"] != "refresh"]
    if again:
        text += "; measured again since by " + "; ".join(again)
    return text


def _device(d: DeviceInfo, one_clock: bool) -> str:
    """The device line: a GPU's properties; a CPU's model and the thread count it was timed with."""
    if d.get("type") == "cuda":
        cap = ".".join(map(str, d.get("capability") or [])) or "-"
        return (
            f"device: {d.get('name')} ({d.get('slug')}, cuda, capability {cap}, "
            f"{d.get('sm_count', '-')} SMs, copy bandwidth {d.get('measured_bandwidth_gbs') or '-'} GB/s)"
        )
    threads = d.get("threads")
    timed = f", timed with {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    clock = ", wall time (one clock)" if one_clock else ""
    return f"device: {d.get('name')} ({d.get('slug')}, {d.get('type')}{timed}{clock})"


def provenance(table: heuristics.Table) -> list[str]:
    """Where a table comes from: device, versions, date, run settings, backends, self-check."""
    v, s = table.data.get("versions", {}), table.data.get("settings", {})
    run = _history(s)
    stopped = ", stopped by its budget" if s.get("stopped_by_budget") else ""
    versions = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "cuda") if v.get(k))
    rule = f"ties within {s.get('noise', 0):.0%} go to {' > '.join(s.get('preference', []))}"
    if s.get("preference_inference"):
        rule += f" ({' > '.join(s['preference_inference'])} without autograd)"
    if table.version >= 2:
        rule = f"{table.rule} wins; {rule}"
    lines = [
        f"table: {table.path}",
        _device(table.device, table.one_clock),
        f"calibrated {table.data.get('date')} with {versions or 'unrecorded versions'}; {run}{stopped}",
        f"{rule}; backends timed: {', '.join(table.data.get('backends', {}).values())}",
    ]
    if table.data.get("raw_points"):
        lines.append(f"raw measured points: {table.data['raw_points']['file']}")
    check = table.data.get("self_check") or {}
    if check.get("points"):
        base, against = ("eager", "eager") if table.version == 1 else ("pytorch", "plain PyTorch")
        lines.append(
            f"self-check: {check['within_5pct']:.0%} of {check['points']} held-out points within 5% of the "
            f"fastest, worst regret {check['worst_regret'] or 0:+.1%}, "
            f"worst vs {against} {check[f'worst_vs_{base}'] or 0:+.1%}"
            + (
                f" ({check['confirmed_points']} missed picks timed again)"
                if check.get("confirmed_points")
                else ""
            )
        )
    return lines


def find(gpu: Optional[str]) -> Optional[heuristics.Table]:
    """The table for a path, a slug or a device name; the table serving this machine's device (its own,
    else the nearest, as lookups use) when ``gpu`` is None."""
    if gpu and os.path.isfile(gpu):
        return heuristics.load_table(gpu)
    if gpu is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return heuristics.table_for(device)[0]
    slug = heuristics.slugify(gpu)
    return next((t for t in heuristics.all_tables() if t.slug == slug), None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dispatch.table", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", help="device slug or name, or a table's path (default: this machine's device)")
    p.add_argument("--op", choices=ops.names())
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    every = {a for s in ops.all_specs() for a in s.variants() if a is not None}
    p.add_argument("--activation", choices=sorted(every), help="an activation (a value of an op's variant)")
    p.add_argument("--mode", choices=heuristics.MODES)
    args = p.parse_args(argv)
    table = find(args.gpu)
    if table is None:
        known = ", ".join(t.slug for t in heuristics.all_tables()) or "none"
        print(
            f"no heuristics table for {args.gpu or 'this device'} (known: {known}); "
            f"write one with: {heuristics.CALIBRATE_HINT}",
            file=sys.stderr,
        )
        return 1
    print(render(table, args.op, args.dtype, args.activation, args.mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
