"""What ``python -m dispatch.calibrate`` measures, in which order, and the rule that turns measured
points into a table's segments.

The decision rule: a call run eagerly costs ``max(gpu_us, host_us)``: the host enqueues kernels while
the GPU runs earlier ones, so whichever of the two is slower sets the pace. Segments are won by that
cost; ties within NOISE go to the backend first in the mode's order (``preference``). Each segment
also records the winner by GPU time alone (``gpu_backend``: what a CUDA graph or a host far ahead
would see), which clock bound the winner, and its speedup over plain PyTorch (BASELINE, timed at
every point, never chosen).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from dispatch.contracts import shapes

# Backends within 5% of the cheapest are tied: the preferred one wins. 5% is the clock's own spread:
# eager and plain PyTorch, running the same kernels, read 0.949-1.035x and 0.978-1.045x of each other in
# held-out runs (H200, 2026-12-03). Refitting the 12-03 and 12-02 calibrations at 5% instead of 3% took
# their agreement from 94.1% to 95.7% of 4554 choice cells, left both self-checks and all 90 held-out
# picks as they were, and moved 88 of 7164 point decisions to the preferred backend, at a median 3.6%
# (max 4.9%) more cost there.
NOISE = 0.05
# ties go to the reference first, then to the backends that compile least
PREFERENCE = ("eager", "cublaslt", "triton", "inductor", "nvfuser")
# Without autograd cuBLASLt's epilogue runs the activation in the GEMM: one M x N pass less than eager's
# F.linear + act. In the 2026-12-03 H200 calibration its bf16 GPU time was 0.61-1.006x eager's (median
# 0.846, 101 points) and its host cost the same (median ratio 0.99), so a tie is noise around a call that
# moves fewer bytes: it goes to cuBLASLt. (Eager first, OPT-13B's relu up projection at M = 2048, held
# out, ran eager 1.15x slower than cuBLASLt.) Training keeps eager first: cuBLASLt's training path is a
# Python autograd Function, 1.47x eager's host cost (median).
PREFERENCE_INFERENCE = ("cublaslt", "eager", "triton", "inductor", "nvfuser")

BASELINE = "pytorch"  # F.dropout(act(x + b), p) / act(F.linear(x, w, b)): what a user writes
MODES = ("inference", "training")
# Families in priority order (what real models run most: training, then serving). The run always serves
# the family furthest behind its share of the budget, so the order only breaks ties.
FAMILY_ORDER = (
    ("training", "bias_act_dropout", True),
    ("training", "fused_linear", False),
    ("inference", "fused_linear", False),
    ("inference", "bias_act_dropout", False),
    ("training", "bias_act_dropout", False),
    ("inference", "bias_act_dropout", True),
)

# Activations of a class share one measured timing and are each parity-checked on their own. The first
# class is measured first: gelu for bias_act_dropout (GPT-2, BERT, ViT MLPs) and identity for
# fused_linear (every down and attention projection). fused_linear's relu is a class of its own: the
# triton and cublaslt backends keep its output for backward and run it in cuBLASLt's epilogue, 234 us
# against 256 for the same call keeping the pre-activation (gpt2 up 8192 x 3072 x 768 bf16 training,
# H200), the path every other activation takes on them.
CLASSES: dict[str, tuple[tuple[str, ...], ...]] = {
    "bias_act_dropout": (("gelu", "gelu_tanh", "silu"), ("relu", "identity", "leaky_relu", "squared_relu")),
    "fused_linear": (("identity",), ("gelu_tanh", "gelu", "silu", "leaky_relu", "squared_relu"), ("relu",)),
}
# float16 shares bfloat16's timings on a GPU (each of its cells parity-checked in float16): the same
# kernels at the same width; in the 2026-11-30 H200 table the two agreed in 1126 of 1134 cells.
SHARED_DTYPES = {torch.bfloat16: (torch.float16,)}

# Feature sizes in priority order (a run stopped by its budget has the first ones): N for
# bias_act_dropout, (N, K) = (out, in) for fused_linear. N spans 512-28672 and K 384-14336.
FEATURES = {
    "bias_act_dropout": [(3072,), (768,), (4096,), (14336,), (28672,)],  # GPT-2 MLP and hidden, LLaMA
    "fused_linear": [
        (3072, 768),  # GPT-2 / BERT / ViT-B up
        (11008, 4096),  # LLaMA-2-7B up
        (768, 3072),  # GPT-2 / BERT / ViT-B down
        (4096, 14336),  # LLaMA-3-8B / Mistral-7B down
        (28672, 8192),  # LLaMA-2/3-70B up
        (1536, 384),  # MiniLM / DeiT-S up
        # T5-small / BERT-medium down: the one N below 768, nearest to DeiT-S's 384 x 1536 down
        # projection, which had been extrapolated from GPT-2's 768 x 3072
        (512, 2048),
    ],
}
# On a GPU float32 takes the first three sizes (GPT-2 and LLaMA-7B widths): half-precision is what models
# train and serve in there, and the 70B widths in float32 run 1/8-1/15 of bf16's GEMM rate; the other
# sizes then take the nearest measured one. This leaves 124 series of 164.
FLOAT32_SIZES = 3
QUICK_FEATURES = {
    "cuda": {"bias_act_dropout": [(3072,), (4096,), (14336,)], "fused_linear": [(3072, 768), (11008, 4096)]},
    "cpu": {"bias_act_dropout": [(3072,), (768,)], "fused_linear": [(3072, 768), (768, 3072)]},
}


@dataclass
class Plan:
    device: torch.device
    quick: bool
    dtypes: tuple[torch.dtype, ...]  # measured; SHARED_DTYPES' members follow them (GPU only)
    shared: dict[torch.dtype, tuple[torch.dtype, ...]]
    features: dict[str, list[tuple[int, ...]]]
    tokens: tuple[int, ...]  # the coarse grid of M; bisection adds points between
    ratio: float  # bisect while neighbours with different winners are further apart than this in M
    max_elements: int  # M * N cap of a bias_act_dropout point
    max_macs: int  # M * N * K cap of a fused_linear point (bf16/fp16; float32 on a GPU gets 1/8)
    rounds: int  # interleaved timing rounds per point
    budget_s: float
    float32_sizes: int = 0  # float32 takes the first this many feature sizes (0: all of them)

    def sizes(self, op: str, dtype: torch.dtype) -> list[tuple[int, ...]]:
        sizes = self.features.get(op, [])
        return sizes[: self.float32_sizes] if dtype == torch.float32 and self.float32_sizes else sizes

    def m_cap(self, op: str, features: tuple[int, ...], dtype: torch.dtype) -> int:
        cap = self.max_elements if op == "bias_act_dropout" else self.max_macs
        if op == "fused_linear" and dtype == torch.float32 and self.device.type == "cuda":
            cap //= 8  # float32 GEMMs run at 1/8-1/15 of bf16's rate on an H200 (67 vs ~990 TFLOP/s)
        m = 2 ** max(0, math.floor(math.log2(max(cap // math.prod(features), 1))))
        return min(m, max(self.tokens))

    def grid(self, op: str, features: tuple[int, ...], dtype: torch.dtype) -> list[int]:
        cap = self.m_cap(op, features, dtype)
        return sorted({t for t in self.tokens if t < cap} | {cap})

    def check_cap(self, op: str, features: tuple[int, ...]) -> int:
        """The largest M a parity check runs at: the float64 reference and eager's dropout (the RNG spec
        in int64 tensor ops, 95 ms a call at 65536 x 4096) cost 10-100x the timed call."""
        per_row = math.prod(features)
        return max(1, (2**24 if op == "bias_act_dropout" else 2**34) // per_row)


def default_plan(device: torch.device, quick: bool, budget: Optional[float]) -> Plan:
    """On a GPU a point holds at most 2**28 elements (0.5 GiB in bf16, ~0.3 ms a pass) or 2**40
    multiply-adds (~2 ms forward in bf16, so 70B-wide layers reach M = 4096); on a CPU far less."""
    gpu = device.type == "cuda"
    if quick:
        return Plan(
            device, True, (torch.bfloat16,) if gpu else (torch.float32,), SHARED_DTYPES if gpu else {},
            QUICK_FEATURES["cuda" if gpu else "cpu"], (1, 64, 4096, 65536) if gpu else (1, 16, 256), 4.0,
            2**28 if gpu else 2**18, 2**40 if gpu else 2**28, 2 if gpu else 3,
            budget if budget is not None else (90.0 if gpu else 150.0),
        )  # fmt: skip
    return Plan(
        device, False, (torch.bfloat16, torch.float32) if gpu else (torch.float32, torch.bfloat16),
        SHARED_DTYPES if gpu else {}, FEATURES, (1, 16, 256, 4096, 65536) if gpu else (1, 16, 256, 4096),
        2.0, 2**28 if gpu else 2**22, 2**40 if gpu else 2**30, 3,
        budget if budget is not None else 560.0, FLOAT32_SIZES if gpu else 0,
    )  # fmt: skip


@dataclass(frozen=True)
class Family:
    """Calls that share a budget allotment: one op, measured dtype, mode and dropout setting."""

    op: str
    dtype: torch.dtype
    mode: str
    dropout: bool

    @property
    def label(self) -> str:
        return f"{self.op} {str(self.dtype)[6:]} {self.mode}{' dropout' if self.dropout else ''}"


@dataclass
class Series:
    """One measured activation (``rep``) of a family and the (activation, dtype) members sharing it."""

    family: Family
    rep: str
    members: list[tuple[str, torch.dtype]] = field(default_factory=list)

    @property
    def label(self) -> str:
        f = self.family
        return f"{f.op} {str(f.dtype)[6:]} {self.rep} {f.mode}{' dropout' if f.dropout else ''}"

    @property
    def partial(self) -> frozenset[str]:
        """Backends serving the representative but not every member's activation (``contenders``)."""
        op, rep = self.family.op, self.rep
        every = servers(op, rep).intersection(*(servers(op, a) for a, _ in self.members))
        return servers(op, rep) - every


