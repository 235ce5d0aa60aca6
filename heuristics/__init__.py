"""Per-device heuristic tables (JSON, written only by ``python -m dispatch.calibrate``) and their lookup.

A table holds, per key (op, dtype, activation, mode, dropout, feature size), the measured crossover
points along the token count M: segments ``[m_from, backend, runner_up, margin, ...]``, so a call with
any M is decided by the segment it falls in, never by snapping to the nearest measured M.

Schema 2 (what the calibrator writes now) keeps per segment the two clocks it was decided on: the
winner's and runner-up's ``gpu_us`` (CUDA-graph time) and ``host_us`` (the host's cost of a call),
plain PyTorch's (``pytorch_us``), which clock bound the winner (``clock``), the winner by GPU time
alone (``gpu_backend``) and the speedup over plain PyTorch; the winner is the cheapest by
max(gpu_us, host_us). A feature size that was not measured is interpolated: between the two nearest
measured sizes (in log space) whose segments name the same backends in the same order, each crossover
M is interpolated in log space; otherwise the nearer size decides. Schema 1 tables (one clock, speedups
over eager) load and answer as before: the nearest measured size decides. The Choice says which.

Where tables come from, first match wins: the user directory (``DISPATCH_HEURISTICS_DIR``, default
``~/.cache/fusedispatch/heuristics``), then the shipped ``heuristics/tables/``. A GPU without a table
uses the nearest known GPU by compute capability (then peak bandwidth), with one warning; a CPU
without a table gets None (the dispatcher's default). A table is checked whole when it loads, types
and ranges included; one that is not JSON or breaks the schema is skipped with one warning naming
its file and the field. Loading is JSON only, never code; tables and per-call answers are cached
(``reload()`` clears).

The calibrator's output keeps every measured point (``points``, ``held_out``, ``held_out_sizes``);
a shipped table is that output without them (``slim()``): the segments, each entry's ``max_m``,
the provenance and the self-check's summary, with ``raw_points`` naming the file that has the rest.
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

from dispatch.contracts.backend import Call

SCHEMA_VERSION = 2  # what the calibrator writes
SCHEMA_VERSIONS = (1, 2)  # what loads
ENV_DIR = "DISPATCH_HEURISTICS_DIR"
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "tables")
CALIBRATE_HINT = "python -m dispatch.calibrate --quick"


class HeuristicsWarning(UserWarning):
    """A table was skipped, is stale, or belongs to another GPU."""


@dataclass(frozen=True)
class Choice:
    backend: str
    description: str  # which table and cell decided, for explain()
    # the winner by GPU time alone where it is another backend (the cell is host-bound): what a call
    # captured in a CUDA graph should run, its host cost paid once at capture
    gpu_backend: Optional[str] = None


@dataclass(frozen=True)
class Segment:
    m_from: int  # first token count of this segment; it runs up to the next segment's m_from
    backend: str
    runner_up: Optional[str]
    margin: Optional[float]  # runner-up cost / winner cost - 1, the smallest over the segment's points
    # schema 2: the winner's clocks at the point of that margin (M = m), which one bound it, the winner
    # by GPU time alone, plain PyTorch's (gpu, host) there and the smallest speedup over it
    m: Optional[int] = None
    gpu_us: Optional[float] = None
    host_us: Optional[float] = None
    clock: Optional[str] = None
    gpu_backend: Optional[str] = None
    pytorch_us: Optional[tuple[float, float]] = None
    speedup: Optional[float] = None


@dataclass(frozen=True)
class Entry:
    features: tuple[int, ...]  # (N,) for bias_act_dropout, (N, K) for fused_linear
    segments: tuple[Segment, ...]
    starts: tuple[int, ...]  # m_from of each segment, for bisect
    measured_as: str  # the activation whose timings this key shares
    max_m: int  # largest measured M
    measured_dtype: Optional[str] = None  # the dtype whose timings this key shares, if not its own


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


# ----------------------------------------------------------------------------- the schema
#
# A table is checked whole, types and ranges included, when it loads: a table that loaded can answer
# every lookup, describe() and version check (and ``python -m dispatch.table``) without raising,
# and a table that cannot is skipped with one warning naming its file and the field at fault.

FEATURE_DIMS = {"bias_act_dropout": 1, "fused_linear": 2}  # (N,) or (N, K)
MODES = ("inference", "training")
# No tensor dimension or token count reaches int64's range; the bound also keeps the lookup's float
# math (log2 of size ratios) finite, which an integer like 10**400 would overflow.
MAX_SIZE = 2**62


class SchemaError(ValueError):
    """A table field of the wrong type or out of range; the message names the field."""


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _show(v: Any) -> str:
    """A value for a message, short: a 400-digit integer is not worth printing whole."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of {len(str(abs(v)))} digits"
    text = json.dumps(v) if isinstance(v, str) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(where: str, want: str, v: Any, wrong_type: bool = True) -> SchemaError:
    return SchemaError(f"{where} must be {want}, got {_type_name(v) if wrong_type else _show(v)}")


