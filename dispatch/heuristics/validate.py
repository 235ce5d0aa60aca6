"""The table document checked whole when it loads, every field with its type and range: a table that
loaded can answer every lookup, describe() and version check (and ``python -m dispatch.table``) without
raising, and a table that cannot is skipped with one warning naming its file and the field at fault.
The records it checks and the parsed ``Entry`` it makes are typed in ``schema``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import torch

from dispatch import ops
from dispatch.heuristics.schema import (
    CLOCKS, MAX_SIZE, MODES, SCHEMA_VERSIONS, Document, Entry, EntryKey, Segment, max_measured_m, variant_of,
)  # fmt: skip


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


def _scalar(v: Any, where: str) -> Any:
    if type(v) not in (str, bool, int, float):
        raise _bad(where, "a string, number, true or false", v)
    return v


# The types of these fields where an entry holds them: each trait its op declares (``OpSpec.traits``)
# and each extra field it records (``OpSpec.entry_extras``). Any other trait must be a string, number
# or boolean.
_TRAITS = {"activation": _string, "dropout": _boolean}


def _key_fields(e: dict, where: str) -> tuple[EntryKey, tuple[int, ...]]:
    """The lookup key and feature sizes of an entry (or a held-out-size record, with the same keys):
    its op, dtype, mode and the traits its op declares (``OpSpec.traits``), each a field."""
    op = _get(e, "op", where, _string, ops.names())
    dtype = _get(e, "dtype", where, _dtype_name)
    mode = _get(e, "mode", where, _string, MODES)
    spec = ops.get(op)
    for name in dict.fromkeys((*spec.traits, *spec.entry_extras)):
        _get(e, name, where, _TRAITS.get(name, _scalar))
    sizes = _get(e, "features", where, _array, spec.feature_dims)
    features = tuple(_integer(f, f"{where}.features[{i}]") for i, f in enumerate(sizes))
    return EntryKey.of_fields(op, dtype, mode, e), features


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
    winner_gpu, winner_host = gpu.get(backend), host.get(backend)
    return Segment(
        m_from, backend, runner_up, margin, m, winner_gpu, winner_host, clock, gpu_backend, pytorch, speedup
    )


def _parse_entry(e: Any, where: str, version: int) -> tuple[EntryKey, Entry]:
    """One JSON entry, checked so that lookups on it cannot fail later."""
    _object(e, where)
    key, features = _key_fields(e, where)
    # provenance, optional as hand-written tables leave it out: by default its own activation's timings
    measured_as = _get(e, "measured_as", where, _string, optional=True) or variant_of(e)
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


def parse_entries(data: Document, version: int) -> dict[EntryKey, dict[tuple[int, ...], Entry]]:
    """A checked document's entries by key, then by feature sizes."""
    index: dict[EntryKey, dict[tuple[int, ...], Entry]] = {}
    for i, e in enumerate(_get(data, "entries", "", _array)):
        key, entry = _parse_entry(e, f"entries[{i}]", version)
        index.setdefault(key, {})[entry.features] = entry
    return index


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


def check_document(data: Any) -> int:
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