def servers(op: str, activation: str) -> frozenset[str]:
    """The backends that declare ``activation`` for ``op``."""
    from dispatch.registry import backends

    return frozenset(n for n, b in backends().items() if op in b.ops and activation in b.activations)


def classes(op: str, activations: tuple[str, ...]) -> list[tuple[str, ...]]:
    """CLASSES of ``op`` restricted to ``activations``, each led by the member served by the most
    backends; a member served by a backend its representative lacks is measured alone (that backend's
    timings would be missing)."""
    listed = {a for cls in CLASSES[op] for a in cls}
    out: list[tuple[str, ...]] = []
    for cls in [*CLASSES[op], *((a,) for a in activations if a not in listed)]:
        chosen = [a for a in cls if a in activations]
        if not chosen:
            continue
        rep = max(chosen, key=lambda a: len(servers(op, a)))
        shared = [a for a in chosen if a != rep and servers(op, a) <= servers(op, rep)]
        out.append((rep, *shared))
        out.extend((a,) for a in chosen if a != rep and a not in shared)
    return out


def series_of(plan: Plan, family: Family, activations: tuple[str, ...]) -> list[Series]:
    out = []
    for cls in classes(family.op, activations):
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
        chosen.append(
            max((i for i in range(n) if i not in chosen), key=lambda i: (min(abs(i - c) for c in chosen), -i))
        )
    return [items[i] for i in chosen]