def _string(v: Any, where: str, choices: tuple[str, ...] = ()) -> str:
    if not isinstance(v, str):
        raise _bad(where, "a string", v)
    if choices and v not in choices:
        raise _bad(where, " or ".join(map(json.dumps, choices)), v, wrong_type=False)
    if not v:
        raise _bad(where, "a non-empty string", v, wrong_type=False)
    return v


def _boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise _bad(where, "true or false", v)
    return v


def _integer(v: Any, where: str, low: int = 1) -> int:
    if type(v) is not int:  # bool is an int subclass, and True is no size
        raise _bad(where, "an integer", v)
    if not low <= v <= MAX_SIZE:
        raise _bad(where, f"an integer from {low} to 2**62", v, wrong_type=False)
    return v


def _number(v: Any, where: str, above: Optional[float] = None, at_least: Optional[float] = None) -> float:
    if type(v) not in (int, float):
        raise _bad(where, "a number", v)
    try:
        x = float(v)
    except OverflowError:  # an integer beyond any float
        x = math.inf
    if not math.isfinite(x) or (above is not None and x <= above) or (at_least is not None and x < at_least):
        bound = "" if above is None else f" above {above:g}"
        bound += "" if at_least is None else f" of at least {at_least:g}"
        raise _bad(where, f"a finite number{bound}", v, wrong_type=False)
    return x


