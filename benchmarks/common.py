"""Benchmark plumbing: the command line, the device, results files and logs, and entries' columns.

Timing lives in ``dispatch.timing`` (shared with the calibrator), the tables and plots in ``report``.
Every benchmark writes ``<out>/<name>[-<tag>].json`` stamped with ``dispatch.timing.environment()``,
prints a tabulate table last, and draws PNG plots when matplotlib is present; ``logged`` keeps what it
printed beside the JSON.

A row is a dict: the case's keys (M, N, dtype, ...) and ``<metric>:<entry>`` columns, an entry being a
backend through the public op, ``dispatch`` (the public op choosing for itself), ``pytorch`` (the
composite a user writes), ``compile`` (torch.compile of that composite) or a ceiling (``copy``,
``torch.mm``). Speedups ``x_<baseline>_<clock>:<entry>`` = baseline's time / entry's time (> 1: the
entry is faster), for both clocks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Callable, Iterable, Iterator, Optional, Sequence, TextIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere: dispatch and backends import from the repo
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from dispatch import timing  # noqa: E402

MODES = ("forward", "backward", "forward+backward")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BASELINES = ("pytorch", "compile")
PER_SHAPE = ("nvfuser",)  # TorchScript specializes per shape: 4-6 s a new shape (calibration logs)
CLOCKS = ("gpu", "wall")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=RESULTS, help="folder for the results files (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix of the results files' names: <name>-<tag>.json")
    p.add_argument("--quick", action="store_true", help="a few shapes only (smoke run)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU runs; default torch's)")
    return p


def sweep_parser(description: str, budget_s: tuple[float, float], rep_ms: float) -> argparse.ArgumentParser:
    """``parser`` plus a sweep's options: --modes, --all-backends, --budget-s ((full, quick) default
    seconds, as ``budget``), --rep-ms (its default ``rep_ms``) and --rounds."""
    p = parser(description)
    p.add_argument(
        "--modes", default="forward,forward+backward", help=f"comma-separated, of {', '.join(MODES)}"
    )
    p.add_argument(
        "--all-backends", action="store_true", help="per-shape compilers on every row, not FOCUS only"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help=f"start no row after this many seconds (default {budget_s[0]:g}; quick {budget_s[1]:g})",
    )
    p.add_argument(
        "--rep-ms", type=float, default=rep_ms, help="time per entry and clock over all rounds (ms)"
    )
    p.add_argument("--rounds", type=int, default=timing.ROUNDS, help="interleaved rounds per row (median)")
    return p


def modes(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    """The modes --modes names; a usage error for any other."""
    found = tuple(m for m in args.modes.split(",") if m)
    if not set(found) <= set(MODES):
        p.error(f"--modes: expected some of {', '.join(MODES)}, got {args.modes!r}")
    return found


def budget(args: argparse.Namespace, budget_s: tuple[float, float]) -> float:
    """Seconds after which a sweep starts no new row: --budget-s, else ``budget_s`` (full, quick)."""
    return args.budget_s or (budget_s[1] if args.quick else budget_s[0])


def setup(args: argparse.Namespace) -> torch.device:
    """The device to run on (CUDA when there is one), with ``--threads`` applied."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def path(args: argparse.Namespace, name: str, ext: str) -> str:
    os.makedirs(args.out, exist_ok=True)
    return os.path.join(args.out, f"{name}-{args.tag}.{ext}" if args.tag else f"{name}.{ext}")


def write(args: argparse.Namespace, name: str, result: dict, device: Optional[torch.device] = None) -> str:
    """``result`` (rows and whatever else) with the environment stamp and the arguments, as JSON."""
    out = path(args, name, "json")
    stamped = {"environment": timing.environment(device), "args": vars(args), **result}
    with open(out, "w") as f:
        json.dump(stamped, f, indent=1, default=str)
    print(f"wrote {out}")
    return out


class _Tee:
    """A text stream writing to several; fileno and isatty are the first's (subprocesses write there)."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def fileno(self) -> int:
        return self.streams[0].fileno()

    def isatty(self) -> bool:
        return self.streams[0].isatty()


@contextlib.contextmanager
def logged(args: argparse.Namespace, name: str) -> Iterator[str]:
    """Everything printed inside (stdout and stderr) also goes to ``<out>/<name>[-<tag>].log``."""
    out = path(args, name, "log")
    with open(out, "w") as f, contextlib.redirect_stdout(_Tee(sys.stdout, f)):
        with contextlib.redirect_stderr(_Tee(sys.stderr, f)):
            yield out
    print(f"wrote {out}")


# ----------------------------------------------------------------------------- entries


def available(call: object, names: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """The backends among ``names`` that can serve ``call`` (a dispatch.registry.Call), and each other
    one's reasons, as the registry words them."""
    from dispatch.registry import backends

    ok, why = [], {}
    for name in names:
        reasons = backends()[name].not_supported_reasons(call)
        if reasons:
            why[name] = "; ".join(reasons)
        else:
            ok.append(name)
    return ok, why


