"""What a benchmark shows last: tables of its rows and PNG plots.

- ``print_table`` (tabulate), ``long_table`` (one line per row and entry: both clocks, the speedups,
  validation or why not), ``dispatch_summary`` (the dispatcher's pick against the fastest backend) and
  ``print_skipped`` (each skipped entry once, with its reason); a sweep's results file and tables
  (``save_sweep``, ``print_sweep_tables``).
- ``plot_panels``: a grid of log2(M) plots, one line per entry; ``plot_or_say`` draws only where
  matplotlib is present (``have_matplotlib``), and a failed plot never loses the results.

The rows' columns are ``common``'s (``<metric>:<entry>``, ``x_<baseline>_<clock>:<entry>``).
"""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

import common
import torch
from tabulate import tabulate

from dispatch import timing


def long_table(
    rows: Sequence[dict], keys: Sequence[str], metrics: Sequence[tuple[str, str]], unit: str = "us"
) -> tuple[list[list], list[str]]:
    """One line per (row, entry): the row's ``keys``, the entry, both clocks, ``metrics`` (header,
    column prefix), the four speedups, validation; skipped entries and errors with their reasons."""
    heads = [*keys, "entry", f"gpu {unit}", f"wall {unit}", *(h for h, _ in metrics)]
    heads += ["x torch gpu", "x torch wall", "x compile gpu", "x compile wall", "valid / why not"]
    lines = []
    for r in rows:
        for name in common.entry_names([r]):
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
            line += [r.get(f"x_{b}_{c}:{name}") for b in common.BASELINES for c in common.CLOCKS]
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
        for clock in common.CLOCKS:
            best = common.fastest(r, names, clock)
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
    common.write(args, name, {"rows": rows}, device)
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
        for entry in common.entry_names(rows):
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


def plot_rows(panels: Sequence[tuple[str, list]], out: str, metric: str, ceiling: str, ylabel: str,
              title: str) -> None:  # fmt: skip
    """``plot_panels`` where any panel has rows (a figure of empty panels is not drawn)."""
    if any(rows for _, rows in panels):
        plot_panels(panels, metric, ceiling, ylabel, title, out)


def plot_or_say(draw, *args) -> None:
    """Draws when matplotlib is present; a failed plot never loses the results."""
    if not have_matplotlib():
        print("no matplotlib: no plots")
        return
    try:
        draw(*args)
    except Exception as exc:
        print(f"plot failed: {timing.describe(exc)}")
