"""One table: read and checked whole (``load_table``), and its answer for a call (``Table.choose``).

A call falls in the segment of its token count M. A feature size that was not measured is interpolated
(schema 2): between the two nearest measured sizes (in log space) whose segments name the same backends
in the same order, each crossover M is interpolated in log space; otherwise the nearer size decides.
Schema 1 tables answer by the nearest measured size. The Choice says which.
"""

from __future__ import annotations

import bisect
import json
import math
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

from dispatch.contracts.backend import Call
from dispatch.heuristics.device import running_versions
from dispatch.heuristics.schema import DeviceInfo, Document, Entry, EntryKey, Segment
from dispatch.heuristics.validate import SchemaError, check_document, parse_entries


class HeuristicsWarning(UserWarning):
    """A table was skipped, is stale, or belongs to another device."""


@dataclass(frozen=True)
class Choice:
    backend: str
    description: str  # which table and cell decided, for explain()
    # the winner by GPU time alone where it is another backend (the cell is host-bound): what a call
    # captured in a CUDA graph should run, its host cost paid once at capture
    gpu_backend: Optional[str] = None


def _dims(features: tuple[int, ...]) -> str:
    return "x".join(map(str, features))


def _us(x: float) -> str:
    return f"{x:.0f} us" if x >= 10 else f"{x:.1f} us"


def _clocks(seg: Segment, one_clock: bool) -> list[str]:
    """explain()'s words for a schema 2 segment: which clock decided, the speedup over plain PyTorch."""
    notes = []
    at = f" at M={seg.m}" if seg.m else ""
    if seg.gpu_us is not None and seg.host_us is not None:
        if seg.gpu_us == seg.host_us:  # one clock
            notes.append(f"wall time {_us(seg.gpu_us)}{at}")
        elif seg.clock == "host":
            notes.append(f"host-bound: host cost {_us(seg.host_us)} exceeds GPU time {_us(seg.gpu_us)}{at}")
        else:
            notes.append(f"GPU-bound: GPU time {_us(seg.gpu_us)} > host {_us(seg.host_us)}{at}")
    if seg.speedup:  # the smallest over the segment's points, which need not be the point of the clocks
        base = f"; PyTorch {_us(max(seg.pytorch_us))}{at}" if seg.pytorch_us else ""
        notes.append(f"at worst {seg.speedup:.2f}x plain PyTorch over the segment{base}")
    if not one_clock and seg.gpu_backend and seg.gpu_backend != seg.backend:
        notes.append(f"by GPU time alone {seg.gpu_backend} (as in a CUDA graph)")
    return notes


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


