"""The rule that ranks backends at a measured point, which fills a table's segments and which the table
printer reads its speedups by.

A call costs ``max(gpu_us, host_us)`` (the host enqueues while the GPU runs, so the slower clock sets
the pace); ties within NOISE go to the first backend in the mode's ``preference``. Plain PyTorch
(BASELINE) is timed at every point as the composite a user writes, called directly: a contender like
every backend, first in both orders, and the floor of the speedups (a cell it wins reads 1.00x).
"""

from __future__ import annotations

from typing import Optional

from dispatch.heuristics.schema import Point

# The clock's own spread: eager and plain PyTorch on the same kernels read 0.949-1.045x of each other.
NOISE = 0.05
BASELINE = "pytorch"  # F.dropout(act(x + b), p) / act(F.linear(x, w, b)): what a user writes
# Plain PyTorch first: within NOISE the call runs what its user wrote (no surprise); then the reference,
# then the least compiling (composed compiles only where its sub-calls do).
PREFERENCE = (BASELINE, "eager", "cublaslt", "triton", "composed", "inductor", "nvfuser")
# Without autograd cuBLASLt's epilogue saves eager's activation pass (bf16 GPU time 0.61-1.006x eager's,
# host cost alike). Training keeps eager before it: cuBLASLt's Python Function costs 1.47x.
PREFERENCE_INFERENCE = (BASELINE, "cublaslt", "eager", "triton", "composed", "inductor", "nvfuser")


def costs(point: Point, host: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Each contender's max(gpu_us, host_us) at a point (``host`` overrides its host costs): every timed
    backend, plain PyTorch included, but one the point rejected (plain PyTorch keeps its timings there
    for the speedups when its parity check fails)."""
    gpu, host = point.get("gpu_us", {}), {**point.get("host_us", {}), **(host or {})}
    out = point.get("rejected", {})
    return {n: max(gpu[n], host[n]) for n in gpu if n in host and n not in out}


def estimated(p: Point) -> set[str]:
    """The entries a point holds at their estimate (hopeless there, not timed in rounds)."""
    return {n for n, how in p.get("gpu_clock", {}).items() if how == "estimate"}


def preference(mode: str) -> tuple[str, ...]:
    return PREFERENCE_INFERENCE if mode == "inference" else PREFERENCE


def rank(values: dict[str, float], order: tuple[str, ...] = PREFERENCE) -> list[str]:
    """Names best first: among those within NOISE of the smallest the first in ``order`` wins."""
    best = min(values.values())
    pref = {n: (order.index(n) if n in order else len(order), n) for n in values}
    winner = min((n for n in values if values[n] <= best * (1 + NOISE)), key=pref.__getitem__)
    return [winner] + sorted((n for n in values if n != winner), key=lambda n: (values[n], pref[n]))


def winner(point: Point, order: tuple[str, ...] = PREFERENCE) -> Optional[str]:
    c = costs(point)
    return rank(c, order)[0] if c else None


def bound(point: Point, name: str) -> str:
    """The clock that bound ``name`` at ``point``: "host" where its host cost exceeds its GPU time."""
    return "host" if point["host_us"][name] > point["gpu_us"][name] else "gpu"