def _object(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise _bad(where, "an object", v)
    return v


def _array(v: Any, where: str, length: Optional[int] = None) -> list:
    if not isinstance(v, list):
        raise _bad(where, "a list", v)
    if length is not None and len(v) != length:
        raise SchemaError(f"{where} must hold {length} item{'s' if length > 1 else ''}, got {len(v)}")
    return v


def _get(
    obj: dict, key: str, where: str, check: Any, *args: Any, optional: bool = False, nullable: bool = False
) -> Any:
    """``obj[key]`` checked by ``check(value, path, *args)``; None where ``optional`` lets the key be
    absent or ``nullable`` lets its value be null."""
    path = f"{where}.{key}" if where else key
    if key not in obj:
        if optional:
            return None
        raise SchemaError(f"{path} is missing")
    if obj[key] is None and nullable:
        return None
    return check(obj[key], path, *args)


def _dtype_name(v: Any, where: str) -> str:
    name = _string(v, where)
    if not (isinstance(getattr(torch, name, None), torch.dtype) and getattr(torch, name).is_floating_point):
        raise _bad(where, "a floating-point dtype's name (float32, bfloat16...)", v, wrong_type=False)
    return name


def _timings(v: Any, where: str) -> dict:
    for name, ms in _object(v, where).items():
        _number(ms, f"{where}.{name}", above=0)
    return v


def _errors(v: Any, where: str) -> dict:
    for name, err in _object(v, where).items():
        _number(err, f"{where}.{name}", at_least=0)
    return v


def _strings(v: Any, where: str) -> list:
    for i, name in enumerate(_array(v, where)):
        _string(name, f"{where}[{i}]")
    return v


def _texts(v: Any, where: str) -> dict:
    for name, text in _object(v, where).items():
        _string(text, f"{where}.{name}")
    return v


def _point(p: Any, where: str, version: int) -> int:
    """A raw measured point (its M, each backend's times and error); the M comes back."""
    _object(p, where)
    if version == 1:
        for key in ("ms", "first_ms", "confirmed_ms"):  # first timings, and timings taken again
            _get(p, key, where, _timings, optional=key != "ms")
        _get(p, "unchecked", where, _strings, optional=True)
    else:
        for key in ("gpu_us", "host_us"):
            _get(p, key, where, _timings)
        _get(p, "host_us_measured", where, _timings, optional=True)  # before the series' median replaced it
        _get(p, "gpu_clock", where, _texts, optional=True)  # how a GPU time was taken, where not by a graph
        _get(p, "drained", where, _strings, optional=True)
    _get(p, "err", where, _errors, optional=True)
    _get(p, "rejected", where, _object, optional=True)
    return _get(p, "m", where, _integer)


def _key_fields(e: dict, where: str) -> tuple[tuple, tuple[int, ...]]:
    """The lookup key and feature sizes of an entry (or a held-out-size record, with the same keys)."""
    op = _get(e, "op", where, _string, tuple(FEATURE_DIMS))
    dtype = _get(e, "dtype", where, _dtype_name)
    activation = _get(e, "activation", where, _string)
    mode = _get(e, "mode", where, _string, MODES)
    dropout = _get(e, "dropout", where, _boolean)
    sizes = _get(e, "features", where, _array, FEATURE_DIMS[op])
    features = tuple(_integer(f, f"{where}.features[{i}]") for i, f in enumerate(sizes))
    return _key(op, dtype, activation, mode, dropout), features


CLOCKS = ("gpu", "host")


def _segment(s: Any, where: str, version: int) -> Segment:
    _object(s, where)
    m_from = _get(s, "m_from", where, _integer)
    backend = _get(s, "backend", where, _string)
    runner_up = _get(s, "runner_up", where, _string, optional=True, nullable=True)
    # runner-up / winner - 1: below 0 where a preferred backend won a tie within the noise
    margin = _get(s, "margin", where, _number, -1.0, optional=True, nullable=True)
    speedup = _get(s, "speedup", where, _number, 0.0, optional=True, nullable=True)
    _get(s, "errors", where, _errors, optional=True)
    if version == 1:
        return Segment(m_from, backend, runner_up, margin)
    # schema 2: optional, so that a hand-written table can leave them out; typed where present
    m = _get(s, "m", where, _integer, optional=True)
    clock = _get(s, "clock", where, _string, CLOCKS, optional=True)
    gpu_backend = _get(s, "gpu_backend", where, _string, optional=True)
    gpu = _get(s, "gpu_us", where, _timings, optional=True) or {}
    host = _get(s, "host_us", where, _timings, optional=True) or {}
    base = _get(s, "pytorch_us", where, _timings, optional=True)
    for key in CLOCKS if base is not None else ():
        _get(base, key, f"{where}.pytorch_us", _number, 0.0)
    pytorch = (float(base["gpu"]), float(base["host"])) if base is not None else None
    return Segment(m_from, backend, runner_up, margin, m, gpu.get(backend), host.get(backend), clock, gpu_backend,
                   pytorch, speedup)  # fmt: skip


def max_measured_m(entry: dict) -> int:
    """The largest measured token count of a checked entry: its ``max_m``, else the largest M of its
    raw points, else (neither kept) where its last segment starts."""
    if "max_m" in entry:
        return entry["max_m"]
    return max((p["m"] for p in entry.get("points", [])), default=entry["segments"][-1]["m_from"])


def _parse_entry(e: Any, where: str, version: int) -> tuple[tuple, Entry]:
    """One JSON entry, checked so that lookups on it cannot fail later."""
    _object(e, where)
    key, features = _key_fields(e, where)
    # provenance, optional as hand-written tables leave it out: by default its own activation's timings
    measured_as = _get(e, "measured_as", where, _string, optional=True) or e["activation"]
    measured_dtype = _get(e, "measured_dtype", where, _dtype_name, optional=True) if version >= 2 else None
    _get(e, "parity_checked", where, _boolean, optional=True)
    raw = _get(e, "segments", where, _array)
    if not raw:
        raise SchemaError(f"{where}.segments must not be empty")
    segments = tuple(_segment(s, f"{where}.segments[{i}]", version) for i, s in enumerate(raw))
    starts = tuple(s.m_from for s in segments)
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise SchemaError(
                f"{where}.segments[{i}].m_from must be above the previous segment's {starts[i - 1]}, "
                f"got {starts[i]}"
            )
    # the raw points: in the calibrator's output, not in a shipped table (benchmarks/results/ has them)
    for name in ("points", "held_out"):
        for i, p in enumerate(_get(e, name, where, _array, optional=True) or []):
            _point(p, f"{where}.{name}[{i}]", version)
    _get(e, "max_m", where, _integer, optional=True)
    return key, Entry(features, segments, starts, measured_as, max_measured_m(e), measured_dtype)


def _check_device(d: Any) -> dict:
    _object(d, "device")
    _get(d, "slug", "device", _string)
    _get(d, "type", "device", _string)
    _get(d, "name", "device", _string)
    cap = _get(d, "capability", "device", _array, 2, optional=True, nullable=True) or []
    for i, v in enumerate(cap):
        _integer(v, f"device.capability[{i}]", low=0)
    _get(d, "sm_count", "device", _integer, 0, optional=True, nullable=True)
    _get(d, "threads", "device", _integer, optional=True, nullable=True)
    for key in ("peak_bandwidth_gbs", "measured_bandwidth_gbs"):
        _get(d, key, "device", _number, 0.0, optional=True, nullable=True)
    return d


def _check_settings(s: Any) -> None:
    """What ``python -m dispatch.table`` prints of how the table was made; the rest is free-form."""
    _object(s, "settings")
    for key in ("quick", "stopped_by_budget"):
        _get(s, key, "settings", _boolean, optional=True)
    _get(s, "noise", "settings", _number, None, 0.0, optional=True)
    _get(s, "elapsed_s", "settings", _number, None, 0.0, optional=True)
    _get(s, "budget_s", "settings", _number, None, 0.0, optional=True, nullable=True)
    _get(s, "preference", "settings", _strings, optional=True)
    _get(s, "preference_inference", "settings", _strings, optional=True)
    for i, run in enumerate(_get(s, "runs", "settings", _array, optional=True) or []):
        where = f"settings.runs[{i}]"
        _object(run, where)
        kind = _get(run, "run", where, _string)
        _get(run, "elapsed_s", where, _number, None, 0.0)
        _get(run, "parts", where, _integer, optional=True)
        _get(run, "date", where, _string, optional=True, nullable=True)
        _get(run, "families", where, _strings, optional=kind != "refresh")


def _check_self_check(c: Any, version: int) -> None:
    _object(c, "self_check")
    points = _get(c, "points", "self_check", _integer, 0, optional=True)
    # a summary of some points is printed whole; of none (a run that held none out), it is empty
    _get(c, "within_5pct", "self_check", _number, None, 0.0, optional=not points, nullable=not points)
    for key in ("worst_regret", "worst_vs_eager" if version == 1 else "worst_vs_pytorch"):
        _get(c, key, "self_check", _number, optional=not points, nullable=True)
    _get(c, "confirmed_points", "self_check", _integer, 0, optional=True)


def _check_document(data: Any) -> int:
    """Everything of a table but its entries; the schema version comes back."""
    if not isinstance(data, dict):
        raise SchemaError(f"a table must be a JSON object, got {_type_name(data)}")
    version = _get(data, "schema_version", "", _integer, 0)
    if version not in SCHEMA_VERSIONS:
        raise SchemaError(
            f"schema_version {version!r}, this code reads {' and '.join(map(str, SCHEMA_VERSIONS))}"
        )
    _check_device(_get(data, "device", "", _object))
    for name, v in (_get(data, "versions", "", _object, optional=True) or {}).items():
        if v is not None:
            _string(v, f"versions.{name}")
    _get(data, "date", "", _string, optional=True)
    if "settings" in data:
        _check_settings(data["settings"])
    _get(data, "backends", "", _texts, optional=True)
    if "self_check" in data:
        _check_self_check(data["self_check"], version)
    if "raw_points" in data:
        _get(_object(data["raw_points"], "raw_points"), "file", "raw_points", _string)
    for i, h in enumerate(_get(data, "held_out_sizes", "", _array, optional=True) or []):
        where = f"held_out_sizes[{i}]"
        _key_fields(_object(h, where), where)
        _point(_get(h, "point", where, _object), f"{where}.point", version)
    return version


def _dims(features: tuple[int, ...]) -> str:
    return "x".join(map(str, features))


def _us(x: float) -> str:
    return f"{x:.0f} us" if x >= 10 else f"{x:.1f} us"


def _clocks(seg: Segment) -> list[str]:
    """explain()'s words for a schema 2 segment: which clock decided, the speedup over plain PyTorch."""
    notes = []
    at = f" at M={seg.m}" if seg.m else ""
    if seg.gpu_us is not None and seg.host_us is not None:
        if seg.gpu_us == seg.host_us:  # a CPU table: one clock
            notes.append(f"wall time {_us(seg.gpu_us)}{at} (no separate GPU clock)")
        elif seg.clock == "host":
            notes.append(f"host-bound: host cost {_us(seg.host_us)} exceeds GPU time {_us(seg.gpu_us)}{at}")
        else:
            notes.append(f"GPU-bound: GPU time {_us(seg.gpu_us)} > host {_us(seg.host_us)}{at}")
    if seg.speedup:  # the smallest over the segment's points, which need not be the point of the clocks
        base = f"; PyTorch {_us(max(seg.pytorch_us))}{at}" if seg.pytorch_us else ""
        notes.append(f"at worst {seg.speedup:.2f}x plain PyTorch over the segment{base}")
    if seg.gpu_backend and seg.gpu_backend != seg.backend:
        notes.append(f"by GPU time alone {seg.gpu_backend} (as in a CUDA graph)")
    return notes


class Table:
    """One parsed table: ``data`` is the JSON document, ``index`` maps each key to its entries.
    Raises SchemaError (naming the field) for a document lookups could not use."""

    def __init__(self, data: dict, path: str) -> None:
        self.version = _check_document(data)
        self.data, self.path = data, path
        self.device: dict = data["device"]
        self.slug: str = self.device["slug"]
        self.index: dict[tuple, dict[tuple[int, ...], Entry]] = {}
        for i, e in enumerate(_get(data, "entries", "", _array)):
            key, entry = _parse_entry(e, f"entries[{i}]", self.version)
            self.index.setdefault(key, {})[entry.features] = entry

    def _entry(self, entries: dict, features: tuple[int, ...]) -> tuple[Entry, tuple[int, ...], str]:
        """The entry that decides for ``features``, the segment starts to use and the note saying how."""
        if features in entries:
            entry = entries[features]
            return entry, entry.starts, ""
        near = sorted(entries.values(), key=lambda e: _log_distance(e.features, features))
        a = near[0]
        note = f"nearest measured size {_dims(a.features)} ({_dims(features)} not measured)"
        if self.version == 1 or len(near) < 2 or len(a.features) != len(features):
            return a, a.starts, note
        b = near[1]
        t = _position(a.features, b.features, features)
        if t is None:
            return a, a.starts, note + ", outside the measured sizes"
        between = f"between measured {_dims(a.features)} and {_dims(b.features)} ({_dims(features)} at {t:.2f} of the way)"
        if [s.backend for s in a.segments] != [s.backend for s in b.segments]:
            closer = a if t <= 0.5 else b
            return (
                closer,
                closer.starts,
                f"{between}, whose choices differ: the nearer {_dims(closer.features)}",
            )
        starts = [1]
        for sa, sb in list(zip(a.starts, b.starts))[1:]:
            starts.append(max(starts[-1] + 1, round(math.exp((1 - t) * math.log(sa) + t * math.log(sb)))))
        cuts = ", ".join(f"M={s}" for s in starts[1:])
        how = f"crossovers interpolated in log space at {cuts}" if cuts else "both choose alike"
        return (a if t <= 0.5 else b), tuple(starts), f"{between}: {how}"

    def choose(self, call: Call, via: str = "") -> Optional[Choice]:
        dtype = str(call.dtype).removeprefix("torch.")
        mode = "training" if call.training else "inference"
        entries = self.index.get(_key(call.op, dtype, call.activation, mode, call.dropout))
        if not entries:
            return None
        m, features = call.shape[0], tuple(call.shape[1:])
        entry, starts, size_note = self._entry(entries, features)
        i = max(bisect.bisect_right(starts, m) - 1, 0)
        seg = entry.segments[i]
        end = f"{starts[i + 1]}" if i + 1 < len(starts) else "inf"
        notes = [f"the segment M in [{starts[i]}, {end})"] + ([size_note] if size_note else [])
        if self.version >= 2:
            rule = "the cheapest by max(GPU time, host cost)"
            notes = [f"{notes[0]}: {rule}"] + _clocks(seg) + notes[1:]
        if m > entry.max_m:
            notes.append(f"M={m} beyond the largest measured M={entry.max_m}")
        if entry.measured_as != call.activation or entry.measured_dtype:
            shared = f" {entry.measured_dtype}" if entry.measured_dtype else ""
            notes.append(f"timings shared with {entry.measured_as}{shared}")
        if seg.runner_up:
            margin = f" by {seg.margin:+.0%}" if seg.margin is not None else ""
            notes.append(f"runner-up {seg.runner_up}{margin}")
        where = f"heuristics table {self.slug}{via} ({self.path})"
        gpu = seg.gpu_backend if seg.gpu_backend != seg.backend else None
        return Choice(seg.backend, f"{where}: {call.op} {dtype} {call.activation} {mode}, {'; '.join(notes)}", gpu)

    def version_mismatch(self) -> list[str]:
        stored, running = self.data.get("versions") or {}, running_versions()
        return [f"{k} {stored.get(k)} (running {running[k]})" for k in running if stored.get(k) != running[k]]


def _log_distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    if len(a) != len(b):
        return math.inf
    return math.sqrt(sum(math.log2(x / y) ** 2 for x, y in zip(a, b)))


def _position(a: tuple[int, ...], b: tuple[int, ...], x: tuple[int, ...]) -> Optional[float]:
    """Where ``x`` falls from ``a`` (0) to ``b`` (1) in log space, projected on the line between them;
    None outside (0, 1)."""
    la, lb, lx = ([math.log2(v) for v in f] for f in (a, b, x))
    d = [q - p for p, q in zip(la, lb)]
    length = sum(v * v for v in d)
    t = sum((q - p) * v for p, q, v in zip(la, lx, d)) / length if length else 0.0
    return t if 0.0 < t < 1.0 else None


def load_table(path: str) -> Optional[Table]:
    """The table at ``path``, or None with a HeuristicsWarning if it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            return Table(json.load(f), path)
    except Exception as exc:  # a bad table must never break a model: warn and go on without it
        why = str(exc) if isinstance(exc, SchemaError) else f"{type(exc).__name__}: {exc}"
        warnings.warn(f"ignoring heuristics table {path}: {why}", HeuristicsWarning, stacklevel=2)
        return None


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


def slim(doc: dict, raw_file: str) -> dict:
    """The calibrator's output ``doc`` as heuristics/tables/ ships it: every entry's segments and
    ``max_m``, the provenance and the self-check's summary, without the raw measured points (each
    entry's points and held-out points, the points at unmeasured sizes, the per-series time log),
    which stay in ``doc``, saved at ``raw_file`` (named in ``raw_points``). Lookups answer alike."""
    Table(doc, raw_file)  # a table that would not load is no table to ship
    moved = [f"entries[].{k}" for k in RAW_ENTRY_KEYS if any(k in e for e in doc["entries"])]
    moved += ["held_out_sizes"] if "held_out_sizes" in doc else []
    moved += ["settings.series_seconds"] if "series_seconds" in doc.get("settings", {}) else []
    out: dict = {}
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
    return out


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
