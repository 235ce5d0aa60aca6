"""What ``python -m dispatch.calibrate`` measures, in which order, and the rule that turns measured
points into a table's segments.

The rule: a call costs ``max(gpu_us, host_us)`` (the host enqueues while the GPU runs); ties within
NOISE go to the first in the mode's ``preference``. A segment also records the winner by GPU time alone
(``gpu_backend``: what a CUDA-graph capture runs), the clock that bound the winner, and its speedup over
plain PyTorch (BASELINE: a contender, first in the ties, and the owner of unmeasured gaps it borders).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dispatch import ops
from dispatch.contracts import shapes
from dispatch.heuristics.ranking import (  # noqa: F401  (the ranking rule, for the calibrator)
    BASELINE, NOISE, PREFERENCE, PREFERENCE_INFERENCE, bound, costs, estimated, preference, rank, winner,
)  # fmt: skip
from dispatch.heuristics.schema import EntryRecord, Point, SegmentRecord, variant_of
from dispatch.registry import backends

MODES = ("inference", "training")
# float16 shares bfloat16's timings on a GPU (each cell checked in float16): the same kernels; the two
# agreed in 1126 of 1134 cells of a full table.
SHARED_DTYPES = {torch.bfloat16: (torch.float16,)}
# float32 on a GPU: the first three sizes of each op (GPT-2 and LLaMA-7B widths); models train and serve
# in half precision there, and 70B-wide float32 GEMMs run at 1/8-1/15 of bf16's rate.
FLOAT32_SIZES = 3


def family_order(op_names: Sequence[str]) -> list[tuple[str, str, bool]]:
    """(mode, op, dropout) of every op's families, the ops' first families first (each spec lists its
    own by what real models run most): the order breaks the scheduler's ties."""
    lists = [[(mode, name, drop) for mode, drop in ops.get(name).grid.families] for name in op_names]
    return [f for rank in itertools.zip_longest(*lists) for f in rank if f is not None]


def features(device_type: str, quick: bool, op_names: Sequence[str]) -> dict[str, list[tuple[int, ...]]]:
    """Each op's feature sizes in priority order (its spec's grid)."""
    out = {}
    for name in op_names:
        grid = ops.get(name).grid
        out[name] = list(grid.quick.get(device_type, grid.quick.get("cpu", ())) if quick else grid.features)
    return out


