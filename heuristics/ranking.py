"""The rule that ranks backends at a measured point, which fills a table's segments and which the table
printer reads its speedups by.

A call costs ``max(gpu_us, host_us)`` (the host enqueues while the GPU runs, so the slower clock sets
the pace); ties within NOISE go to the first backend in the mode's ``preference``. Plain PyTorch
(BASELINE) is timed at every point for the speedups and never chosen.
"""

from __future__ import annotations

from typing import Optional

# The clock's own spread: eager and plain PyTorch on the same kernels read 0.949-1.045x of each other
# (held out, H200, 2026-12-03). At 5% instead of 3% two calibrations agreed on 95.7% of 4554 cells, not
# 94.1%; 88 of 7164 point decisions moved to the preferred backend at a median 3.6% more cost.
NOISE = 0.05
PREFERENCE = ("eager", "cublaslt", "triton", "inductor", "nvfuser")  # the reference, then least compiling
# Without autograd cuBLASLt's epilogue saves eager's activation pass: bf16 GPU time 0.61-1.006x eager's
# (101 points, 12-03), host cost alike. Training keeps eager first: cuBLASLt's Python Function costs 1.47x.
PREFERENCE_INFERENCE = ("cublaslt", "eager", "triton", "inductor", "nvfuser")
BASELINE = "pytorch"  # F.dropout(act(x + b), p) / act(F.linear(x, w, b)): what a user writes


def costs(point: dict, host: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Each backend's max(gpu_us, host_us) at a point (``host`` overrides its host costs); no baseline."""
    gpu, host = point.get("gpu_us", {}), {**point.get("host_us", {}), **(host or {})}
    return {n: max(gpu[n], host[n]) for n in gpu if n in host and n != BASELINE}


def estimated(p: dict) -> set[str]:
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


def winner(point: dict, order: tuple[str, ...] = PREFERENCE) -> Optional[str]:
    c = costs(point)
    return rank(c, order)[0] if c else None


def bound(point: dict, name: str) -> str:
    """The clock that bound ``name`` at ``point``: "host" where its host cost exceeds its GPU time."""
    return "host" if point["host_us"][name] > point["gpu_us"][name] else "gpu"
