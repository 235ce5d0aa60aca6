"""Benchmark plumbing: the command line, entries' columns, results files, tables and plots.

Timing lives in ``dispatch.timing`` (shared with the calibrator). Every benchmark writes
``<out>/<name>[-<tag>].json`` stamped with ``dispatch.timing.environment()``, prints a tabulate table
last, and draws PNG plots when matplotlib is present; ``logged`` keeps what it printed beside the JSON.

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
from tabulate import tabulate  # noqa: E402

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


def long_table(
    rows: Sequence[dict], keys: Sequence[str], metrics: Sequence[tuple[str, str]], unit: str = "us"
) -> tuple[list[list], list[str]]:
    """One line per (row, entry): the row's ``keys``, the entry, both clocks, ``metrics`` (header,
    column prefix), the four speedups, validation; skipped entries and errors with their reasons."""
    heads = [*keys, "entry", f"gpu {unit}", f"wall {unit}", *(h for h, _ in metrics)]
    heads += ["x torch gpu", "x torch wall", "x compile gpu", "x compile wall", "valid / why not"]
    lines = []
    for r in rows:
        for name in entry_names([r]):
            timed = r.get(f"gpu_{unit}:{name}") or r.get(f"wall_{unit}:{name}")
            note = r.get(f"error:{name}") or r.get(f"skip:{name}") or r.get(f"valid:{name}", "")
            if not timed and not note:
                continue
            line = [r.get(k) for k in keys] + [
                name,
                r.get(f"gpu_{unit}:{name}"),
                r.get(f"wall_{unit}:{name}"),
            ]
            line += [r.get(f"{prefix}:{name}") for _, prefix in metrics]
            line += [r.get(f"x_{b}_{c}:{name}") for b in BASELINES for c in CLOCKS]
            lines.append(line + [str(note)[:70]])
    return lines, heads


def dispatch_summary(
    rows: Sequence[dict], names: Sequence[str], keys: Sequence[str]
) -> tuple[list[list], list[str]]:
    """Per row: its ``keys``, the dispatcher's pick and, on each clock, the fastest of the backends
    ``names`` and the dispatch entry's time over that one's."""
    lines = []
    for r in rows:
        if "picked" not in r:
            continue
        line = [r[k] for k in keys] + [r["picked"]]
        for clock in CLOCKS:
            best = fastest(r, names, clock)
            mine = r.get(f"{clock}_us:dispatch")
            line += [best, mine / r[f"{clock}_us:{best}"] if best and mine else None]
        lines.append(line)
    heads = [*keys, "picked", "fastest gpu", "dispatch/fastest gpu"]
    return lines, heads + ["fastest wall", "dispatch/fastest wall"]


def save_sweep(
    args: argparse.Namespace, name: str, rows: list[dict], device: torch.device, plot: Callable
) -> None:
    """A sweep's rows: the entries it skipped and why, ``<name>.json``, and but for --quick the plots
    ``plot(rows, args)`` draws."""
    print_skipped(rows)
    write(args, name, {"rows": rows}, device)
    if not args.quick:
        plot_or_say(plot, rows, args)


def print_sweep_tables(
    rows: Sequence[dict],
    names: Sequence[str],
    keys: Sequence[str],
    metrics: Sequence[tuple[str, str]],
    took: float,
) -> None:
    """A sweep's two tables, last: the dispatcher's pick against the fastest backend, then every entry
    (``long_table``); ``took`` seconds in the title."""
    print_table(*dispatch_summary(rows, names, keys), title="the dispatcher's pick vs the fastest backend")
    title = f"every entry (x = baseline's time / entry's; {took:.0f} s)"
    print_table(*long_table(rows, keys, metrics), title=title)


def print_skipped(rows: Sequence[dict]) -> None:
    """Each entry skipped somewhere, once, with its (last) reason."""
    skipped = {k[5:]: v for r in rows for k, v in r.items() if k.startswith("skip:")}
    for name, why in sorted(skipped.items()):
        print(f"skipped {name}: {why}")


def print_table(lines: list[list], heads: Sequence[str], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    print(tabulate(lines, headers=list(heads), floatfmt=".3g", missingval="-"))


def fastest(row: dict, names: Sequence[str], clock: str, unit: str = "us") -> Optional[str]:
    times = {n: row.get(f"{clock}_{unit}:{n}") for n in names}
    times = {n: t for n, t in times.items() if t}
    return min(times, key=times.get) if times else None


# ----------------------------------------------------------------------------- plots


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_panels(
    panels: Sequence[tuple[str, list]], metric: str, ceiling: str, ylabel: str, title: str, out: str
) -> None:
    """A grid of log2(M) plots, one per (panel title, rows), a line per entry whose rows carry a
    ``<metric>:<entry>`` column; the ``ceiling`` entry is dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, max(1, len(panels)))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 4 * nrows), sharex=True, squeeze=False)
    prefix = metric + ":"
    for ax, (name, rows) in zip(axes.flat, panels):
        rows = sorted(rows, key=lambda r: r["M"])
        for entry in entry_names(rows):
            pts = [(r["M"], r[prefix + entry]) for r in rows if r.get(prefix + entry)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=entry, linestyle="--" if entry == ceiling else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("tokens M")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    print(f"wrote {out}")


def plot_or_say(draw, *args) -> None:
    """Draws when matplotlib is present; a failed plot never loses the results."""
    if not have_matplotlib():
        print("no matplotlib: no plots")
        return
    try:
        draw(*args)
    except Exception as exc:
        print(f"plot failed: {timing.describe(exc)}")
