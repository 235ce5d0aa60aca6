"""Warming the on-disk compile caches before ``python -m dispatch.calibrate`` measures (GPU only).

A full run meets hundreds of kinds of call that the JIT backends compile on first use: inductor one
graph per op, direction, dtype, activation, feature size and token class (M = 1 or M >= 2), Triton one
binary per kernel configuration. One process compiles them one after the other, and on the H200 host
that was most of a budget-limited run (results/calibrate_budget300_*: 250 of 290 s next to inductor).
Both compilers keep a cache on disk (inductor's FX graph cache, Triton's kernel cache), so worker
processes run each kind of call once, in parallel on the host's cores, and the measuring process
then loads what they compiled. Workers call the backends at the plan's coarse token counts only; no
timing happens while they run, and what they produce is never used for anything but the caches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Iterable, Optional

import torch

from dispatch import calibrate_bench as bench
from dispatch.registry import backends

WARMED = ("inductor", "triton")  # the backends whose compiles land in a cache that other processes read


def cases(work: Iterable[tuple], plan, only: Optional[set[str]]) -> list[list]:
    """The calls worth running ahead: each (backend, series, features) at every coarse token count;
    for Triton also the activations that share the series' timings (the member checks run them)."""
    out = []
    for s, features in work:
        for m in plan.grid(s.op, features):
            for name in WARMED:
                b = backends().get(name)
                if b is None or (only is not None and name not in only):
                    continue
                for act in [s.rep] + (list(s.members) if name == "triton" else []):
                    case = bench.Case(s.op, s.dtype, act, s.mode == "training", s.dropout, m, features, plan.device)
                    if not b.not_supported_reasons(case.call(), explicit=False):
                        out.append([name, s.op, str(s.dtype)[6:], act, case.training, s.dropout, m, list(features)])
    return out


def _chunks(todo: list[list], workers: int) -> list[list[list]]:
    """Calls grouped by kind (all token counts of one backend and series in one worker, so no two
    workers compile the same graph), groups dealt to workers largest first."""
    groups: dict[tuple, list[list]] = defaultdict(list)
    for c in todo:
        groups[(c[0], c[1], c[2], c[3], c[4], c[5], tuple(c[7]))].append(c)
    chunks: list[list[list]] = [[] for _ in range(workers)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(chunks, key=len).extend(group)
    return [c for c in chunks if c]


def warm(todo: list[list], workers: int, deadline_s: float, device: torch.device, bar=None) -> dict:
    """Runs ``todo`` on ``device`` in ``workers`` processes; stops them at ``deadline_s``. Returns a
    summary."""
    start = time.monotonic()
    chunks = _chunks(todo, max(1, workers))
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for chunk in chunks:
        p = subprocess.Popen(
            [sys.executable, "-m", "dispatch.calibrate_warm"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        p.stdin.write(json.dumps({"device": str(device), "calls": chunk}))
        p.stdin.close()
        procs.append(p)
    failed = killed = 0
    for i, p in enumerate(procs):
        left = deadline_s - (time.monotonic() - start)
        try:
            p.wait(timeout=max(left, 0.1))
            failed += sum(line.startswith("failed") for line in p.stdout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed += 1
        if bar is not None:
            bar.set_postfix_str(f"{i + 1}/{len(procs)} workers", refresh=True)
    return {
        "calls": len(todo),
        "workers": len(procs),
        "seconds": round(time.monotonic() - start, 1),
        "failed_calls": failed,
        "workers_stopped_at_deadline": killed,
    }


def _worker() -> None:
    """Reads {"device", "calls"} as JSON on stdin and runs each call once (forward, or forward +
    backward)."""
    job = json.loads(sys.stdin.read())
    device = torch.device(job["device"])
    for name, op, dtype, act, training, dropout, m, features in job["calls"]:
        case = bench.Case(op, getattr(torch, dtype), act, training, dropout, m, tuple(features), device)
        try:
            bench.run_once(name, case, bench.make_inputs(case, 0))
        except Exception as exc:  # the measuring run reports it properly
            print("failed", name, case, bench.failure(exc), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    _worker()