@dataclass
class Plan:
    device: torch.device
    quick: bool
    dtypes: tuple[torch.dtype, ...]  # measured; SHARED_DTYPES' members follow them (GPU only)
    shared: dict[torch.dtype, tuple[torch.dtype, ...]]
    features: dict[str, list[tuple[int, ...]]]
    tokens: tuple[int, ...]  # the coarse grid of M; bisection adds points between
    ratio: float  # bisect while neighbours with different winners are further apart than this in M
    max_elements: int  # M * features cap of an elementwise op's point
    max_macs: int  # M * N * K cap of a GEMM op's point (float32 on a GPU gets 1/8)
    rounds: int  # interleaved timing rounds per point
    budget_s: float
    float32_sizes: int = 0  # float32 takes the first this many feature sizes (0: all)

    def sizes(self, op: str, dtype: torch.dtype) -> list[tuple[int, ...]]:
        sizes = self.features.get(op, [])
        return sizes[: self.float32_sizes] if dtype == torch.float32 and self.float32_sizes else sizes

    def m_cap(self, op: str, features: tuple[int, ...], dtype: torch.dtype) -> int:
        gemm = ops.get(op).grid.gemm
        cap = self.max_macs if gemm else self.max_elements
        if gemm and dtype == torch.float32 and self.device.type == "cuda":
            cap //= 8  # float32 GEMMs: 1/8-1/15 of bf16's rate on Hopper
        m = 2 ** max(0, math.floor(math.log2(max(cap // math.prod(features), 1))))
        return min(m, max(self.tokens))

    def grid(self, op: str, features: tuple[int, ...], dtype: torch.dtype) -> list[int]:
        cap = self.m_cap(op, features, dtype)
        return sorted({t for t in self.tokens if t < cap} | {cap})

    def check_cap(self, op: str, features: tuple[int, ...]) -> int:
        """The largest M a parity check runs at: the float64 reference and eager's dropout (int64 tensor
        ops, 95 ms a call at 65536 x 4096) cost 10-100x the timed call."""
        return max(1, ops.get(op).grid.check_work // math.prod(features))


def default_plan(
    device: torch.device, quick: bool, budget: Optional[float], op_names: Optional[Sequence[str]] = None
) -> Plan:
    """On a GPU a point holds at most 2**27 elements (~0.13 ms a pass in bf16) or 2**39 multiply-adds
    (~1 ms forward: 70B-wide layers reach M = 2048; beyond, the last segment continues). At 2**28 and
    2**40 the largest points took 159 of a full run's 376 s of series (5-10 ms
    training calls, read in SLOW_ROUNDS rounds), and the run measured 111 of 124 series in its budget.
    The grid has no M = 16 (M = 1 and 256 are both host-bound for nearly every call, and host costs
    are pooled per family), and bisection stops at neighbours 4x apart: crossovers to within 2x."""
    gpu = device.type == "cuda"
    sizes = features(device.type, quick, ops.names() if op_names is None else op_names)
    if quick:
        return Plan(
            device, True, (torch.bfloat16,) if gpu else (torch.float32,), SHARED_DTYPES if gpu else {},
            sizes, (1, 64, 4096, 65536) if gpu else (1, 16, 256), 4.0,
            2**28 if gpu else 2**18, 2**40 if gpu else 2**28, 2 if gpu else 3,
            budget if budget is not None else (90.0 if gpu else 150.0),
        )  # fmt: skip
    return Plan(
        device, False, (torch.bfloat16, torch.float32) if gpu else (torch.float32, torch.bfloat16),
        SHARED_DTYPES if gpu else {}, sizes, (1, 256, 4096, 65536) if gpu else (1, 16, 256, 4096),
        4.0 if gpu else 2.0, 2**27 if gpu else 2**22, 2**39 if gpu else 2**30, 3,
        budget if budget is not None else 550.0, FLOAT32_SIZES if gpu else 0,
    )  # fmt: skip


@dataclass(frozen=True)
class Family:
    """Calls that share a budget: one op, measured dtype, mode and dropout setting (False: no such trait)."""

    op: str
    dtype: torch.dtype
    mode: str
    dropout: bool

    @property
    def label(self) -> str:
        return f"{self.op} {str(self.dtype)[6:]} {self.mode}{' dropout' if self.dropout else ''}"


@dataclass
class Series:
    """One measured variant (``rep``: an activation, or None) of a family and the members sharing it."""

    family: Family
    rep: Optional[str]
    members: list[tuple[Optional[str], torch.dtype]] = field(default_factory=list)

    @property
    def label(self) -> str:
        f, rep = self.family, f" {self.rep}" if self.rep is not None else ""
        return f"{f.op} {str(f.dtype)[6:]}{rep} {f.mode}{' dropout' if f.dropout else ''}"

    @property
    def partial(self) -> frozenset[str]:
        """Backends serving the representative but not every member (they prune nobody: ``contenders``)."""
        op = self.family.op
        mine = servers(op, self.rep)
        return mine - mine.intersection(*(servers(op, a) for a, _ in self.members))


def servers(op: str, value: Optional[str]) -> frozenset[str]:
    free = ops.get(op).variant != "activation"  # backends declare the activations they take, no other trait
    return frozenset(
        n for n, b in backends().items() if b.implements(op) and (free or value in b.activations)
    )


def classes(op: str, variants: tuple[Optional[str], ...]) -> list[tuple[Optional[str], ...]]:
    """The op's classes of its variant's values (``grid.classes``; (None,) without one) restricted to
    ``variants`` (of those it takes), each led by the member most backends serve; a member served by a
    backend its representative lacks is measured alone (that backend's timings would be missing)."""
    variants = tuple(a for a in variants if a in ops.get(op).variants())
    own = ops.get(op).grid.classes
    listed = {a for cls in own for a in cls}
    out: list[tuple[Optional[str], ...]] = []
    for cls in [*own, *((a,) for a in variants if a not in listed)]:
        chosen = [a for a in cls if a in variants]
        if chosen:
            rep = max(chosen, key=lambda a: len(servers(op, a)))
            shared = [a for a in chosen if a != rep and servers(op, a) <= servers(op, rep)]
            out += [(rep, *shared)] + [(a,) for a in chosen if a != rep and a not in shared]
    return out


def series_of(plan: Plan, family: Family, variants: tuple[Optional[str], ...]) -> list[Series]:
    out = []
    for cls in classes(family.op, variants):
        members = [(a, family.dtype) for a in cls[1:]]
        members += [(a, d) for d in plan.shared.get(family.dtype, ()) for a in cls]
        out.append(Series(family, cls[0], members))
    return out


def spread(items: list) -> list:
    """``items`` reordered so every prefix covers the range evenly: middle, ends, then largest gaps."""
    n = len(items)
    if n <= 2:
        return list(items)
    chosen = [n // 2]
    while len(chosen) < n:
        rest = (i for i in range(n) if i not in chosen)
        chosen.append(max(rest, key=lambda i: (min(abs(i - c) for c in chosen), -i)))
    return [items[i] for i in chosen]


# ----------------------------------------------------------------------------- the decision rule


def _host_samples(p: Point) -> dict[str, float]:
    """Host costs the host clock took (not an estimate, not a drained queue's, which waited on the GPU)."""
    skip = set(p.get("drained", [])) | estimated(p)
    return {n: v for n, v in p.get("host_us_measured", p["host_us"]).items() if n not in skip}


def series_host(points: list[Point]) -> dict[str, float]:
    """Each entry's median host sample over ``points``: a call's host cost does not grow with M, and one
    sample swung 0.7-2.4x between two runs at the same point (p10-p90) where GPU times
    agreed within 1%."""
    samples: dict[str, list[float]] = {}
    for p in points:
        for n, v in _host_samples(p).items():
            samples.setdefault(n, []).append(v)
    return {n: statistics.median(v) for n, v in samples.items()}


def pool_host(entries: list[EntryRecord]) -> None:
    """Every point's host costs := its family's medians (op, mode, dropout, class ``measured_as``: a class
    changes the host path, PyTorch's add + RMSNorm 90 us a call, add + LayerNorm 23 on the H100; series
    medians moved 15% (median) to 1.8x (p90) between two runs, family medians 3.9%). The clock's reading
    stays in ``host_us_measured``. GPU clocks only: on a CPU both are wall time."""
    family = lambda e: (e["op"], e["mode"], e.get("dropout", False), e.get("measured_as"))  # noqa: E731
    samples: dict[tuple, list[Point]] = {}
    for e in entries:
        if variant_of(e) == e.get("measured_as") and "measured_dtype" not in e:
            samples.setdefault(family(e), []).extend(e["points"] + e.get("held_out", []))
    medians = {k: series_host(v) for k, v in samples.items()}
    for e in entries:
        med = medians.get(family(e), {})
        for p in e["points"] + e.get("held_out", []):
            own = _host_samples(p)
            p.setdefault("host_us_measured", dict(p["host_us"]))
            p["host_us"].update({n: float(f"{med[n]:.4g}") for n in own if n in med})


def compiling() -> frozenset[str]:
    """Backends that compile per kind of call: a capture never runs them (they would compile inside it)."""
    return frozenset(n for n, b in backends().items() if b.compiles)


def gpu_winner(point: Point, order: tuple[str, ...] = PREFERENCE) -> str:
    """The winner by GPU time among the backends a capture may run (over every backend it named inductor
    at 28 of 751 points, where ``select.capture_pick`` then fell back to the cost pick)."""
    c = costs(point)
    pool = [n for n in c if n not in compiling()] or list(c)
    return rank({n: point["gpu_us"][n] for n in pool}, order)[0]


def runs(
    points: list[Point], by_clock: bool = False, order: tuple[str, ...] = PREFERENCE, by_gpu: bool = False
) -> list[tuple[str, list[Point]]]:
    """Consecutive points (by M) with one winner (``by_gpu``: by GPU time alone; ``by_clock``: also one
    binding clock and one GPU winner)."""

    def key(p: Point) -> tuple:
        if by_gpu:
            return (gpu_winner(p, order),)
        w = winner(p, order)
        return (w, bound(p, w), gpu_winner(p, order)) if by_clock else (w,)

    out: list[tuple[tuple, list[Point]]] = []
    for p in sorted((p for p in points if costs(p)), key=lambda p: p["m"]):
        k = key(p)
        if out and out[-1][0] == k:
            out[-1][1].append(p)
        else:
            out.append((k, [p]))
    return [(k[0], pts) for k, pts in out]


def segment(
    m_from: int, name: str, points: list[Point], order: tuple[str, ...] = PREFERENCE
) -> SegmentRecord:
    """A segment won by ``name`` over ``points``; its numbers come from the closest call among them."""

    def margin(p: Point) -> float:
        others = [v for n, v in costs(p).items() if n != name]
        return min(others) / costs(p)[name] - 1 if others else math.inf

    tight = min(points, key=margin)
    ranked = rank(costs(tight), order)
    runner = ranked[1] if len(ranked) > 1 else None
    gpu, host = tight["gpu_us"], tight["host_us"]
    base = [p for p in points if BASELINE in p["gpu_us"] and BASELINE in p["host_us"]]
    speedups = [max(p["gpu_us"][BASELINE], p["host_us"][BASELINE]) / costs(p)[name] for p in base]
    errors = [p["err"][name] for p in points if name in p.get("err", {})]
    shown = [n for n in (name, runner) if n]
    seg: SegmentRecord = {
        "m_from": m_from, "backend": name, "runner_up": runner,
        "margin": round(margin(tight), 4) if runner else None,
        "speedup": round(min(speedups), 4) if speedups else None,  # the segment's worst
        "m": tight["m"], "clock": bound(tight, name), "gpu_backend": gpu_winner(tight, order),
        "gpu_us": {n: gpu[n] for n in shown}, "host_us": {n: host[n] for n in shown},
    }  # fmt: skip
    if tight in base:
        seg["pytorch_us"] = {"gpu": gpu[BASELINE], "host": host[BASELINE]}
    seg["errors"] = {name: max(errors)} if errors else {}
    return seg


def fit(points: list[Point], order: tuple[str, ...] = PREFERENCE) -> list[SegmentRecord]:
    """Segments along M, a new one where the winner, its binding clock or the GPU winner changes, from
    the geometric middle of the bracketing points, or where plain PyTorch wins one of them it keeps the
    whole gap (a quick CPU run's guess at 8 between PyTorch's 4 and inductor's 16 read 1.23x PyTorch)."""
    segments, prev, last = [], 0, None  # type: list[SegmentRecord], int, Optional[str]
    for name, pts in runs(points, by_clock=True, order=order):
        m_from, first = max(prev + 1, math.ceil(math.sqrt(prev * pts[0]["m"]))), pts[0]["m"]
        if BASELINE in (last, name) and name != last and segments:
            m_from = first if last == BASELINE else prev + 1
        segments.append(segment(1 if not segments else m_from, name, pts, order))
        prev, last = pts[-1]["m"], name
    return segments


# ----------------------------------------------------------------------------- where to measure

PRUNE = 0.3  # timed at two or more points and this much dearer than the cheapest at each: dropped
HOPELESS = 2.0  # more than this times the cheapest at a series' first point: dropped at once


def contenders(
    names: list[str], points: dict[int, Point], partial: frozenset[str] = frozenset()
) -> list[str]:
    """``names`` less the backends this series has seen lose clearly: PRUNE dearer than the cheapest at
    two or more points on cost and on GPU time (by cost alone triton left DeiT-small's 2048 x 1536 x 384
    gelu training, 41 us on the GPU against eager's 52), or, at the first point (the largest M),
    HOPELESS dearer with no lower host cost. Eager and the baseline are always timed; the cheapest is
    taken among backends serving every member (``partial`` aside: cuBLASLt's tanh-only GELU had pruned
    triton from the gelu cells sharing gelu_tanh's timings)."""
    host = series_host(list(points.values())) if len(points) > 1 else None
    bars = []  # per point: costs, GPU times, the cheapest cost and fastest GPU time among the rivals
    for p in points.values():
        c = costs(p, host)
        rivals = [n for n in c if n not in partial]
        if rivals:
            bars.append((c, p["gpu_us"], min(c[n] for n in rivals), min(p["gpu_us"][n] for n in rivals)))
    keep = []
    for name in names:
        seen = [p for p in points.values() if name in costs(p)]
        beaten = len(seen) >= 2 and all(
            c[name] > (1 + PRUNE) * cheapest and gpu[name] > (1 + PRUNE) * fastest
            for c, gpu, cheapest, fastest in bars
            if name in c
        )
        hopeless = len(seen) == 1 and _hopeless(name, seen[0], partial)
        if name in ("eager", BASELINE) or not (beaten or hopeless):
            keep.append(name)
    return keep


def _hopeless(name: str, p: Point, partial: frozenset[str] = frozenset()) -> bool:
    """HOPELESS dearer than the cheapest rival on cost and on GPU time, with no lower host cost (a single
    570 us host sample of a 270 us call once dropped the eventual winner from a whole series)."""
    c, gpu = costs(p), p["gpu_us"]
    rivals = [n for n in c if n not in partial]
    if not rivals:
        return False
    best = min(rivals, key=c.__getitem__)
    return (
        c[name] > HOPELESS * c[best]
        and gpu[name] > HOPELESS * min(gpu[n] for n in rivals)
        and p["host_us"][name] >= p["host_us"][best]
    )


def hopeless_in(points: list[Point], partial: frozenset[str] = frozenset()) -> set[str]:
    """Backends (never eager or the baseline) hopeless wherever timed: a class's first size drops them from
    the later ones."""
    timed = [p for p in points if costs(p)]
    names = {n for p in timed for n in costs(p)} - {"eager", BASELINE}
    return {n for n in names if all(_hopeless(n, p, partial) for p in timed if n in costs(p))}


def to_bisect(
    points: dict[int, Point], ratio: float, order: tuple[str, ...] = PREFERENCE, pooled: bool = False
) -> list[int]:
    """New M between neighbouring measured points whose winners (in the mode's ``order``) differ and that
    are still far apart; a multiple of 16 where one lies between (Triton specializes on divisibility by
    16: the kernels compiled ahead for the grid serve it). ``pooled`` (a GPU): winners by the series'
    median host costs, as the table decides by pooled ones; by each point's own, gpt2.up relu inference
    had cuBLASLt win at 4096 and 65536 and went unbisected, while pooled costs give eager 4096, and the
    held-out 8192 read cuBLASLt 1.41x faster than the table's eager."""
    ms = sorted(m for m, p in points.items() if costs(p))
    host = series_host(list(points.values())) if pooled else None
    pick = {m: rank(costs(points[m], host), order)[0] for m in ms}
    new = []
    for a, b in itertools.pairwise(ms):
        if pick[a] != pick[b] and b / a > ratio and b - a > 1:
            mid = round(math.sqrt(a * b))
            if mid > 16 and (a // 16 + 1) * 16 < b:
                mid = min(max(round(mid / 16) * 16, (a // 16 + 1) * 16), (b - 1) // 16 * 16)
            new.append(min(max(mid, a + 1), b - 1))
    return new


def held_out_ms(measured: list[int], cap: int, key: str) -> list[int]:
    """One token count for the self-check: a real-model token count or midpoint not measured."""
    mids = {round(math.sqrt(a * b)) for a, b in itertools.pairwise(measured)}
    pool = sorted(m for m in (set(shapes.TOKENS) | mids) - set(measured) if 1 <= m <= cap)
    return random.Random(key).sample(pool, min(1, len(pool)))
