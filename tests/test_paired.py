"""dispatch.paired: entries timed in adjacent slices, ratios taken sample by sample."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from dispatch import paired, timing


def test_wall_clock_ratio_of_a_call_twice_as_long_reads_two(monkeypatch):
    """On a clock that only the calls advance (0.2 and 0.4 ms each): per-call times from the slices'
    counts, and the ratio of paired samples; a real busy-wait read 0.99 on a loaded 2-core CI machine."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def takes(ms: float):
        return lambda: now.__setitem__(0, now[0] + ms / 1e3)

    entries = {"base": takes(0.2), "twice": takes(0.4)}
    times = paired.times(entries, torch.device("cpu"), gpu=False, samples=9, slice_ms=2.0)
    assert set(times) == {"base", "twice"} and all(len(t) == 9 for t in times.values())
    assert 0.15 < min(times["base"]) and max(times["base"]) < 1.0  # ms per call, not per slice
    assert paired.ratio(times, "twice", "base") == pytest.approx(2.0, rel=0.25)
    assert paired.ratio(times, "base", "base") == 1.0


def test_every_sample_times_each_entry_once_in_rotated_order():
    order = []
    entries = {name: (lambda n=name: order.append(n)) for name in "abc"}
    paired.times(entries, torch.device("cpu"), gpu=False, samples=3, slice_ms=1e-9)
    slices = order[3 * 3 :]  # after the three rough-time calls of each entry, one call a slice
    assert slices == list("abc") + list("bca") + list("cab")


def test_the_gpu_clock_needs_cuda():
    with pytest.raises(ValueError, match="gpu=True needs a CUDA device"):
        paired.times({"a": lambda: None}, torch.device("cpu"), gpu=True)


@pytest.mark.gpu
def test_gpu_clock_pairs_graph_replays():
    cycles = timing.sleep_cycles_per_ms(torch.device("cuda"))
    entries = {
        "base": lambda: torch.cuda._sleep(int(0.1 * cycles)),
        "twice": lambda: torch.cuda._sleep(int(0.2 * cycles)),
    }
    times = paired.times(entries, torch.device("cuda"), gpu=True, samples=10, slice_ms=1.0)
    # twice the sleep, within 30%: under -n 8 the GPU is time-sliced among the test processes (2.27 seen
    # on an H100); swapped or unpaired entries read 0.5 or drift far further
    assert paired.ratio(times, "twice", "base") == pytest.approx(2.0, rel=0.3)
    assert 0.05 < statistics.median(times["base"]) < 0.2
