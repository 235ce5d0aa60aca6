"""Which table serves a device, and the cached lookups through it.

Tables are read from the user directory (``DISPATCH_HEURISTICS_DIR``, default
``~/.cache/fusedispatch/heuristics``), then the shipped ``dispatch/heuristics/tables/``; the first table of
a slug wins. A GPU without a table of its own gets none: every call runs on plain PyTorch, the floor,
since another GPU's crossovers can lose to it here (``describe()`` names the tables there are and how to
calibrate). A CPU without one borrows the table of its model timed with the nearest thread count, with
one warning naming it (the same cores, another thread count). A file that cannot be used is skipped with
one warning, and ``describe()`` names it with the reason. Tables and per-call answers are cached
(``reload()`` clears).
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from dispatch.contracts.backend import Call
from dispatch.heuristics.device import device_info, user_dir, user_dir_problem
from dispatch.heuristics.schema import DeviceInfo
from dispatch.heuristics.table import Choice, HeuristicsWarning, Table, read_table, warn_skipped

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "tables")
CALIBRATE_HINT = "python -m dispatch.calibrate --quick"


@dataclass(frozen=True)
class Found:
    tables: tuple[Table, ...]  # one per slug, the user directory's first
    skipped: tuple[tuple[str, str], ...]  # (path, why) of each file that could not be used


@functools.lru_cache(maxsize=None)
def _scan(user: str, shipped: str) -> Found:
    tables: dict[str, Table] = {}
    skipped = []
    for folder in (user, shipped):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json") and not name.startswith("."):
                path = os.path.join(folder, name)
                table, why = read_table(path)
                if table is None:
                    warn_skipped(path, why, stacklevel=5)  # the caller of lookup()
                    skipped.append((path, why))
                else:
                    tables.setdefault(table.slug, table)
    return Found(tuple(tables.values()), tuple(skipped))


def all_tables() -> tuple[Table, ...]:
    return _scan(user_dir(), SHIPPED_DIR).tables


def skipped_tables() -> tuple[tuple[str, str], ...]:
    """(path, why) of each table file in the directories that could not be used."""
    return _scan(user_dir(), SHIPPED_DIR).skipped


def _threads(device: DeviceInfo) -> Optional[int]:
    """The thread count a CPU was timed with: its ``threads``, else its slug's ``-<n>t``."""
    if device.get("threads"):
        return device["threads"]
    found = re.search(r"-(\d+)t$", device.get("slug") or "")
    return int(found.group(1)) if found and int(found.group(1)) > 0 else None


def _count(threads: int) -> str:
    return f"{threads} thread{'s' if threads != 1 else ''}"


def _model(slug: str) -> str:
    """A CPU slug without its thread count: cpu-amd-epyc-7b13-2t -> cpu-amd-epyc-7b13."""
    return re.sub(r"-\d+t$", "", slug)


def _nearest_threads(info: DeviceInfo, tables: tuple[Table, ...]) -> Optional[tuple[Table, str, str]]:
    """The table of this CPU model timed with the nearest thread count (in log scale), as _nearest_gpu."""
    here = _threads(info) or 1
    same = [(t, n) for t in tables if t.device.get("type") == "cpu" and _model(t.slug) == _model(info["slug"])
            for n in [_threads(t.device)] if n]  # fmt: skip
    if not same:
        return None
    table, there = min(same, key=lambda tn: (abs(math.log(tn[1]) - math.log(here)), -tn[1]))
    used = (
        f"{table.slug} ({table.path}), calibrated at {_count(there)}, the nearest thread count of this CPU: "
        f"its choices may not fit {_count(here)}"
    )
    return table, used, f", calibrated at {_count(there)}, the nearest to this process's {here}"


