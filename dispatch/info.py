"""python -m dispatch.info: what this machine offers the dispatcher.

Versions, the device, each registered backend (available or not, and whether the dispatcher may pick it
on its own here: "auto", with the backend's own reasons), and the heuristics table in use.

    python -m dispatch.info [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
from typing import Optional, Sequence

import torch
from tabulate import tabulate

from dispatch import heuristics, ops
from dispatch.registry import Backend, backends
from dispatch.select import ENV_VAR

PROBE_SIZE = 4096  # every dim of a typical call


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device_line(device: torch.device) -> str:
    if device.type != "cuda":
        cuda = "no CUDA GPU" if not torch.cuda.is_available() else "a CUDA GPU present, not selected"
        info = heuristics.device_info(device)
        threads = f"{info['threads']} thread{'s' if info['threads'] != 1 else ''}"
        return f"{device}: {info['name']}, {threads} ({cuda})"
    props = torch.cuda.get_device_properties(device)
    gib = props.total_memory / 2**30
    sms = props.multi_processor_count
    return f"{device} {props.name} (sm_{props.major}{props.minor}, {sms} SMs, {gib:.0f} GiB)"


def _probe(backend: Backend, device: torch.device) -> list[str]:
    """Why the dispatcher would not pick ``backend`` on its own for a typical float32 gelu call (the op's
    first variant where it has no gelu) of each op it implements on ``device`` ([] if it would)."""
    reasons: list[str] = []
    for spec in ops.all_specs():
        if not backend.implements(spec.name):
            continue
        values = spec.variants()
        typical = {spec.variant: "gelu" if "gelu" in values else values[0], "dropout": False}
        shape = (PROBE_SIZE,) * len(spec.dims)
        call = spec.call(device, torch.float32, shape, True, **{t: typical.get(t) for t in spec.traits})
        reasons += [r for r in backend.not_supported_reasons(call, explicit=False) if r not in reasons]
    return reasons


def _env_backend_problem() -> str:
    """Why ``DISPATCH_BACKEND`` would make calls fail ('' where it is unset or names a usable backend)."""
    name = os.environ.get(ENV_VAR)
    if not name:
        return ""
    known = backends()
    if name not in known:
        return (
            f"{ENV_VAR}={name} is not a registered backend ({', '.join(known)}): every call without "
            "backend= raises ValueError"
        )
    why_not = known[name].unavailable()
    return f"{ENV_VAR}={name} cannot run here ({why_not}): its calls raise ValueError" if why_not else ""


def report(device: torch.device) -> str:
    torch_cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (no CUDA)"
    lines = [
        f"fusedispatch {_version('fusedispatch')}: python {platform.python_version()}, "
        f"torch {torch.__version__}{torch_cuda}, triton {_version('triton')}",
        f"device: {_device_line(device)}",
        f"heuristics: {heuristics.describe(device)}",
        f"{ENV_VAR}: {os.environ.get(ENV_VAR) or '(unset: the table decides)'}",
        f"{heuristics.ENV_DIR}: {os.environ.get(heuristics.ENV_DIR) or '(unset)'} "
        f"(user tables are read from {heuristics.user_dir()})",
    ]
    problems = [p for p in (_env_backend_problem(), heuristics.user_dir_problem()) if p]
    problems += [f"skipped heuristics table {path}: {why}" for path, why in heuristics.skipped_tables()]
    lines += [f"warning: {p}" for p in problems] + [""]
    rows, notes = [], []
    for name, backend in backends().items():
        why_not = backend.unavailable()
        probe = [] if why_not else _probe(backend, device)
        dtypes = ", ".join(sorted(str(d).removeprefix("torch.") for d in backend.dtypes))
        rows.append(
            [
                name,
                "no" if why_not else "yes",
                "no" if why_not or probe else "yes",
                " ".join(op for op in ops.names() if backend.implements(op)) or "-",
                dtypes,
                "yes" if backend.deterministic else "no",
                backend.label() if backend.display_name() != name else "",
            ]
        )
        for reason in [why_not] if why_not else probe:
            notes.append(f"  {name}: {reason}")
    headers = ["backend", "available", f"auto on {device.type}", "ops", "dtypes", "determ.", "detail"]
    lines.append(tabulate(rows, headers=headers))
    if notes:
        lines += ["", "why not:", *notes]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dispatch.info", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    print(report(device))


if __name__ == "__main__":
    main()
