"""Per-device heuristic tables (JSON, written only by ``python -m dispatch.calibrate``) and their lookup.

A table holds, per key (op, dtype, activation, mode, dropout, feature size), the measured crossover
points along the token count M: segments ``[m_from, backend, runner_up, margin, ...]``, so a call with
any M is decided by the segment it falls in, never by snapping to the nearest measured M. A feature
size that was not measured uses the nearest measured one (in log space), and the Choice says so.

Where tables come from, first match wins: the user directory (``DISPATCH_HEURISTICS_DIR``, default
``~/.cache/fusedispatch/heuristics``), then the shipped ``heuristics/tables/``. A GPU without a table
uses the nearest known GPU by compute capability (then peak bandwidth), with one warning; a CPU
without a table gets None (the dispatcher's default). A corrupt table is skipped with a warning.
Loading is JSON only, never code; tables and per-call answers are cached (``reload()`` clears).
"""

from __future__ import annotations

import bisect
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dispatch.registry import Call

SCHEMA_VERSION = 1
ENV_DIR = "DISPATCH_HEURISTICS_DIR"
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "tables")
CALIBRATE_HINT = "python -m dispatch.calibrate --quick"


class HeuristicsWarning(UserWarning):
    """A table was skipped, is stale, or belongs to another GPU."""


@dataclass(frozen=True)
class Choice:
    backend: str
    description: str  # which table and cell decided, for explain()


@dataclass(frozen=True)
class Segment:
    m_from: int  # first token count of this segment; it runs up to the next segment's m_from
    backend: str
    runner_up: Optional[str]
    margin: Optional[float]  # runner-up time / winner time - 1, the smallest over the segment's points


@dataclass(frozen=True)
class Entry:
    features: tuple[int, ...]  # (N,) for bias_act_dropout, (N, K) for fused_linear
    segments: tuple[Segment, ...]
    starts: tuple[int, ...]  # m_from of each segment, for bisect
    measured_as: str  # the activation whose timings this key shares
    max_m: int  # largest measured M


# ----------------------------------------------------------------------------- devices and places


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_info(device: torch.device) -> dict[str, Any]:
    """Name, slug and the properties used to match tables: capability, SMs, peak bandwidth (CUDA)."""
    if device.type != "cuda":
        threads = torch.get_num_threads()  # CPU timings scale with the thread count
        model = _cpu_model()
        return {"type": "cpu", "name": model, "slug": f"cpu-{slugify(model)}-{threads}t", "threads": threads}
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0  # 0 or absent on some CUDA versions
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    peak = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None  # DDR: 2/clock
    return {
        "type": "cuda",
        "name": props.name,
        "slug": slugify(props.name),
        "capability": [props.major, props.minor],
        "sm_count": props.multi_processor_count,
        "peak_bandwidth_gbs": round(peak, 1) if peak else None,
    }


def running_versions() -> dict[str, Optional[str]]:
    try:
        triton_version: Optional[str] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def user_dir() -> str:
    """Where calibrate writes by default and lookup looks first."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fusedispatch", "heuristics")


# ----------------------------------------------------------------------------- one table


def _key(op: str, dtype: str, activation: str, mode: str, dropout: bool) -> tuple[str, str, str, str, bool]:
    return (op, dtype, activation, mode, bool(dropout) and op == "bias_act_dropout")


def _parse_entry(e: dict) -> Entry:
    """One JSON entry, validated so that lookups on it cannot fail later."""
    segments = tuple(
        Segment(
            int(s["m_from"]),
            str(s["backend"]),
            None if s.get("runner_up") is None else str(s["runner_up"]),
            None if s.get("margin") is None else float(s["margin"]),
        )
        for s in e["segments"]
    )
    starts = tuple(s.m_from for s in segments)
    features = tuple(int(f) for f in e["features"])
    where = f"entry {e.get('op')}/{e.get('activation')} {e.get('features')}"
    if not segments or starts[0] < 1 or list(starts) != sorted(set(starts)):
        raise ValueError(f"{where}: bad segments {starts}")
    if len(features) != (1 if e["op"] == "bias_act_dropout" else 2) or min(features) < 1:
        raise ValueError(f"{where}: bad feature size")
    max_m = max((int(p["m"]) for p in e.get("points", [])), default=starts[-1])
    return Entry(features, segments, starts, str(e.get("measured_as", e["activation"])), max_m)


class Table:
    """One parsed table: ``data`` is the JSON document, ``index`` maps each key to its entries."""

    def __init__(self, data: dict, path: str) -> None:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {version!r}, this code reads {SCHEMA_VERSION}")
        self.data, self.path = data, path
        self.device: dict = data["device"]
        self.slug: str = self.device["slug"]
        self.index: dict[tuple, dict[tuple[int, ...], Entry]] = {}
        for e in data["entries"]:
            key = _key(e["op"], e["dtype"], e["activation"], e["mode"], e.get("dropout", False))
            entry = _parse_entry(e)
            self.index.setdefault(key, {})[entry.features] = entry

    def choose(self, call: Call, via: str = "") -> Optional[Choice]:
        dtype = str(call.dtype).removeprefix("torch.")
        mode = "training" if call.training else "inference"
        entries = self.index.get(_key(call.op, dtype, call.activation, mode, call.dropout))
        if not entries:
            return None
        m, features = call.shape[0], tuple(call.shape[1:])
        entry = entries.get(features) or min(
            entries.values(), key=lambda e: _log_distance(e.features, features)
        )
        i = max(bisect.bisect_right(entry.starts, m) - 1, 0)
        seg = entry.segments[i]
        end = f"{entry.segments[i + 1].m_from}" if i + 1 < len(entry.segments) else "inf"
        dims = "x".join(map(str, entry.features))
        notes = [f"the segment M in [{seg.m_from}, {end})"]
        if entry.features != features:
            notes.append(f"nearest measured size {dims} ({'x'.join(map(str, features))} not measured)")
        if m > entry.max_m:
            notes.append(f"M={m} beyond the largest measured M={entry.max_m}")
        if entry.measured_as != call.activation:
            notes.append(f"timings shared with {entry.measured_as}")
        if seg.runner_up:
            margin = f" by {seg.margin:+.0%}" if seg.margin is not None else ""
            notes.append(f"runner-up {seg.runner_up}{margin}")
        where = f"heuristics table {self.slug}{via} ({self.path})"
        return Choice(seg.backend, f"{where}: {call.op} {dtype} {call.activation} {mode}, {'; '.join(notes)}")

    def version_mismatch(self) -> list[str]:
        stored, running = self.data.get("versions", {}), running_versions()
        return [f"{k} {stored.get(k)} (running {running[k]})" for k in running if stored.get(k) != running[k]]


def _log_distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    if len(a) != len(b):
        return math.inf
    return math.sqrt(sum(math.log2(x / y) ** 2 for x, y in zip(a, b)))


def load_table(path: str) -> Optional[Table]:
    """The table at ``path``, or None with a HeuristicsWarning if it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            return Table(json.load(f), path)
    except Exception as exc:  # a bad table must never break a model: warn and go on without it
        warnings.warn(
            f"ignoring heuristics table {path}: {type(exc).__name__}: {exc}", HeuristicsWarning, stacklevel=2
        )
        return None


