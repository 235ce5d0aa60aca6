"""What ``python -m dispatch.calibrate`` measures (grids, activation classes) and how a series of
measured points becomes crossover segments (the winner rule with its noise tie-break)."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from dispatch.contracts import shapes

# Preference order, simpler first, breaks ties inside measurement noise so tables are stable from run
# to run: eager is the reference (nothing compiled); cuBLASLt is a vendor library call (no JIT); triton
# is our own JIT kernels (one compile per config, cached on disk); inductor adds torch.compile guards
# and recompiles; nvfuser stacks TorchScript profiling runs on functorch, the most moving parts.
PREFERENCE = ("eager", "cublaslt", "triton", "inductor", "nvfuser")
NOISE = 0.03  # relative timing differences below this are ties (do_bench medians repeat within ~1-2%)
MODES = ("inference", "training")

# Activations assumed to cost the same, measured once as the first name of each class: in a pointwise
# pass the cheap branches (max, scale, square) all hide under the memory traffic, and erf/tanh/exp
# variants cost alike. fused_linear keeps identity apart (no pre-activation saved, no activation
# gradient), and its cheap activations apart from the transcendental ones: its eager, nvfuser and
# inductor backends run the activation and its gradient as separate elementwise passes, which cost
# 2x more for gelu_tanh than for relu in bf16 training at GPT-2 sizes (0.81 vs 1.75 ms at 8192 x 3072 x
# 768 on the H200; gelu_tanh used to share relu's timings and the table sent GPT-2's c_fc to eager).
# (Eager's share of that gap was its float32 composite of gelu_tanh's gradient; it now runs
# PyTorch's own kernels, one pass each way, not yet measured against the classes.)
# The first name of a class is served by every backend that serves a member (cuBLASLt's epilogues
# cover relu and gelu_tanh only), so every member's backends are timed; a member keeps the timings of
# the backends that serve it. --probe checks the classes: every activation is timed at one shape and a
# member whose times differ from its representative's by more than 2 * NOISE (or with another winner)
# is measured on its own. Full runs parity-check every member at every measured point after all
# representatives are measured.
CLASSES: dict[str, tuple[tuple[str, ...], ...]] = {
    "bias_act_dropout": (("relu", "identity", "leaky_relu", "squared_relu"), ("gelu", "gelu_tanh", "silu")),
    "fused_linear": (("identity",), ("relu", "leaky_relu", "squared_relu"), ("gelu_tanh", "gelu", "silu")),
}


# The feature sizes of a full run: real-model sizes spread over the range. Every one of
# dispatch.contracts.shapes' 14 hidden/MLP sizes and 18 (N, K) pairs with 3 dtypes, 2 modes and
# dropout on/off is ~550 series, ~35 min on the H200 host; five sizes per op (210 series) did not fit
# in 10 min either (34 series in the 315 s the series phase had, 4-24 s each), so a full run measures
# three per op, small, middle and large. Lookup between measured sizes takes the nearest one; the
# self-check's held-out points include unmeasured real-model sizes, so what that costs is measured,
# not assumed.
FULL_FEATURES = (768, 4096, 14336)  # GPT-2/BERT hidden, LLaMA-2/3-8B hidden, LLaMA-3-8B/Mistral MLP
FULL_LINEAR = (  # (N, K) = (out, in)
    (3072, 768),  # GPT-2 / BERT / ViT-B up
    (11008, 4096),  # LLaMA-2-7B up
    (4096, 14336),  # LLaMA-3-8B / Mistral-7B down
)


@dataclass
class Plan:
    device: torch.device
    quick: bool
    dtypes: tuple[torch.dtype, ...]
    features: dict[str, list[tuple[int, ...]]]  # op -> feature sizes, in measuring order
    tokens: tuple[int, ...]  # the coarse grid of M; bisection adds points between
    ratio: float  # bisect while neighbouring points with different winners are further apart than this
    max_elements: int  # M * N cap for bias_act_dropout points
    max_macs: int  # M * N * K cap for fused_linear points
    held_out: int  # points per series measured for the self-check only
    held_out_sizes: int  # per series, real-model feature sizes not measured, one point each (self-check)
    probe: bool  # check the activation classes by timing every activation once (--probe)
    budget_s: float

    def m_cap(self, op: str, features: tuple[int, ...]) -> int:
        cap = self.max_elements if op == "bias_act_dropout" else self.max_macs
        m = 2 ** max(0, math.floor(math.log2(max(cap // math.prod(features), 1))))
        return min(m, max(self.tokens))

    def grid(self, op: str, features: tuple[int, ...]) -> list[int]:
        cap = self.m_cap(op, features)
        return sorted({t for t in self.tokens if t < cap} | {cap})


def default_plan(device: torch.device, quick: bool, budget: Optional[float]) -> Plan:
    """The grids. Caps bound a point's cost: on GPU 2**28 elements (a 0.5 GiB bf16 tensor, ~0.3 ms per
    pass at H200 bandwidth) and 2**38 multiply-adds (~1 ms in bf16); on CPU far less (eager dropout
    training took 3.6 s at 1024x3072 on 2 busy cores). Beyond its cap an entry's last segment holds."""
    gpu = device.type == "cuda"
    if quick:
        return Plan(
            device=device,
            quick=True,
            dtypes=(torch.bfloat16,) if gpu else (torch.float32,),
            features={
                "bias_act_dropout": [(4096,), (1024,), (14336,)] if gpu else [(3072,), (768,)],
                "fused_linear": [(11008, 4096), (3072, 768), (4096, 14336)]
                if gpu
                else [(3072, 768), (768, 3072)],
            },
            tokens=(1, 64, 4096, 65536) if gpu else (1, 16, 256),
            ratio=4.0,
            max_elements=2**28 if gpu else 2**18,
            max_macs=2**38 if gpu else 2**28,
            held_out=1,
            held_out_sizes=0,
            probe=False,
            budget_s=budget if budget is not None else 90.0,
        )
    return Plan(
        device=device,
        quick=False,
        dtypes=(torch.bfloat16, torch.float16, torch.float32) if gpu else (torch.float32, torch.bfloat16),
        features={
            "bias_act_dropout": spread([(n,) for n in FULL_FEATURES]),
            "fused_linear": spread(list(FULL_LINEAR)),
        },
        tokens=(1, 16, 256, 4096, 65536) if gpu else (1, 16, 256, 4096),
        ratio=2.0,  # bisect until neighbours are within 2x in M: near a crossover the two are near-tied
        max_elements=2**28 if gpu else 2**24,
        max_macs=2**38 if gpu else 2**32,
        held_out=1,
        held_out_sizes=1,
        probe=False,
        budget_s=budget if budget is not None else 540.0,
    )


