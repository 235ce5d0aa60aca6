"""Memory in the end-to-end benchmarks (bench_e2e_llama): what a training forward keeps for backward, by
part of the model, and the largest batch that trains under a memory cap.

- ``saved_bytes``: the bytes autograd saves during ``forward()`` (saved_tensors_hooks), each storage
  once, parameters left out, credited to the innermost of the named modules running when it was saved.
  Two batch sizes apart, their difference is what a token keeps: what does not grow with the batch (the
  autocast casts of the weights among it) cancels.
- ``largest_batch``: doubling from a start until a batch fails (halving first where the start fails),
  then bisection, over a ``trial(batch) -> fits`` the caller gives; ``memory_cap`` bounds the caching
  allocator meanwhile (torch.cuda.set_per_process_memory_fraction), so a batch that would not fit in
  the cap raises out-of-memory (``is_oom``) instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Callable, Iterator, Optional

import torch
from torch import nn


def saved_bytes(
    model: nn.Module, parts: dict[nn.Module, str], forward: Callable[[], object]
) -> dict[str, int]:
    """Bytes autograd keeps after ``forward()`` by the part (``parts``: module -> name; "other" outside
    them) that saved them; every storage once, ``model``'s parameters left out."""
    stack, handles = ["other"], []

    def enter(part: str, *_) -> None:
        stack.append(part)

    def leave(*_) -> None:  # a forward hook's return value would replace the module's output
        stack.pop()

    for module, part in parts.items():
        handles.append(module.register_forward_pre_hook(functools.partial(enter, part)))
        handles.append(module.register_forward_hook(leave))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), (stack[-1], storage.nbytes()))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kept = forward()
        del kept
    finally:
        for h in handles:
            h.remove()
    out: dict[str, int] = defaultdict(int)
    for part, n in seen.values():
        out[part] += n
    return dict(out)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def largest_batch(trial: Callable[[int], bool], start: int, bound: int) -> tuple[int, bool]:
    """(the largest batch up to ``bound`` for which ``trial`` holds, whether the bound stopped the
    search rather than a failure); 0 where not even batch 1 holds."""
    lo, hi, batch = 0, None, max(1, min(start, bound))
    while not trial(batch):  # the start does not fit: halve until one does
        hi, batch = batch, batch // 2
        if batch == 0:
            return 0, False
    lo = batch
    while hi is None and batch * 2 <= bound:
        batch *= 2
        lo, hi = (batch, None) if trial(batch) else (lo, batch)
    bounded = hi is None  # nothing failed: the answer is the bound's, not memory's
    hi = bound + 1 if hi is None else hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if trial(mid) else (lo, mid)
    return lo, bounded


@contextlib.contextmanager
def memory_cap(gib: float, device: torch.device) -> Iterator[Optional[float]]:
    """Within the block the caching allocator of ``device`` holds at most ``gib`` GiB; yields the
    fraction of the device's memory that is, or None (no cap: the CPU, or ``gib`` 0)."""
    if device.type != "cuda" or not gib:
        yield None
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield fraction
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