def save_table(data: dict, path: str) -> str:
    """Writes ``data`` to ``path`` atomically (temp file in the same folder + os.replace)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


# ----------------------------------------------------------------------------- which table, cached


@functools.lru_cache(maxsize=None)
def _tables(user: str, shipped: str) -> tuple[Table, ...]:
    """Every readable table, user directory first; one per slug (the first found wins)."""
    found: dict[str, Table] = {}
    for folder in (user, shipped):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json") and not name.startswith("."):
                table = load_table(os.path.join(folder, name))
                if table is not None:
                    found.setdefault(table.slug, table)
    return tuple(found.values())


def all_tables() -> tuple[Table, ...]:
    return _tables(user_dir(), SHIPPED_DIR)


def _gpu_distance(info: dict, table: Table) -> tuple[float, float]:
    cap, other = info.get("capability") or [0, 0], table.device.get("capability") or [0, 0]
    bw, other_bw = info.get("peak_bandwidth_gbs"), table.device.get("peak_bandwidth_gbs")
    bw_gap = abs(math.log(bw / other_bw)) if bw and other_bw else 0.0
    return (abs(cap[0] - other[0]) * 10 + abs(cap[1] - other[1]), bw_gap)


def resolve(info: dict, tables: tuple[Table, ...]) -> tuple[Optional[Table], str]:
    """The table for a device described by ``info`` (see device_info), and the note for explain()."""
    for table in tables:
        if table.slug == info["slug"]:
            return table, ""
    known = [t for t in tables if t.device.get("type") == info["type"] == "cuda"]
    if not known:
        return None, ""
    table = min(known, key=lambda t: _gpu_distance(info, t))
    cap = ".".join(map(str, table.device.get("capability") or ["?"]))
    warnings.warn(
        f"no heuristics table for {info['name']} ({info['slug']}); using the one of {table.device['name']} "
        f"(compute capability {cap}), the nearest known GPU. Calibrate this GPU with: {CALIBRATE_HINT} "
        f"(writes {os.path.join(user_dir(), info['slug'] + '.json')})",
        HeuristicsWarning,
        stacklevel=3,
    )
    return table, f", nearest known GPU to {info['name']}"


_by_slug: dict[str, tuple[Optional[Table], str]] = {}


@functools.lru_cache(maxsize=None)
def _table_for(device: torch.device) -> tuple[Optional[Table], str]:
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
    table, via = _table_for(_normalize(call.device))
    return table.choose(call, via) if table is not None else None


def describe(device: torch.device) -> str:
    """Which table serves ``device`` (for ``dispatch.info`` and explain())."""
    table, via = _table_for(_normalize(device))
    if table is None:
        return (
            f"no calibrated table for {device_info(_normalize(device))['slug']} (calibrate: {CALIBRATE_HINT})"
        )
    return f"heuristics table {table.slug}{via} ({table.path}, calibrated {table.data.get('date', '?')})"


def reload() -> None:
    """Forgets loaded tables and cached answers (after a calibration, or a change of directory)."""
    _tables.cache_clear()
    _table_for.cache_clear()
    _by_slug.clear()
    lookup.cache_clear()
