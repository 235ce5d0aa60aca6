"""This machine as the tables see it: the device's name, slug and matching properties, the running
versions, and the user directory tables are read from first."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from typing import Optional

import torch

from dispatch.heuristics.schema import DeviceInfo

ENV_DIR = "DISPATCH_HEURISTICS_DIR"


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_slug(model: str, threads: int) -> str:
    """A CPU's table is keyed by its model and the thread count it was timed with."""
    return f"cpu-{slugify(model)}-{threads}t"


def device_info(device: torch.device) -> DeviceInfo:
    """Name, slug and the properties used to match tables: capability, SMs, peak bandwidth (CUDA);
    the thread count (CPU)."""
    if device.type != "cuda":
        threads = torch.get_num_threads()  # CPU timings scale with the thread count
        model = cpu_model()
        return {"type": "cpu", "name": model, "slug": cpu_slug(model, threads), "threads": threads}
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0  # 0 or absent on some CUDA versions
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    peak = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None  # DDR: 2/clock
    return {
        "type": "cuda",
        "name": props.name,
        "slug": slugify(props.name),
        "capability": [props.major, props.minor],
        "sm_count": props.multi_processor_count,
        "peak_bandwidth_gbs": round(peak, 1) if peak else None,
    }


def running_versions() -> dict[str, Optional[str]]:
    try:
        triton_version: Optional[str] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def user_dir() -> str:
    """Where calibrate writes by default and lookup looks first."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fusedispatch", "heuristics")


def user_dir_problem() -> str:
    """Why ``DISPATCH_HEURISTICS_DIR`` serves no table ('' where it is unset or a directory)."""
    path = os.environ.get(ENV_DIR)
    if not path or os.path.isdir(path):
        return ""
    if os.path.exists(path):
        return (
            f"{ENV_DIR}={path} is a file, not a directory: no user table is read from it, and "
            "python -m dispatch.calibrate cannot write there"
        )
    return (
        f"{ENV_DIR}={path} does not exist: no user table is read from it "
        "(python -m dispatch.calibrate creates it)"
    )
