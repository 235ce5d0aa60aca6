"""Paired timing: the entries of a comparison timed in adjacent slices, sample by sample, so that a
ratio between two of them cancels the drift of the GPU's clock and of the host (``times``, ``ratio``).
Nothing happens at import."""

from __future__ import annotations

import statistics
from typing import Callable, Mapping, Optional, Sequence

import torch

from dispatch.timing import Fn, back_to_back_ms, elapsed_ms, rotations, synchronize


def times(
    entries: Mapping[str, Fn], device: torch.device, *, gpu: bool, samples: int = 30, slice_ms: float = 2.0
) -> dict[str, list[float]]:
    """Per entry, ``samples`` times in milliseconds per call, taken in slices: sample i times each entry
    once, in rotated order, one slice of about ``slice_ms`` of calls each. GPU clock (``gpu``, CUDA
    only): each entry's calls unrolled in a CUDA graph of its own, a replay between two events; wall
    clock: the calls back to back, synchronized at both ends. The slices of one sample run within
    milliseconds of each other, so ratios of same-index samples cancel the GPU clock's and the host's
    drift, which do_bench's per-entry medians taken tens of milliseconds apart do not (the same
    kernels read up to 7% apart that way on an H100). Entries are warmed (one call) by the caller."""
    names = list(entries)
    cuda = device.type == "cuda"
    if gpu and not cuda:
        raise ValueError(f"paired.times: gpu=True needs a CUDA device, got {device}")
    per_call = {name: _call_ms(fn, device, gpu) for name, fn in entries.items()}
    count = {name: max(1, min(1000, round(slice_ms / max(ms, 1e-4)))) for name, ms in per_call.items()}
    run = {name: _unrolled(entries[name], count[name], gpu, device) for name in names}
    times: dict[str, list[Optional[object]]] = {name: [None] * samples for name in names}
    for i, name in rotations(names, samples):
        times[name][i] = run[name]()
    synchronize(device)
    if gpu:
        return {n: [elapsed_ms(*t) / count[n] for t in got] for n, got in times.items()}  # type: ignore[misc]
    return {n: [t / count[n] for t in got] for n, got in times.items()}  # type: ignore[operator]


def ratio(times: Mapping[str, Sequence[float]], name: str, base: str) -> float:
    """The median over samples of ``name``'s time over ``base``'s in the same sample (``times``)."""
    return statistics.median(t / b for t, b in zip(times[name], times[base]))


def _call_ms(fn: Fn, device: torch.device, gpu: bool, calls: int = 3) -> float:
    """A rough time per call: ``calls`` calls between two events (gpu), or back to back."""
    if not gpu:
        return back_to_back_ms(fn, (), calls, device)
    synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _unrolled(fn: Fn, count: int, gpu: bool, device: torch.device) -> Callable[[], object]:
    """A slice of ``count`` calls of ``fn``. gpu: captured once into a CUDA graph (after warm-up calls
    on a side stream, as capture requires); each slice one replay between two events, returned as the
    pair. Otherwise each slice's wall milliseconds, back to back (``timing.back_to_back_ms``)."""
    if not gpu:
        return lambda: back_to_back_ms(fn, (), count, device) * count
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            fn()

    def replay() -> tuple:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        return start, end

    return replay