class Table:
    """One parsed table: ``data`` is the JSON document, ``index`` maps each key to its entries.
    Raises SchemaError (naming the field) for a document lookups could not use."""

    def __init__(self, data: Document, path: str) -> None:
        self.version = check_document(data)
        self.data, self.path = data, path
        self.device: DeviceInfo = data["device"]
        self.slug: str = self.device["slug"]
        self.index: dict[EntryKey, dict[tuple[int, ...], Entry]] = parse_entries(data, self.version)
        # timed by one clock: no GPU, and every segment that keeps both clocks reads them alike (a CPU's
        # wall time), so no word of GPU time, host cost or CUDA graphs applies
        self.one_clock = self.device.get("type") != "cuda" and all(
            s.gpu_us == s.host_us for by in self.index.values() for e in by.values() for s in e.segments
        )

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
        between = (
            f"between measured {_dims(a.features)} and {_dims(b.features)} "
            f"({_dims(features)} at {t:.2f} of the way)"
        )
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

    @property
    def rule(self) -> str:
        """How a schema 2 table's segment winner was decided, in words."""
        return "the fastest by wall time" if self.one_clock else "the cheapest by max(GPU time, host cost)"

    def choose(self, call: Call, via: str = "") -> Optional[Choice]:
        key = EntryKey.of_call(call)
        entries = self.index.get(key)
        if not entries:
            return None
        m, features = call.shape[0], tuple(call.shape[1:])
        entry, starts, size_note = self._entry(entries, features)
        i = max(bisect.bisect_right(starts, m) - 1, 0)
        seg = entry.segments[i]
        end = f"{starts[i + 1]}" if i + 1 < len(starts) else "inf"
        notes = [f"the segment M in [{starts[i]}, {end})"] + ([size_note] if size_note else [])
        if self.version >= 2:
            notes = [f"{notes[0]}: {self.rule}"] + _clocks(seg, self.one_clock) + notes[1:]
        if m > entry.max_m:
            notes.append(f"M={m} beyond the largest measured M={entry.max_m}")
        if entry.measured_as != key.variant or entry.measured_dtype:
            shared = " ".join(filter(None, (entry.measured_as, entry.measured_dtype)))
            notes.append(f"timings shared with {shared}")
        if seg.runner_up:
            margin = f" by {seg.margin:+.0%}" if seg.margin is not None else ""
            notes.append(f"runner-up {seg.runner_up}{margin}")
        where = f"heuristics table {self.slug}{via} ({self.path})"
        gpu = seg.gpu_backend if seg.gpu_backend != seg.backend else None
        return Choice(seg.backend, f"{where}: {key.label}, {'; '.join(notes)}", gpu)

    def span(self, call: Call) -> tuple[int, float]:
        """The token counts [lo, hi) around ``call``'s M that ``choose`` answers from the segment it answers
        ``call`` from (all M where the table has no cell for it)."""
        entries = self.index.get(EntryKey.of_call(call))
        if not entries:
            return 1, math.inf
        _, starts, _ = self._entry(entries, tuple(call.shape[1:]))
        i = max(bisect.bisect_right(starts, call.shape[0]) - 1, 0)
        return (starts[i] if i else 1), (starts[i + 1] if i + 1 < len(starts) else math.inf)

    def backends_named(self, op: str, traits: Mapping[str, object]) -> set[str]:
        """Every backend a segment names, winner or winner by GPU time alone, in the entries of ``op``
        whose traits include ``traits``."""
        found = set()
        for key, entries in self.index.items():
            have = dict(key.traits)
            if key.op != op or any(have.get(name, value) != value for name, value in traits.items()):
                continue
            for entry in entries.values():
                for seg in entry.segments:
                    found.update(filter(None, (seg.backend, seg.gpu_backend)))
        return found

    def missing(self, call: Call, via: str = "") -> str:
        """Why the table has no cell for ``call`` (``choose`` gave None), for explain(): its calibration's
        budget stopped before the call's family, or the family was never asked for."""
        key = EntryKey.of_call(call)
        what = f"{key.label}{' dropout' if key.dropout else ''}"
        where = f"heuristics table {self.slug}{via} ({self.path}) has no cell for {what}: not measured here"
        families = (self.data.get("settings") or {}).get("families") or {}
        family = f"{key.op} "
        tail = f" {key.mode}{' dropout' if key.dropout else ''}"
        cut = sorted(label for label, f in families.items()
                     if label.startswith(family) and label.endswith(tail) and (f or {}).get("series_left"))  # fmt: skip
        if cut:
            return (f"{where}; its calibration stopped at its budget with {', '.join(cut)} not measured "
                    f"(python -m dispatch.calibrate --resume measures the rest)")  # fmt: skip
        return f"{where} (python -m dispatch.calibrate --ops {key.op} measures it)"

    def version_mismatch(self) -> list[str]:
        stored, running = self.data.get("versions") or {}, running_versions()
        return [f"{k} {stored.get(k)} (running {running[k]})" for k in running if stored.get(k) != running[k]]


def read_table(path: str) -> tuple[Optional[Table], str]:
    """The table at ``path`` and '', or None and why it cannot be used (the file, the field at fault)."""
    try:
        with open(path, encoding="utf-8") as f:
            return Table(json.load(f), path), ""
    except Exception as exc:  # a bad table must never break a model: say why and go on without it
        return None, str(exc) if isinstance(exc, SchemaError) else f"{type(exc).__name__}: {exc}"


def warn_skipped(path: str, why: str, stacklevel: int) -> None:
    warnings.warn(f"ignoring heuristics table {path}: {why}", HeuristicsWarning, stacklevel=stacklevel + 1)


def load_table(path: str) -> Optional[Table]:
    """The table at ``path``, or None with a HeuristicsWarning if it cannot be read or parsed."""
    table, why = read_table(path)
    if table is None:
        warn_skipped(path, why, stacklevel=2)
    return table
