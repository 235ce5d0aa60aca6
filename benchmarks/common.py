"""Shared benchmark plumbing: timing, environment stamp, results files, tables and plots.

Every benchmark times with ``triton.testing.do_bench`` (median of many runs; do_bench clears the L2
between runs so small shapes are not flattered by the cache) and writes its rows with the GPU name,
versions and date to ``benchmarks/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from typing import Callable, Optional, Sequence

import torch
from tabulate import tabulate

from dispatch import native

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=RESULTS, help="folder for the results files")
    p.add_argument("--quick", action="store_true", help="a few shapes only (smoke run)")
    return p


def time_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn`` on the current device (wall clock on CPU)."""
    import triton.testing

    if torch.cuda.is_available():
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    import time

    fn()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def environment() -> dict:
    """GPU, versions and date: stamped on every results file."""
    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "dispatch_reads": native.status(),  # the fast path's tensor reads: C++ or Python (dispatch.native)
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
        )
    else:
        info["gpu"] = None
    return info


def copy_ceiling_ms(numel: int, dtype: torch.dtype) -> float:
    """Time of a device-to-device copy of ``numel`` elements: the bandwidth ceiling, same run."""
    src = torch.randn(numel, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))


def write(name: str, rows: Sequence[dict], out: str, headers: Optional[Sequence[str]] = None) -> str:
    """Writes ``<out>/<name>.json`` with the environment stamp; prints a tabulate table of ``headers``."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"environment": environment(), "rows": list(rows)}, f, indent=1)
    cols = list(headers) if headers else (list(rows[0]) if rows else [])
    print(tabulate([[r.get(c) for c in cols] for r in rows], headers=cols, floatfmt=".3g"))
    print(f"wrote {path}")
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_panels(panels: Sequence[tuple[str, list]], metric: str, ceiling: str, ylabel: str, title: str, path: str) -> None:
    """A 2 x 4 grid of log2(M) plots, one per (panel title, rows), a line per entry whose rows carry a
    ``<metric>:<entry>`` column; the ``ceiling`` entry is dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8), sharex=True)
    prefix = metric + ":"
    for ax, (name, rows) in zip(axes.flat, panels):
        rows = sorted(rows, key=lambda r: r["M"])
        entries = sorted({k[len(prefix):] for r in rows for k in r if k.startswith(prefix)})
        for entry in entries:
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
    fig.savefig(path, dpi=80)
    plt.close(fig)