def backend_entries(
    row: dict, call: object, names: Iterable[str], focus: bool, op: Callable[[str], Callable]
) -> dict[str, Callable]:
    """``op(name)`` for each backend among ``names`` that serves ``call``, but pytorch (its kernels are
    the composite: the benchmark's own pytorch entry) and, off the FOCUS rows, those that compile per
    shape; a ``skip:<name>`` column in ``row`` with the reason for each other one."""
    ok, why = available(call, names)
    out: dict[str, Callable] = {}
    for name in ok:
        if name == "pytorch":
            continue
        if name in PER_SHAPE and not focus:
            row[f"skip:{name}"] = "compiles per shape: FOCUS rows only (--all-backends)"
        else:
            out[name] = op(name)
    for name, reason in why.items():
        row[f"skip:{name}"] = reason
    return out


def registered() -> list[str]:
    """Every registered backend, eager first (it is the reference the others are checked against)."""
    from dispatch.registry import backends

    return sorted(backends(), key=lambda n: (n != "eager", n))


def timed(fn: Callable, mode: str, inputs: Sequence[torch.Tensor], grad_y: torch.Tensor) -> timing.Fn:
    """What a row times: ``fn(*inputs)`` under no_grad (forward), autograd.grad of every input from a
    graph built on the first (untimed) call and kept (backward), or both (forward+backward)."""
    if mode == "forward":

        def run():
            with torch.no_grad():
                return fn(*inputs)

        return run
    leaves = tuple(t.detach().requires_grad_() for t in inputs)
    if mode == "forward+backward":
        return lambda: torch.autograd.grad(fn(*leaves), leaves, grad_y)
    kept: list = []
    config = _functorch_config()

    def run_backward():
        # AOTAutograd (torch.compile) donates saved buffers to its backward by default, which then
        # refuses retain_graph=True; its config is read at compile time and at every backward call.
        # Off for the whole call, every entry alike (a plain attribute swap, well under a us).
        before = config.donated_buffer if config is not None else None
        if config is not None:
            config.donated_buffer = False
        try:
            if not kept:
                kept.append(fn(*leaves))
            return torch.autograd.grad(kept[0], leaves, grad_y, retain_graph=True)
        finally:
            if config is not None:
                config.donated_buffer = before

    return run_backward


def _functorch_config():
    try:
        import torch._functorch.config as config
    except ImportError:
        return None
    return config if hasattr(config, "donated_buffer") else None


def record(row: dict, measured: dict[str, timing.Measured], scale: float = 1e3) -> None:
    """Each entry's clocks (``gpu_us`` / ``wall_us`` with ``scale`` 1e3), their spread over the rounds,
    first-call seconds, validation and errors, into ``row``."""
    unit = {1e3: "us", 1.0: "ms"}[scale]
    for name, m in measured.items():
        for clock, t in (("gpu", m.gpu), ("wall", m.wall)):
            if t is not None:
                row[f"{clock}_{unit}:{name}"] = t.ms * scale
                row[f"{clock}_spread:{name}"] = t.spread
        row[f"first_s:{name}"] = m.first_s
        if m.valid:
            row[f"valid:{name}"] = m.valid
        for what, err in m.errors.items():
            row[f"error:{name}"] = f"{what}: {err}"


def speedups(row: dict, unit: str = "us") -> None:
    """``x_<baseline>_<clock>:<entry>`` for every timed entry and both baselines and clocks."""
    for clock in CLOCKS:
        prefix = f"{clock}_{unit}:"
        times = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix) and v}
        for base in BASELINES:
            if base in times:
                for name, t in times.items():
                    row[f"x_{base}_{clock}:{name}"] = times[base] / t


def entry_names(rows: Sequence[dict]) -> list[str]:
    """Every entry that has a column in ``rows``, in first-seen order."""
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            if ":" in k:
                seen.setdefault(k.split(":", 1)[1], None)
    return list(seen)


def fastest(row: dict, names: Sequence[str], clock: str, unit: str = "us") -> Optional[str]:
    """The entry among ``names`` with the least time on ``clock`` in ``row``, or None."""
    times = {n: row.get(f"{clock}_{unit}:{n}") for n in names}
    times = {n: t for n, t in times.items() if t}
    return min(times, key=times.get) if times else None


def copy_rates(row: dict, nbytes: int, copy_bytes: int) -> None:
    """GB/s by the minimum bytes ``nbytes``, % of the copy's GB/s and time / copy time, on the GPU clock
    (wall on the CPU), for every entry of a memory-bound row with a ``copy`` entry of ``copy_bytes``."""
    clock = "gpu_us:" if any(k.startswith("gpu_us:") for k in row) else "wall_us:"
    copy_us = row.get(clock + "copy")
    for key in [k for k in row if k.startswith(clock) and row[k]]:
        name = key[len(clock) :]
        row[f"gbs:{name}"] = nbytes / row[key] / 1e3
        if copy_us and name != "copy":
            row[f"pct_copy:{name}"] = 100 * row[f"gbs:{name}"] / (copy_bytes / copy_us / 1e3)
            row[f"x_copy:{name}"] = row[key] / copy_us