# ----------------------------------------------------------------------------- the decision rule


def costs(point: dict, host: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Each backend's cost at a point, max(gpu_us, host_us) (``host``: host costs to use instead of the
    point's); the baseline is no backend."""
    gpu, host = point.get("gpu_us", {}), {**point.get("host_us", {}), **(host or {})}
    return {n: max(gpu[n], host[n]) for n in gpu if n in host and n != BASELINE}


def estimated(p: dict) -> set[str]:
    """The entries a point holds at their estimate (hopeless there, not timed in rounds)."""
    return {n for n, how in p.get("gpu_clock", {}).items() if how == "estimate"}


def _host_samples(p: dict) -> dict[str, float]:
    """The point's host costs taken by the host clock (not a hopeless entry's estimate, not a drained
    queue's, which include waiting on the GPU)."""
    skip = set(p.get("drained", [])) | estimated(p)
    return {n: v for n, v in p.get("host_us_measured", p["host_us"]).items() if n not in skip}


def series_host(points: list[dict]) -> dict[str, float]:
    """Each entry's host cost over a series' points: the median of its samples. A call's host cost does
    not depend on M (launches, checks, autograd; the GPU runs behind), but one sample swings 0.7-2.4x
    between two runs at the same point on the H200's host (p10-p90, two full calibrations of
    2026-12-02), while GPU times agree within 1%: per-point host costs made 8% of the cells flip."""
    samples: dict[str, list[float]] = {}
    for p in points:
        for n, v in _host_samples(p).items():
            samples.setdefault(n, []).append(v)
    return {n: statistics.median(v) for n, v in samples.items()}


def smooth_host(points: list[dict]) -> None:
    """Sets each point's host costs to the series' medians (``series_host``), in place; what the clock
    read stays under ``host_us_measured``. GPU clocks only: on a CPU both clocks are one wall time,
    which grows with M."""
    med = series_host(points)
    for p in points:
        own = _host_samples(p)
        p.setdefault("host_us_measured", dict(p["host_us"]))
        for n in own:
            if n in med:
                p["host_us"][n] = float(f"{med[n]:.4g}")


def pool_host(entries: list[dict]) -> None:
    """Sets every point's host costs to its family's medians, in place: the median of each backend's
    samples over the measured series of one op, mode and dropout, whatever their dtype, activation and
    size (the host runs the same checks, launches and autograd for all of them). Series medians still
    moved 15% (median) to 1.8x (p90) against each other between two full H200 runs, and 9% of the choice
    cells with them; family medians leave 3.9% (refit-2026-12-03.log). GPU clocks only, as smooth_host."""
    family = lambda e: (e["op"], e["mode"], e["dropout"])  # noqa: E731
    samples: dict[tuple, list[dict]] = {}
    for e in entries:
        if e["activation"] == e["measured_as"] and "measured_dtype" not in e:  # a measured series
            samples.setdefault(family(e), []).extend(e["points"] + e.get("held_out", []))
    medians = {k: series_host(v) for k, v in samples.items()}
    for e in entries:
        med = medians.get(family(e), {})
        for p in e["points"] + e.get("held_out", []):
            own = _host_samples(p)
            p.setdefault("host_us_measured", dict(p["host_us"]))
            for n in own:
                if n in med:
                    p["host_us"][n] = float(f"{med[n]:.4g}")


def preference(mode: str) -> tuple[str, ...]:
    """The order ties go in for calls of ``mode``."""
    return PREFERENCE_INFERENCE if mode == "inference" else PREFERENCE


def rank(values: dict[str, float], order: tuple[str, ...] = PREFERENCE) -> list[str]:
    """Names best first: among those within NOISE of the smallest value the first in ``order`` wins,
    the rest follow by value."""
    best = min(values.values())
    pref = {n: (order.index(n) if n in order else len(order), n) for n in values}
    winner = min((n for n in values if values[n] <= best * (1 + NOISE)), key=pref.__getitem__)
    return [winner] + sorted((n for n in values if n != winner), key=lambda n: (values[n], pref[n]))


def winner(point: dict, order: tuple[str, ...] = PREFERENCE) -> Optional[str]:
    c = costs(point)
    return rank(c, order)[0] if c else None


def bound(point: dict, name: str) -> str:
    """Which clock sets ``name``'s cost at ``point``."""
    return "host" if point["host_us"][name] > point["gpu_us"][name] else "gpu"


def compiling() -> frozenset[str]:
    """The backends that compile per kind of call: a capture never picks them (``select.capture_pick``:
    their first call would compile inside it)."""
    from dispatch.registry import backends

    return frozenset(n for n, b in backends().items() if b.compiles)


def gpu_winner(point: dict, order: tuple[str, ...] = PREFERENCE) -> str:
    """The winner by GPU time alone among the backends with a cost at ``point`` that a capture may run:
    what a call captured in a CUDA graph should run (``gpu_backend``). Ranked over every backend it
    named inductor at 28 of 751 H200 points, where ``capture_pick`` then fell back to the cost pick."""
    c = costs(point)
    pool = [n for n in c if n not in compiling()] or list(c)
    return rank({n: point["gpu_us"][n] for n in pool}, order)[0]


def _grouped(points: list[dict], key: Callable[[dict], tuple]) -> list[tuple[tuple, list[dict]]]:
    """Consecutive points (by M, those with a cost) sharing one ``key``."""
    out: list[tuple[tuple, list[dict]]] = []
    for p in sorted((p for p in points if costs(p)), key=lambda p: p["m"]):
        k = key(p)
        if out and out[-1][0] == k:
            out[-1][1].append(p)
        else:
            out.append((k, [p]))
    return out


def gpu_runs(points: list[dict], order: tuple[str, ...] = PREFERENCE) -> list[tuple[str, list[dict]]]:
    """Consecutive points (by M) with one winner by GPU time alone."""
    return [(k[0], pts) for k, pts in _grouped(points, lambda p: (gpu_winner(p, order),))]


def runs(
    points: list[dict], by_clock: bool = False, order: tuple[str, ...] = PREFERENCE
) -> list[tuple[str, list[dict]]]:
    """Consecutive points (by M) with one winner (and, ``by_clock``, one clock binding it and one
    winner by GPU time alone)."""

    def key(p: dict) -> tuple:
        w = winner(p, order)
        return (w, bound(p, w), gpu_winner(p, order)) if by_clock else (w,)

    return [(k[0], pts) for k, pts in _grouped(points, key)]


def segment(m_from: int, name: str, points: list[dict], order: tuple[str, ...] = PREFERENCE) -> dict:
    """A segment won by ``name`` over ``points``; its numbers come from the closest call among them."""

    def margin(p: dict) -> float:
        c = costs(p)
        others = [v for n, v in c.items() if n != name]
        return min(others) / c[name] - 1 if others else math.inf

    tight = min(points, key=margin)
    c = costs(tight)
    ranked = rank(c, order)
    runner = ranked[1] if len(ranked) > 1 else None
    gpu, host = tight["gpu_us"], tight["host_us"]
    base = [p for p in points if BASELINE in p["gpu_us"] and BASELINE in p["host_us"]]
    speedups = [max(p["gpu_us"][BASELINE], p["host_us"][BASELINE]) / costs(p)[name] for p in base]
    errors = [p["err"][name] for p in points if name in p.get("err", {})]
    shown = [n for n in (name, runner) if n]
    seg = {
        "m_from": m_from, "backend": name, "runner_up": runner,
        "margin": round(margin(tight), 4) if runner else None,
        "speedup": round(min(speedups), 4) if speedups else None,
        "m": tight["m"], "clock": bound(tight, name),
        "gpu_backend": gpu_winner(tight, order),
        "gpu_us": {n: gpu[n] for n in shown}, "host_us": {n: host[n] for n in shown},
    }  # fmt: skip
    if tight in base:
        seg["pytorch_us"] = {"gpu": gpu[BASELINE], "host": host[BASELINE]}
    seg["errors"] = {name: max(errors)} if errors else {}
    return seg


def fit(points: list[dict], order: tuple[str, ...] = PREFERENCE) -> list[dict]:
    """Segments along M: a new one where the winner, the clock that binds it or the winner by GPU time
    alone changes, from the geometric middle of the two points that bracket the change (so explain()
    names the clock, and capture the backend, that held at every measured point of the segment)."""
    segments, prev = [], 0
    for name, pts in runs(points, by_clock=True, order=order):
        m_from = 1 if not segments else max(prev + 1, math.ceil(math.sqrt(prev * pts[0]["m"])))
        segments.append(segment(m_from, name, pts, order))
        prev = pts[-1]["m"]
    return segments


# ----------------------------------------------------------------------------- where to measure

PRUNE = 0.3  # timed at two or more points and this much dearer than the cheapest at each: dropped
HOPELESS = 2.0  # more than this times the cheapest at a series' first point: dropped at once


def contenders(names: list[str], points: dict[int, dict], partial: frozenset[str] = frozenset()) -> list[str]:
    """``names`` less the backends this series has seen lose clearly: dearer than the cheapest by PRUNE
    at two or more points, on its cost and on GPU time (a host-bound cell's captured pick is its GPU
    winner: pruning on cost alone dropped triton from DeiT-small's 2048 x 1536 x 384 gelu training,
    41 us on the GPU against eager's 52, for its 1.3x host cost), or, at the first point (the largest
    M, where host cost weighs least), by HOPELESS with a host cost no lower than the cheapest's, so
    that the smaller M where host cost weighs more cannot favour it. Eager, the reference, is always
    timed. The cheapest is taken among the backends that serve every member of the series (not
    ``partial``): cuBLASLt's tanh-only GELU epilogue, fastest at gelu_tanh, had pruned triton from the
    gelu and silu cells sharing those timings (it went untimed from M = 4096 on at 1536 x 384, where a
    held-out run read triton 1.085x faster than the eager pick at 12288 gelu inference, H200). (On the
    H200 this drops the traced-Philox dropout of nvfuser and inductor, 7-200x triton's time, after one
    point; nvfuser recompiles at each new M, 1-3 s a point.)"""
    keep = []
    host = series_host(list(points.values())) if len(points) > 1 else None
    # per point, once: smoothed costs, the cheapest cost and the fastest GPU time among the rivals
    bars = []
    for p in points.values():
        c = costs(p, host)
        rivals = [n for n in c if n not in partial]
        if rivals:
            bars.append((c, p["gpu_us"], min(c[n] for n in rivals), min(p["gpu_us"][n] for n in rivals)))
    for name in names:
        seen = [p for p in points.values() if name in costs(p)]
        beaten = len(seen) >= 2 and all(
            c[name] > (1 + PRUNE) * cheapest and gpu[name] > (1 + PRUNE) * fastest
            for c, gpu, cheapest, fastest in bars if name in c
        )
        hopeless = len(seen) == 1 and _hopeless(name, seen[0], partial)
        if name in ("eager", BASELINE) or not (beaten or hopeless):
            keep.append(name)
    return keep


def _hopeless(name: str, p: dict, partial: frozenset[str] = frozenset()) -> bool:
    """Dearer than the cheapest backend not in ``partial`` by HOPELESS on its cost and on GPU time
    alone, with no lower host cost: GPU times repeat within 1%, one host sample does not (a 570 us
    host sample of a 270 us call once dropped the eventual winner from a whole series)."""
    c, gpu = costs(p), p["gpu_us"]
    rivals = [n for n in c if n not in partial]
    if not rivals:
        return False
    best = min(rivals, key=c.__getitem__)
    fastest = min(gpu[n] for n in rivals)
    return (
        c[name] > HOPELESS * c[best]
        and gpu[name] > HOPELESS * fastest
        and p["host_us"][name] >= p["host_us"][best]
    )


def hopeless_in(points: list[dict], partial: frozenset[str] = frozenset()) -> set[str]:
    """Backends (never eager) hopeless at every point where they were timed: a series' first feature size
    drops them from its later sizes (they would cost their first calls again)."""
    timed = [p for p in points if costs(p)]
    names = {n for p in timed for n in costs(p)} - {"eager"}
    return {n for n in names if all(_hopeless(n, p, partial) for p in timed if n in costs(p))}


def to_bisect(points: dict[int, dict], ratio: float) -> list[int]:
    """New M between neighbouring measured points whose winners differ and that are still far apart."""
    ms = sorted(m for m, p in points.items() if costs(p))
    new = []
    for a, b in itertools.pairwise(ms):
        if winner(points[a]) != winner(points[b]) and b / a > ratio and b - a > 1:
            mid = round(math.sqrt(a * b))
            # a multiple of 16 where one lies between: Triton specializes integer arguments on
            # divisibility by 16, so the kernels compiled ahead for the grid serve it
            if mid > 16 and (a // 16 + 1) * 16 < b:
                mid = min(max(round(mid / 16) * 16, (a // 16 + 1) * 16), (b - 1) // 16 * 16)
            new.append(min(max(mid, a + 1), b - 1))
    return new


def held_out_ms(measured: list[int], cap: int, key: str) -> list[int]:
    """One token count for the self-check: a real-model token count or midpoint not measured."""
    mids = {round(math.sqrt(a * b)) for a, b in itertools.pairwise(measured)}
    pool = sorted(m for m in (set(shapes.TOKENS) | mids) - set(measured) if 1 <= m <= cap)
    return random.Random(key).sample(pool, min(1, len(pool)))
