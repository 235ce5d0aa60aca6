"""Writing a table: JSON a person can read (one segment or point a line), written atomically, and the
slim form dispatch/heuristics/tables/ ships (the calibrator's output without its raw measured points)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, cast

from dispatch.heuristics.schema import Document, max_measured_m
from dispatch.heuristics.table import Table

WIDTH = 110  # what a line of a saved table holds, where its items can be packed


def _depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


def _dumps(v: Any, indent: int, in_list: bool) -> str:
    flat = json.dumps(v, allow_nan=False)
    depth = _depth(v)
    # one line: a record of a list (a segment, a point), or a shallow value that fits
    if depth == 0 or (depth <= 2 and (in_list or indent + len(flat) <= WIDTH)):
        return flat
    pad = " " * (indent + 1)
    body: list[str] = []
    if isinstance(v, list):
        body = [pad + _dumps(x, indent + 1, True) for x in v]
    else:
        line = ""  # the scalar and flat items, packed into lines
        for k, x in v.items():
            item = f"{json.dumps(k)}: {_dumps(x, indent + 1, False)}"
            short = "\n" not in item
            if line and short and len(pad) + len(line) + 2 + len(item) <= WIDTH:
                line += ", " + item
                continue
            if line:
                body.append(pad + line)
            line = item if short else ""
            if not short:
                body.append(pad + item)
        if line:
            body.append(pad + line)
    opening, closing = "[]" if isinstance(v, list) else "{}"
    return opening + "\n" + ",\n".join(body) + "\n" + " " * indent + closing


def dumps(data: Any) -> str:
    """``data`` as JSON a person can read (one segment or point a line), no NaN or infinity."""
    return _dumps(data, 0, False)


def save_table(data: dict, path: str) -> str:
    """Writes ``data`` to ``path`` atomically (temp file in the same folder + os.replace)."""
    text = dumps(data) + "\n"  # raises before any file is touched if ``data`` is no JSON
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


RAW_ENTRY_KEYS = ("points", "held_out")  # an entry's measured points (the fit's and the self-check's)


def slim(doc: Document, raw_file: str) -> Document:
    """The calibrator's output ``doc`` as dispatch/heuristics/tables/ ships it: every entry's segments and
    ``max_m``, the provenance and the self-check's summary, without the raw measured points (each
    entry's points and held-out points, the points at unmeasured sizes, the per-series time log),
    which stay in ``doc``, saved at ``raw_file`` (named in ``raw_points``). Lookups answer alike."""
    Table(doc, raw_file)  # a table that would not load is no table to ship
    moved = [f"entries[].{k}" for k in RAW_ENTRY_KEYS if any(k in e for e in doc["entries"])]
    moved += ["held_out_sizes"] if "held_out_sizes" in doc else []
    moved += ["settings.series_seconds"] if "series_seconds" in doc.get("settings", {}) else []
    out: dict[str, Any] = {}  # the document's keys in its order, raw_points before the entries
    for key, value in doc.items():
        if key == "held_out_sizes":
            continue
        if key == "settings":
            value = {k: v for k, v in value.items() if k != "series_seconds"}
        if key == "entries":
            out["raw_points"] = {"file": raw_file, "moved": moved}
            keep = [[k for k in e if k not in (*RAW_ENTRY_KEYS, "max_m", "segments")] for e in value]
            value = [  # max_m before the segments, so that a person reads the key, then the cuts
                {**{k: e[k] for k in ks}, "max_m": max_measured_m(e), "segments": e["segments"]}
                for e, ks in zip(value, keep, strict=True)
            ]
        out[key] = value
    return cast(Document, out)
