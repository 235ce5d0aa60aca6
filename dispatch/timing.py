"""One timing harness, shared by the benchmarks and the calibrator: clocks, interleaved rounds, the stamp.

Clocks (each a median, in milliseconds per op call):
- ``gpu_ms``: ``triton.testing.do_bench_cudagraph``, the calls unrolled in one CUDA graph and replayed:
  the kernels' time on the GPU's clock, with the host's launch and Python cost out of it (and no L2
  flush between calls, so inputs that fit the 50 MB L2 run warm).
- ``wall_ms``: ``triton.testing.do_bench`` on CUDA, each call between two events after an L2 flush: the
  flush (a ~0.1 ms memset) gives the host that much slack, so host time shows only past it. On the CPU
  (no GPU clock) ``cpu_ms``: ``time.perf_counter`` around each call.
- ``host_ms``: the host's time per call, queued behind a ``torch.cuda._sleep`` kernel so it never
  waits on the GPU; ``back_to_back_ms``: calls back to back, synchronized once (what an eager model sees).
- ``dispatch.paired``: for a ratio between entries, per-sample times of each in adjacent slices, on
  either clock, and the median of the same-sample ratios.

Rounds: the entries of a comparison are timed in rounds, their order rotated each round (A B C, B C A,
C A B), median per entry, spread kept (``Timing``). A GPU boosts with temperature and power (the same
kernel timed seconds apart differed by up to 10%) and its host swings by 2x for seconds: within a
round every entry sees the same clock and host phase.

Nothing happens at import: torch.cuda and triton are touched inside the functions only.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

ROUNDS = 3  # interleaved rounds per comparison
# Calls at least this long get one round: noise is small next to them, and eager's dropout (the RNG
# spec in int64 tensor ops) takes up to 95 ms a call at 65536 x 4096.
SLOW_MS = 5.0

Fn = Callable[[], object]


@dataclass(frozen=True)
class Timing:
    """One entry's samples, ms per op call, one a round."""

    samples: tuple[float, ...]

    @property
    def ms(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median over the rounds: how far the clock and the host moved under it."""
        return (max(self.samples) - min(self.samples)) / self.ms if self.ms else 0.0


def describe(exc: BaseException) -> str:
    """'TypeError: first line of the message', at most 200 characters: for tables and results files."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"[:200]


def synchronize(device: Optional[torch.device] = None) -> None:
    if (device is None or device.type == "cuda") and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


def settle(device: torch.device) -> None:
    """Synchronize after a failure, swallowing what a failed kernel or capture left behind."""
    try:
        synchronize(device)
    except Exception:
        pass


def reset_grads(grad_to_none: Sequence[Tensor]) -> None:
    for t in grad_to_none:
        t.grad = None


# ----------------------------------------------------------------------------- clocks


def gpu_ms(fn: Fn, rep_ms: float = 20.0, grad_to_none: Sequence[Tensor] = (), calls: int = 1) -> float:
    """GPU milliseconds per op call of ``fn`` (which makes ``calls`` of them), by do_bench_cudagraph's
    median. Raises what the capture raises (a host synchronization inside ``fn``, a backend that
    allocates with cudaMalloc while capturing). The dispatcher's dropout draws its rng with a randint
    kernel while capturing (on the host otherwise), so that kernel is in this time."""
    import triton.testing

    ms = triton.testing.do_bench_cudagraph(
        fn, rep=max(1.0, rep_ms), grad_to_none=list(grad_to_none) or None, return_mode="median"
    )
    return float(ms) / calls


def wall_ms(
    fn: Fn,
    device: torch.device,
    rep_ms: float = 100.0,
    grad_to_none: Sequence[Tensor] = (),
    calls: int = 1,
    max_runs: int = 200,
) -> float:
    """Milliseconds per op call of ``fn``: do_bench's median on CUDA (warm-up a quarter of ``rep_ms``),
    ``cpu_ms`` over ``rep_ms`` elsewhere."""
    if device.type != "cuda":
        return cpu_ms(fn, rep_ms, grad_to_none, calls, max_runs=max_runs)
    import triton.testing

    ms = triton.testing.do_bench(
        fn,
        warmup=max(1.0, rep_ms / 4),
        rep=max(1.0, rep_ms),
        grad_to_none=list(grad_to_none) or None,
        return_mode="median",
    )
    return float(ms) / calls


def cpu_ms(
    fn: Fn,
    budget_ms: float,
    grad_to_none: Sequence[Tensor] = (),
    calls: int = 1,
    min_runs: int = 3,
    max_runs: int = 50,
) -> float:
    """Median (the upper one of an even count) of ``time.perf_counter`` around single runs of ``fn``,
    ms per op call: at least ``min_runs``, then more while the calls timed so far take less than
    ``budget_ms``, at most ``max_runs``."""
    times: list[float] = []
    while len(times) < min_runs or (len(times) < max_runs and sum(times) < budget_ms):
        reset_grads(grad_to_none)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def back_to_back_ms(fn: Fn, grad_to_none: Sequence[Tensor], runs: int, device: torch.device) -> float:
    """Wall milliseconds per run of ``runs`` runs of ``fn`` back to back, one synchronization at the end."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(runs):
        reset_grads(grad_to_none)
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / runs


def sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond on ``device`` (one 10M-cycle sleep timed
    by events), for sizing a sleep in time."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def host_ms(
    fn: Fn,
    device: torch.device,
    runs: int = 30,
    grad_to_none: Sequence[Tensor] = (),
    per_run_ms: float = 1.0,
    cycles_per_ms: Optional[float] = None,
) -> tuple[float, bool]:
    """(host milliseconds per run of ``fn``, whether the queue drained): ``time.perf_counter`` around
    ``runs`` back-to-back runs queued behind a ``torch.cuda._sleep`` kernel sized to outlast them
    (``per_run_ms``, an upper guess of a run's host time), so the host never waits on the GPU. If the
    sleep ended first (the calls synchronize, or the launch queue filled), it is retried with a 4x
    longer sleep and a quarter of the runs, at most three tries; ``drained`` says the last try failed
    too. On the CPU: ``cpu_ms`` (there the host is the clock), never drained."""
    if device.type != "cuda":
        return cpu_ms(fn, 100.0, grad_to_none), False
    cycles = cycles_per_ms or sleep_cycles_per_ms(device)
    guess = runs * per_run_ms
    for _ in range(3):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(cycles * (2 * guess + 0.2)))
        busy = torch.cuda.Event()
        busy.record()
        start = time.perf_counter()
        for _ in range(runs):
            reset_grads(grad_to_none)
            fn()
        seconds = time.perf_counter() - start
        drained = busy.query()  # the sleep had ended: the host may have waited on the GPU
        torch.cuda.synchronize(device)
        if not drained:
            break
        runs, guess = max(1, runs // 4), guess * 4
    return seconds * 1e3 / runs, drained


def paired_diffs_ms(a: Fn, b: Fn, pairs: int) -> list[float]:
    """Per-call differences a - b (ms), each pair timed call by call with the two calls adjacent and
    their order swapped every pair, so both run in the same state of the host (after the same kind of
    work, in the same phase of its clock). Host time only: nothing is synchronized."""
    clock = time.perf_counter_ns
    diffs = []
    for i in range(pairs):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t0 = clock()
        first()
        t1 = clock()
        second()
        t2 = clock()
        a_ns, b_ns = (t1 - t0, t2 - t1) if i % 2 == 0 else (t2 - t1, t1 - t0)
        diffs.append((a_ns - b_ns) / 1e6)
    return diffs


# ----------------------------------------------------------------------------- rounds


def rotations(names: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, name) in interleaved order: A B C, B C A, C A B, ..."""
    names = list(names)
    for r in range(rounds if names else 0):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            yield r, name


@dataclass
class Measured:
    """One entry of a comparison: first-call seconds, validation, and its two clocks."""

    first_s: Optional[float] = None  # the untimed first call (compiles, autotunes, allocates)
    valid: str = ""  # "ok", what missed, or how the entry was checked ("reference", "baseline")
    gpu: Optional[Timing] = None  # gpu_ms per round; None on the CPU or where capture failed
    wall: Optional[Timing] = None  # wall_ms per round
    errors: dict[str, str] = field(default_factory=dict)  # "first", "check", "gpu", "wall": what raised


def first_call(fn: Fn, device: torch.device) -> tuple[Optional[float], str]:
    """Seconds of one untimed call of ``fn`` (synchronized), or None and the error it raised."""
    try:
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start, ""
    except Exception as exc:  # one failing entry must not end the run
        settle(device)
        return None, describe(exc)


def compare(
    entries: Mapping[str, Fn],
    device: torch.device,
    *,
    check: Optional[Callable[[str], str]] = None,
    rounds: int = ROUNDS,
    rep_ms: float = 60.0,
    slow_ms: Optional[float] = SLOW_MS,
    gpu: bool = True,
) -> dict[str, Measured]:
    """Times every entry on both clocks in ``rounds`` interleaved rounds (each round ``rep_ms / rounds``
    per clock), after one untimed first call each and ``check(name)`` (validation before timing: "ok"
    or what missed; its exception is recorded, and the entry is timed anyway). An entry whose first
    call raises is not timed. ``gpu``: also time with do_bench_cudagraph (CUDA only); an entry whose
    capture fails keeps its wall time and the error."""
    out: dict[str, Measured] = {}
    for name, fn in entries.items():
        m = out[name] = Measured()
        m.first_s, err = first_call(fn, device)
        if err:
            m.errors["first"] = err
            continue
        if check is not None:
            try:
                m.valid = check(name)
            except Exception as exc:
                m.valid, m.errors["check"] = "error", describe(exc)
    alive = [name for name, m in out.items() if "first" not in m.errors]
    share = rep_ms / max(rounds, 1)
    clocks: dict[str, dict[str, list[float]]] = {name: {"gpu": [], "wall": []} for name in alive}
    use_gpu = gpu and device.type == "cuda"
    for _, name in rotations(alive, rounds):
        got, errors = clocks[name], out[name].errors
        if slow_ms is not None and got["wall"] and got["wall"][0] >= slow_ms:
            continue
        for clock in ("gpu", "wall") if use_gpu else ("wall",):
            if clock in errors:
                continue
            try:
                if clock == "gpu":
                    got[clock].append(gpu_ms(entries[name], share))
                else:
                    got[clock].append(wall_ms(entries[name], device, share))
            except Exception as exc:
                errors[clock] = describe(exc)
                settle(device)
    for name, got in clocks.items():
        out[name].gpu = Timing(tuple(got["gpu"])) if got["gpu"] else None
        out[name].wall = Timing(tuple(got["wall"])) if got["wall"] else None
    return out


# ----------------------------------------------------------------------------- steps and the stamp


def stamp(device: torch.device) -> object:
    """A point in time on ``device``'s stream: a recorded CUDA event (no host synchronization), else
    the host's perf_counter. ``elapsed_ms`` of two of them, once the stream is synchronized."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(start: object, end: object) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3  # type: ignore[operator]
    return start.elapsed_time(end)  # type: ignore[attr-defined]


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: Optional[torch.device] = None) -> dict:
    """What every results file is stamped with: GPU (or CPU), torch / triton / CUDA versions, date."""
    now = datetime.datetime.now(datetime.timezone.utc)
    info = {
        "date": now.date().isoformat(),
        "time_utc": now.strftime("%H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "cpu": platform.processor() or platform.machine(),
        "gpu": None,
    }
    cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    return info
