"""The calibration's data, typed once: the records a table document holds, as the calibrator writes
them (a measured point, a segment, an entry, the self-check, the device), and what a loaded table
answers from (an entry's key and id, its parsed segments along M). The calibrator, the table printer
(``python -m dispatch.table``) and the lookups share them; ``validate`` checks a loaded document.

A record is a JSON object: a TypedDict, a plain dict on disk and in memory, its keys in the order the
calibrator writes them. ``Segment`` and ``Entry`` are what a loaded table keeps of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, TypedDict

import torch

from dispatch import ops
from dispatch.contracts.backend import Call

SCHEMA_VERSION = 2  # what the calibrator writes
SCHEMA_VERSIONS = (1, 2)  # what loads
MODES = ("inference", "training")
CLOCKS = ("gpu", "host")
# No tensor dimension or token count reaches int64's range; the bound also keeps the lookup's float
# math (log2 of size ratios) finite, which an integer like 10**400 would overflow.
MAX_SIZE = 2**62


class EntryKey(NamedTuple):
    """What a table entry answers for, bar its feature sizes: the key a call is looked up by. Past the
    op, dtype and mode, the traits its op declares (``OpSpec.traits``), each an entry field of that
    name; an entry's other fields key nothing (fused_linear's ``dropout``: ``OpSpec.entry_extras``)."""

    op: str
    dtype: str  # a torch dtype's name: "float32", "bfloat16"...
    mode: str  # "inference" or "training"
    traits: tuple[tuple[str, Any], ...]  # (name, value) of each trait of the op's, in its order

    @classmethod
    def of_fields(cls, op: str, dtype: str, mode: str, fields: Mapping[str, Any]) -> EntryKey:
        """The key of an op's entry or call whose traits' values are ``fields[name]``."""
        traits = tuple((name, fields.get(name)) for name in ops.get(op).traits)
        return cls(op, dtype, mode, traits)

    @classmethod
    def make(cls, op: str, dtype: str, variant: Optional[str], mode: str, dropout: bool) -> EntryKey:
        """The key of a calibrated family's entry: ``variant`` the value of its op's variant trait (an
        activation; ``OpSpec.variant``), ``dropout`` its family's flag (for an op with that trait)."""
        name = ops.get(op).variant
        return cls.of_fields(op, dtype, mode, {"dropout": bool(dropout), **({name: variant} if name else {})})

    @classmethod
    def of_entry(cls, e: Mapping[str, Any]) -> EntryKey:
        """The key of a table entry (or a held-out-size record, which has the same fields)."""
        return cls.of_fields(e["op"], e["dtype"], e["mode"], e)

    @classmethod
    def of_call(cls, call: Call) -> EntryKey:
        mode = "training" if call.training else "inference"
        dtype = str(call.dtype).removeprefix("torch.")
        return cls.of_fields(call.op, dtype, mode, dict(zip(call.traits, call.values)))

    def call(self, shape: tuple[int, ...], device: torch.device = torch.device("cpu")) -> Call:
        """A call this key answers, of decision shape ``shape`` (M first)."""
        names, values = tuple(n for n, _ in self.traits), tuple(v for _, v in self.traits)
        dtype, training = getattr(torch, self.dtype), self.mode == "training"
        return Call(self.op, device, dtype, shape, training, names, values)

    @property
    def activation(self) -> Optional[str]:
        return dict(self.traits).get("activation")

    @property
    def dropout(self) -> bool:
        return bool(dict(self.traits).get("dropout", False))

    @property
    def variant(self) -> Optional[str]:
        """The value of the op's variant trait (``OpSpec.variant``), None for an op without one."""
        name = ops.get(self.op).variant
        return None if name is None else dict(self.traits).get(name)

    @property
    def label(self) -> str:
        """'fused_linear float32 gelu training': the op, dtype, its traits' names and mode."""
        return " ".join([self.op, self.dtype, *(v for _, v in self.traits if type(v) is str), self.mode])


def variant_of(e: Mapping[str, Any]) -> Optional[str]:
    """The value of an entry's variant trait (its activation), None for an op without one."""
    name = ops.get(e["op"]).variant
    return None if name is None else e.get(name)


def key_fields(op: str, dtype: str, variant: Optional[str], mode: str, dropout: bool) -> dict[str, Any]:
    """An entry's first fields, as the calibrator writes them: the op, dtype, its variant trait (an
    activation), mode, and ``dropout`` where the op declares it or records it (``OpSpec.entry_extras``)."""
    spec = ops.get(op)
    fields: dict[str, Any] = {"op": op, "dtype": dtype}
    if spec.variant is not None:
        fields[spec.variant] = variant
    fields["mode"] = mode
    if "dropout" in (*spec.traits, *spec.entry_extras):
        fields["dropout"] = bool(dropout)
    return fields


class EntryId(NamedTuple):
    """What names one entry of a document: its key and its feature sizes."""

    key: EntryKey
    features: tuple[int, ...]  # the decision shape after M: (N,), (N, K)...

    @classmethod
    def of_entry(cls, e: Mapping[str, Any]) -> EntryId:
        return cls(EntryKey.of_entry(e), tuple(e["features"]))