def spread(items: list) -> list:
    """``items`` reordered so every prefix covers the range evenly (middle, ends, then the largest gaps):
    a run stopped by its budget still has sizes across the whole range, and lookup uses the nearest."""
    n = len(items)
    if n <= 2:
        return list(items)
    chosen = [n // 2]
    while len(chosen) < n:
        chosen.append(
            max((i for i in range(n) if i not in chosen), key=lambda i: (min(abs(i - c) for c in chosen), -i))
        )
    return [items[i] for i in chosen]


def servers(op: str, activation: str) -> frozenset[str]:
    """The backends that declare ``activation`` for ``op``."""
    from dispatch.registry import backends

    return frozenset(n for n, b in backends().items() if op in b.ops and activation in b.activations)


def classes(op: str, activations: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The static classes of ``op`` restricted to ``activations``; the first name is measured. The
    representative is the selected member served by the most backends; a member served by a backend
    that does not serve the representative is measured on its own (its backends would go untimed)."""
    listed = {a for cls in CLASSES[op] for a in cls}
    out: list[tuple[str, ...]] = []
    for cls in [*CLASSES[op], *((a,) for a in activations if a not in listed)]:
        chosen = [a for a in cls if a in activations]
        if not chosen:
            continue
        rep = max(chosen, key=lambda a: len(servers(op, a)))  # the first of equals: the listed order
        shared = [a for a in chosen if a != rep and servers(op, a) <= servers(op, rep)]
        out.append((rep, *shared))
        out.extend((a,) for a in chosen if a != rep and a not in shared)
    return out


@dataclass
class Series:
    """One measured activation (``rep``) of one key family and the activations sharing its timings."""

    op: str
    dtype: torch.dtype
    mode: str
    dropout: bool
    rep: str
    members: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        shared = f"+{len(self.members)}" if self.members else ""
        drop = " dropout" if self.dropout else ""
        return f"{self.op} {str(self.dtype)[6:]} {self.rep}{shared} {self.mode}{drop}"


# ----------------------------------------------------------------------------- points -> segments


def rank(ms: dict[str, float]) -> list[str]:
    """Backends best first: among those within NOISE of the fastest the preferred one wins, the rest
    follow by time."""
    best = min(ms.values())
    pref = {b: (PREFERENCE.index(b) if b in PREFERENCE else len(PREFERENCE), b) for b in ms}
    winner = min((b for b in ms if ms[b] <= best * (1 + NOISE)), key=pref.__getitem__)
    return [winner] + sorted((b for b in ms if b != winner), key=lambda b: (ms[b], pref[b]))


PRUNE = 0.3  # a backend this much slower than the fastest at two or more points of a series is dropped
HOPELESS = 2.0  # a backend more than this times the fastest at a series' first point is dropped at once


def contenders(
    names: list[str], points: dict[int, dict], prune: float = PRUNE, hopeless: float = HOPELESS
) -> list[str]:
    """``names`` less the backends a series has already seen lose clearly: timed at two or more of its
    points and slower than that point's fastest by more than ``prune`` at every one, or timed at one
    point only and slower there than ``hopeless`` times the fastest. eager stays (the speedups are
    over it). The series' later points (the rest of the grid, the bisection) then time only the
    contenders; held-out points time everyone (but the family's drops, ``hopeless_in``), so the
    self-check sees what pruning missed.
    Series measure their grid's largest M first, then its middle, then the rest: the first point is
    where host overhead weighs least, so a backend that loses there by 2x does not win at smaller M
    (host overhead only grows in weight), and the first two points are far apart in M.
    On the H200 this drops, e.g., the traced-Philox dropout of nvfuser and inductor (7-200x triton's
    time) after the first point; nvfuser recompiles at every new M in the measuring process (its
    TorchScript caches cannot be filled ahead by the workers), 1-3 s a point on the H200 host."""
    keep = []
    for name in names:
        seen = [p["ms"] for p in points.values() if name in p["ms"]]
        beaten = len(seen) >= 2 and all(ms[name] > (1 + prune) * min(ms.values()) for ms in seen)
        lost = len(seen) == 1 and seen[0][name] > hopeless * min(seen[0].values())
        if name == "eager" or not (beaten or lost):
            keep.append(name)
    return keep


def hopeless_in(points: list[dict], hopeless: float = HOPELESS) -> set[str]:
    """The backends (never eager) slower than ``hopeless`` times the fastest at every point of
    ``points`` where they were timed. A family's first series (one feature size) drops these from the
    family's later series, held-out points included: they cost their first calls (nvfuser's per-shape
    TorchScript compiles: 60 of the 159 s of series in an H200 refresh of bias_act_dropout training
    were nvfuser's and inductor's timings in later series of the dropout families, where they lose
    by 7-200x). Checked on that refresh's table: no backend hopeless at every point of one feature
    size of a family wins anywhere at another size of it."""
    timed = [p["ms"] for p in points if p["ms"]]
    names = {n for ms in timed for n in ms} - {"eager"}
    return {n for n in names if all(ms[n] > hopeless * min(ms.values()) for ms in timed if n in ms)}


def to_bisect(points: dict[int, dict], ratio: float) -> list[int]:
    """New M between neighbouring measured points whose winners differ and that are still far apart."""
    ms = sorted(m for m, p in points.items() if p["ms"])
    new = []
    for a, b in itertools.pairwise(ms):
        if rank(points[a]["ms"])[0] != rank(points[b]["ms"])[0] and b / a > ratio and b - a > 1:
            mid = round(math.sqrt(a * b))
            # a multiple of 16 where one lies between: Triton specializes integer arguments on
            # divisibility by 16, so the grid's kernels (compiled ahead in the workers) serve it
            # instead of a compile in the measuring process; real token counts mostly are anyway
            if mid > 16 and (a // 16 + 1) * 16 < b:
                mid = min(max(round(mid / 16) * 16, (a // 16 + 1) * 16), (b - 1) // 16 * 16)
            new.append(min(max(mid, a + 1), b - 1))
    return new


def fit(points: list[dict]) -> list[dict]:
    """Segments along M from measured points: a new segment where the winner changes, starting at the
    geometric middle of the two points that bracket the crossover."""
    segments: list[dict] = []
    prev = 0
    for pt in sorted(points, key=lambda p: p["m"]):
        ms = pt["ms"]
        if not ms:
            continue
        order = rank(ms)
        winner, runner = order[0], (order[1] if len(order) > 1 else None)
        margin = round(ms[runner] / ms[winner] - 1, 4) if runner else None
        speedup = round(ms["eager"] / ms[winner], 4) if "eager" in ms else None
        errors = {b: e for b, e in pt.get("err", {}).items() if b in ms}
        if segments and segments[-1]["backend"] == winner:
            seg = segments[-1]
            if margin is not None and (seg["margin"] is None or margin < seg["margin"]):
                seg["margin"], seg["runner_up"] = margin, runner
            if speedup is not None and (seg["speedup"] is None or speedup < seg["speedup"]):
                seg["speedup"] = speedup
            for b, e in errors.items():
                seg["errors"][b] = max(e, seg["errors"].get(b, 0.0))
        else:
            m_from = 1 if not segments else max(prev + 1, math.ceil(math.sqrt(prev * pt["m"])))
            segments.append(
                {
                    "m_from": m_from,
                    "backend": winner,
                    "runner_up": runner,
                    "margin": margin,
                    "speedup": speedup,
                    "errors": dict(errors),
                }
            )
        prev = pt["m"]
    return segments


def all_features(op: str) -> list[tuple[int, ...]]:
    """Every real-model feature size of ``op`` (dispatch.contracts.shapes)."""
    return [(n,) for n in shapes.feature_sizes()] if op == "bias_act_dropout" else shapes.linear_shapes()


def held_out_sizes(plan: Plan, s: Series) -> list[tuple[tuple[int, ...], int]]:
    """(features, M) for the self-check at real-model sizes the plan does not measure, chosen at random
    with the series' label as the seed (the warm-up and the run agree on them)."""
    measured = set(plan.features.get(s.op, []))
    pool = [f for f in all_features(s.op) if f not in measured]
    rnd = random.Random(s.label)
    out = []
    for features in rnd.sample(pool, min(plan.held_out_sizes, len(pool))):
        out.append((features, rnd.choice([t for t in shapes.TOKENS if t <= plan.m_cap(s.op, features)])))
    return out


def held_out_ms(measured: list[int], cap: int, count: int, key: str) -> list[int]:
    """Token counts for the self-check: real-model token counts and midpoints not measured for the fit."""
    mids = {round(math.sqrt(a * b)) for a, b in itertools.pairwise(measured)}
    pool = sorted((set(shapes.TOKENS) | mids) - set(measured))
    pool = [m for m in pool if 1 <= m <= cap]
    return sorted(random.Random(key).sample(pool, min(count, len(pool))))
