"""Compiling ahead, in worker processes, the calls a GPU calibration will make.

Inductor compiles a graph per op, direction, dtype, activation, feature size and token class (M = 1 or
M >= 2), Triton a binary per kernel configuration and specialization; both cache on disk, so workers run
each kind of call once and the measuring process loads what they compiled (inductor's compiles had been
250 of a 290 s run). Triton is warmed for the members too: they are parity-checked with
the winner's kernels. Calls of one kind stay in one worker; kinds are dealt in the run's priority order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Optional

import torch

from dispatch import cases, timing
from dispatch.registry import backends

WARMED = ("inductor", "triton")  # the backends whose compiles land in a cache other processes read


def workers(asked: Optional[int], device: torch.device) -> int:
    """``asked``, else on a GPU the CPU cores less one (the measuring process waits meanwhile), at most
    15; none on a CPU, whose cores the measurements need."""
    if asked is not None:
        return asked
    return min(15, max((os.cpu_count() or 1) - 1, 0)) if device.type == "cuda" else 0


def jobs(work: list, plan, only) -> list[list]:
    """[backend, op, dtype, variant (activation), training, dropout, m, features] for each warm-up call."""
    out = []
    for s, features in work:
        f = s.family
        grid = plan.grid(f.op, features, f.dtype)
        for name in WARMED:
            b = backends().get(name)
            if b is None or (only is not None and name not in only):
                continue
            ms = grid if name == "triton" else sorted({grid[0], grid[-1]})  # inductor: dynamic M
            for act, dtype in [(s.rep, f.dtype)] + (s.members if name == "triton" else []):
                for m in ms:
                    training = f.mode == "training"
                    case = cases.case(f.op, dtype, act, training, f.dropout, m, features, plan.device)
                    if not b.not_supported_reasons(case.call(), explicit=False):
                        out.append(
                            [name, f.op, str(dtype)[6:], act, case.training, f.dropout, m, list(features)]
                        )
    return out


def deal(todo: list[list], workers: int) -> list[list[list]]:
    """``todo`` split among ``workers``: one kind of call a worker (an inductor graph per feature size; a
    Triton kernel per op, dtype, activation and direction at every size, its width a runtime argument),
    so no two workers compile one thing. Kinds go largest first to the least loaded worker (an inductor
    call ~ one compile, a Triton kind ~ one compile a size); each worker takes its kinds in the run's
    priority order, so a deadline leaves the first series compiled."""
    kinds: dict[tuple, list[list]] = defaultdict(list)
    for j in todo:
        kinds[(*j[:6], tuple(j[7]) if j[0] != "triton" else ())].append(j)
    cost = {k: len(g) if k[0] != "triton" else len({tuple(j[7]) for j in g}) for k, g in kinds.items()}
    order = {k: i for i, k in enumerate(kinds)}
    loads: list[tuple[list[float], list[tuple]]] = [([0.0], []) for _ in range(max(1, workers))]
    for k in sorted(kinds, key=cost.__getitem__, reverse=True):
        load, ks = min(loads, key=lambda w: w[0][0])
        load[0] += cost[k]
        ks.append(k)
    return [[j for k in sorted(ks, key=order.__getitem__) for j in kinds[k]] for _, ks in loads if ks]


def warm(todo: list[list], workers: int, deadline_s: float, device: torch.device) -> dict:
    """Runs ``todo`` in ``workers`` processes, stopping them at ``deadline_s``. Returns a summary."""
    start = time.monotonic()
    chunks = deal(todo, workers)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    lines, stopped, errors = [], 0, []
    with tempfile.TemporaryDirectory(prefix="fusedispatch-warm-") as folder:
        procs = []
        for i, chunk in enumerate(c for c in chunks if c):
            path = os.path.join(folder, f"jobs-{i}.json")
            with open(path, "w") as f:
                json.dump({"device": str(device), "jobs": chunk}, f)
            with open(path + ".err", "w") as err:
                cmd = [sys.executable, "-m", "dispatch.calibrate.warm", path]
                procs.append((path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)))
        for path, p in procs:
            try:
                p.wait(timeout=max(deadline_s - (time.monotonic() - start), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                stopped += 1
            if os.path.exists(path + ".out"):
                with open(path + ".out") as f:
                    lines += f.read().splitlines()
            if p.returncode not in (0, -9):
                with open(path + ".err") as f:
                    tail = [ln for ln in f.read().splitlines() if ln.strip()][-1:]
                errors.append(f"worker exited with {p.returncode}: {tail[0] if tail else ''}"[:300])
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        if line.startswith("warmed "):
            _, name, s = line.split()
            seconds[name] += float(s)
    return {
        "calls": len(todo), "workers": len(procs), "seconds": round(time.monotonic() - start, 1),
        "worker_seconds": {n: round(t, 1) for n, t in sorted(seconds.items())},
        "failed_calls": sum(ln.startswith("failed") for ln in lines), "stopped_at_deadline": stopped,
        "worker_errors": errors,
    }  # fmt: skip


def _worker(path: str) -> None:
    """Runs each job of the JSON file ``path`` once, one line each to ``path + '.out'``."""
    with open(path) as f:
        spec = json.load(f)
    device = torch.device(spec["device"])
    with open(path + ".out", "w") as out:
        for name, op, dtype, act, training, dropout, m, features in spec["jobs"]:
            start = time.monotonic()
            try:
                case = cases.case(op, getattr(torch, dtype), act, training, dropout, m, features, device)
                cases.run_once(name, case, cases.make_inputs(case, 0))
                out.write(f"warmed {name} {time.monotonic() - start:.3f}\n")
            except Exception as exc:  # the measuring process meets it again and records it
                out.write(f"failed {name} {op} {act} {m} {timing.describe(exc)}\n")
            out.flush()
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    _worker(sys.argv[1])