class Point(TypedDict, total=False):
    """A raw measured point as the calibrator writes it (``validate`` checks a loaded one)."""

    m: int  # the token count
    gpu_us: dict[str, float]  # per backend (plain PyTorch too), us per call: GPU time, or the wall time
    host_us: dict[str, float]  # the host's cost of a call (the family's median once pooled)
    host_us_measured: dict[str, float]  # what the host clock read, where pooling replaced it
    gpu_clock: dict[str, str]  # how a GPU time was taken, where not by a CUDA graph
    drained: list[str]  # backends whose host clock's queue ran dry
    err: dict[str, float]  # max relative error of each backend that passed its parity check here
    rejected: dict[str, str]  # why a backend is no contender here (failed, not started, not checked)
    skipped: str  # why the point holds no timings (out of memory)
    ms: dict[str, float]  # schema 1: one clock, ms per call, in place of gpu_us and host_us
    first_ms: dict[str, float]  # schema 1: the first timings, where they were taken again
    confirmed_ms: dict[str, float]  # schema 1: the timings taken again
    unchecked: list[str]  # schema 1: backends whose parity check did not run


class Clocks(TypedDict):
    """Plain PyTorch's cost of a call at a segment's point, us, by each clock."""

    gpu: float
    host: float


class SegmentRecord(TypedDict, total=False):
    """A segment as the calibrator writes it (``plan.segment``): ``backend`` wins from M = ``m_from`` up to
    the next segment's; its numbers are those of its closest call (M = ``m``). Schema 1 and hand-written
    tables keep the first four keys."""

    m_from: int
    backend: str
    runner_up: Optional[str]
    margin: Optional[float]  # runner-up cost / winner cost - 1 (below 0: a preferred backend's tie)
    speedup: Optional[float]  # over plain PyTorch, the smallest over the segment's points
    m: int
    clock: str  # which clock bound the winner: "gpu" or "host"
    gpu_backend: str  # the winner by GPU time alone
    gpu_us: dict[str, float]  # the winner's and the runner-up's
    host_us: dict[str, float]
    pytorch_us: Clocks  # where plain PyTorch was timed at M = m
    errors: dict[str, float]  # the winner's largest relative error over its parity checks in the segment


class EntryRecord(TypedDict, total=False):
    """A table entry as the calibrator writes it (``series.Measurer.entry``): its key and feature sizes,
    where its timings come from, its segments along M and its measured points (which a shipped table,
    ``save.slim``, leaves out)."""

    op: str
    dtype: str  # a torch dtype's name
    activation: str  # the op's traits (``OpSpec.traits``) are fields: activation, dropout, its own
    mode: str  # "inference" or "training"
    dropout: bool  # where the op declares it, or records it (``OpSpec.entry_extras``)
    features: list[int]  # the decision shape after M: [N], [N, K]...
    measured_as: str  # the variant (activation) whose timings it shares (its own where absent)
    measured_dtype: str  # the dtype whose timings it shares, where not its own
    parity_checked: bool
    max_m: int  # the largest measured M
    segments: list[SegmentRecord]
    points: list[Point]  # the fit's
    held_out: list[Point]  # the self-check's: token counts the fit never saw


class SelfCheck(TypedDict, total=False):
    """The table's picks scored on held-out points (``report.self_check``)."""

    points: int
    within_5pct: Optional[float]  # the share of picks within 5% of the fastest
    worst_regret: Optional[float]  # pick / fastest - 1, the largest
    worst_vs_pytorch: Optional[float]  # pick / plain PyTorch - 1, the largest (schema 1: worst_vs_eager)
    worst_vs_eager: Optional[float]
    pick_not_runnable: int
    confirmed_points: int  # missed picks timed again
    by_gpu_time: Optional[SelfCheck]  # the pick under CUDA-graph capture, by GPU time alone (GPU only)
    targets: dict[str, float]
    meets_targets: bool


class DeviceInfo(TypedDict, total=False):
    """The device a table was measured on (``device.device_info``), and what lookups match it by."""

    type: str  # "cuda" or "cpu"
    name: str
    slug: str  # the table's file name
    threads: int  # a CPU's: the thread count it was timed with
    capability: list[int]  # a GPU's: [major, minor]
    sm_count: int
    peak_bandwidth_gbs: Optional[float]
    measured_bandwidth_gbs: Optional[float]


class Document(TypedDict, total=False):
    """A table: the calibrator's output (``report.document``), or slim as dispatch/heuristics/tables/ ships it."""

    schema_version: int
    device: DeviceInfo
    versions: dict[str, Optional[str]]  # torch, triton, cuda, python
    date: str
    settings: dict[str, Any]  # how it was made: the rule, the budget, its runs; free-form past those
    backends: dict[str, str]  # each timed backend's display name
    raw_points: dict[str, Any]  # a slim table's: the file with the measured points, what moved there
    entries: list[EntryRecord]
    self_check: SelfCheck
    held_out_sizes: list[dict[str, Any]]  # a key, its features and a point at a size not measured


@dataclass(frozen=True)
class Segment:
    """What a loaded table keeps of a ``SegmentRecord``: what ``Table.choose`` and explain() read."""

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
    """What a loaded table keeps of an ``EntryRecord``, its segments parsed."""

    features: tuple[int, ...]  # the decision shape after M: (N,), (N, K)...
    segments: tuple[Segment, ...]
    starts: tuple[int, ...]  # m_from of each segment, for bisect
    measured_as: Optional[str]  # the variant (activation) whose timings this key shares
    max_m: int  # largest measured M
    measured_dtype: Optional[str] = None  # the dtype whose timings this key shares, if not its own


def max_measured_m(entry: EntryRecord) -> int:
    """The largest measured token count of a checked entry: its ``max_m``, else the largest M of its
    raw points, else (neither kept) where its last segment starts."""
    if "max_m" in entry:
        return entry["max_m"]
    return max((p["m"] for p in entry.get("points", [])), default=entry["segments"][-1]["m_from"])
