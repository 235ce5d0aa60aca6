"""Memory in the end-to-end benchmarks (bench_e2e_llama): what a training forward keeps for backward, by
part of the model, and the largest batch that trains under a memory cap.

- ``saved_bytes``: the bytes autograd saves during ``forward()`` (saved_tensors_hooks), each storage
  once, parameters left out, credited to the innermost of the named modules running when it was saved.
  Two batch sizes apart, their difference is what a token keeps (``per_token``): what does not grow
  with the batch (the autocast casts of the weights among it) cancels.
- ``largest_batch``: doubling from a start until a batch fails (halving first where the start fails),
  then bisection, over a ``trial(batch) -> fits`` the caller gives; ``memory_cap`` bounds the caching
  allocator meanwhile (torch.cuda.set_per_process_memory_fraction), so a batch that would not fit in
  the cap raises out-of-memory (``is_oom``) instead. ``fits`` is such a trial (``TRIAL_STEPS`` training
  steps of a fresh model), ``fit`` the search for each config under the cap, with the target's line:
  a batch that fits patched where eager runs out of memory; ``print_fit`` its table.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Callable, Iterator, Optional, Sequence

import e2e_common
import torch
from tabulate import tabulate
from torch import nn

from dispatch import timing

TRIAL_STEPS = 2  # a batch fits when this many steps do (the first allocates AdamW's state)


def gib(n: int) -> float:
    return n / 2**30


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


def per_token(saved_at: Callable[[int], dict[str, int]], seq: int, layers: int) -> dict[str, float]:
    """Bytes a token keeps, per layer for each part and once for "other": ``saved_at(batch)``'s
    ``saved_bytes`` at batch 2 less those at batch 1 (what does not grow with the batch, the weight
    casts among it, cancels), over the ``seq`` tokens of a sequence and the ``layers``."""
    one, two = saved_at(1), saved_at(2)
    out = {}
    for part in sorted(set(one) | set(two)):
        grew = two.get(part, 0) - one.get(part, 0)
        out[part] = grew / seq / (1 if part == "other" else layers)
    return out


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
    index = device.index if device.index is not None else torch.cuda.current_device()  # the setter needs one
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    try:
        yield fraction
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def fits(
    build: Callable[[], tuple], batch: int, seq: int, backend: Optional[str], device
) -> tuple[bool, Optional[float]]:
    """(whether ``TRIAL_STEPS`` training steps at ``batch`` sequences of ``seq`` tokens fit, of a fresh
    (model, optimizer) from ``build()`` under ``backend``; their peak GiB where they did, on CUDA)."""
    cuda = device.type == "cuda"
    model = opt = None
    ok = False
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model, opt = build()
        x = torch.randint(0, e2e_common.CHAIN_VOCAB, (batch, seq + 1), device=device)
        with e2e_common.dispatch_backend(backend):
            for _ in range(TRIAL_STEPS):
                e2e_common.step(model, opt, x[:, :-1], x[:, 1:], device)
        timing.synchronize(device)
        ok = True
    except Exception as exc:
        if not is_oom(exc):
            raise
    finally:
        del model, opt
        e2e_common.release(device)
    return ok, gib(torch.cuda.max_memory_allocated()) if cuda and ok else None


def max_batch(
    name: str, trial: Callable[[int], tuple[bool, Optional[float]]], start: int, bound: int, seq: int
) -> dict:
    """The largest batch up to ``bound`` for which ``trial(batch)`` (``fits``' answer) holds, searched
    from ``start`` (``largest_batch``); every trial's peak GiB (None where it failed)."""
    trials: dict[int, Optional[float]] = {}

    def fit_one(batch: int) -> bool:
        ok, peak = trial(batch)
        trials[batch] = peak if ok else None
        print(f"{name} batch {batch}: {'fits' if ok else 'out of memory'}"
              + (f", peak {peak:.2f} GiB" if peak else ""), flush=True)  # fmt: skip
        return ok

    best, bounded = largest_batch(fit_one, start, bound)
    return {"config": name, "max_batch": best, "bounded": bounded, "tokens": best * seq,
            "peak_gib": trials.get(best), "trials": trials}  # fmt: skip


def fit(
    names: Sequence[str], trial: Callable[[str, int], tuple], device, cap_gib: float, start: int, bound: int,
    seq: int,
) -> dict:  # fmt: skip
    """``max_batch`` of each config in ``names`` (``trial(name, batch)``) within ``cap_gib`` GiB, and
    the target's line: each config fits a batch that eager cannot."""
    found = []
    with memory_cap(cap_gib, device) as cap:
        for name in names:
            skip = e2e_common.why_skipped(name, device)
            if skip:
                print(skip)
                continue
            where = f" in {cap_gib:g} GiB" if cap else ""
            print(f"--- the largest batch of {name}{where}", flush=True)
            found.append(max_batch(name, functools.partial(trial, name), start, bound, seq))
    by = {r["config"]: r for r in found}
    target = []
    if "eager" in by and len(by) > 1:
        e = by["eager"]
        for name, r in by.items():
            if name != "eager":
                ok = not e["bounded"] and r["max_batch"] > e["max_batch"]
                what = f"max batch {r['max_batch']} vs eager's {e['max_batch']}" + (
                    " (bound)" if r["bounded"] else ""
                )
                limit = f"cap {cap_gib:g} GiB" if cap else "no cap"
                target.append([f"{name} fits a batch eager cannot ({limit})", what, "PASS" if ok else "MISS"])
    return {"max_batch": found, "cap_gib": cap_gib if cap else None, "targets": target}


def print_fit(found: Sequence[dict], cap_gib: Optional[float], seq: int) -> None:
    """``fit``'s table: each config's largest batch, its tokens and peak, whether the bound stopped it."""
    cols = ["config", "max_batch", "tokens", "peak_gib", "bounded"]
    cap = f"in {cap_gib:g} GiB" if cap_gib else "(no cap)"
    print(f"\nthe largest batch of seq {seq} for {TRIAL_STEPS} training steps {cap}, each model alone")
    print(tabulate([[r.get(c) for c in cols] for r in found], headers=cols, floatfmt=".4g"))