def resolve(info: DeviceInfo, tables: tuple[Table, ...]) -> tuple[Optional[Table], str]:
    """The table for a device described by ``info`` (see device_info), and the note for explain(); a
    CPU's table borrowed from another thread count comes with one warning naming it."""
    for table in tables:
        if table.slug == info["slug"]:
            return table, ""
    nearest = _nearest_threads(info, tables) if info["type"] == "cpu" else None
    if nearest is None:
        return None, ""
    table, used, via = nearest
    this = f"at {_count(_threads(info) or 1)}"
    writes = os.path.join(user_dir(), info["slug"] + ".json")
    warnings.warn(
        f"no heuristics table for {info['name']} {this} ({info['slug']}); using {used}. "
        f"Calibrate {this} with: {CALIBRATE_HINT} (writes {writes})",
        HeuristicsWarning,
        stacklevel=4,  # the caller of lookup()
    )
    return table, via


_by_slug: dict[str, tuple[Optional[Table], str]] = {}


@functools.lru_cache(maxsize=None)
def table_for(device: torch.device) -> tuple[Optional[Table], str]:
    """The table serving ``device`` and the note saying how it was found (cached: ``reload()``)."""
    info = device_info(device)
    if info["slug"] in _by_slug:  # several GPUs of one kind: resolve (and warn) once
        return _by_slug[info["slug"]]
    table, via = resolve(info, all_tables())
    if table is not None and table.version_mismatch():
        warnings.warn(
            f"heuristics table {table.path} was calibrated with {', '.join(table.version_mismatch())}; "
            f"its choices may be stale. Recalibrate with: {CALIBRATE_HINT}",
            HeuristicsWarning,
            stacklevel=3,
        )
    _by_slug[info["slug"]] = (table, via)
    return table, via


def _normalize(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device.type, device.index) if device.type == "cuda" else torch.device("cpu")


@functools.lru_cache(maxsize=65536)
def lookup(call: Call) -> Optional[Choice]:
    """The table's backend for ``call``, or None when no table covers it."""
    table, via = table_for(_normalize(call.device))
    return table.choose(call, via) if table is not None else None


def backends_named(op: str, device: torch.device, traits: Mapping[str, object]) -> set[str]:
    """Every backend the table serving ``device`` names for ``op`` in an entry whose traits include
    ``traits`` (any dtype, mode, size, M), by either clock; empty where no table serves the device."""
    table, _ = table_for(_normalize(device))
    return set() if table is None else table.backends_named(op, traits)


def m_span(call: Call) -> tuple[int, float]:
    """The token counts [lo, hi) around ``call``'s M over which ``lookup`` gives ``call``'s answer: one
    segment of the table's cell, or every M where no table or cell serves it."""
    table, _ = table_for(_normalize(call.device))
    return (1, math.inf) if table is None else table.span(call)


def why_no_choice(call: Call) -> str:
    """Why no table answers ``call`` (``lookup`` gave None), in words for explain()."""
    table, via = table_for(_normalize(call.device))
    return describe(call.device) if table is None else table.missing(call, via)


def describe(device: torch.device) -> str:
    """Which table serves ``device``, and any table file skipped or directory that serves none (for
    ``dispatch.info`` and explain())."""
    device = _normalize(device)
    table, via = table_for(device)
    notes = [f"skipped {path}: {why}" for path, why in skipped_tables()]
    notes += [problem] if (problem := user_dir_problem()) else []
    if table is None:
        info = device_info(device)
        others = sorted(t.device["name"] for t in all_tables() if t.device.get("type") == "cuda")
        if others and info["type"] == "cuda":
            notes.append(f"tables here are for {', '.join(others)}, not borrowed: another GPU's crossovers "
                         "can lose to plain PyTorch on this one")  # fmt: skip
        notes.append(f"calibrate: {CALIBRATE_HINT}")
        return f"no calibrated table for {info['name']} ({info['slug']}) ({'; '.join(notes)})"
    found = f"heuristics table {table.slug}{via} ({table.path}, calibrated {table.data.get('date', '?')})"
    return "; ".join([found, *notes])


def reload() -> None:
    """Forgets loaded tables and cached answers (after a calibration, or a change of directory)."""
    _scan.cache_clear()
    table_for.cache_clear()
    _by_slug.clear()
    lookup.cache_clear()
