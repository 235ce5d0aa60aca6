"""Work of ``python -m dispatch.calibrate`` that needs no quiet GPU, done in parallel worker processes.

Two kinds of job, both off the measuring process's clock:

* ``warm``: compile ahead. A full run meets hundreds of kinds of call that the JIT backends compile on
  first use: inductor one graph per op, direction, dtype, activation, feature size and token class
  (M = 1 or M >= 2), Triton one binary per kernel configuration. Both compilers keep a cache on disk
  (inductor's FX graph cache, Triton's kernel cache), so workers run each kind of call once at the
  plan's coarse token counts and the measuring process then loads what they compiled. On the H200
  host inductor's compiles had been 250 of a 290 s budget-limited run; ahead, the 4325 calls of a
  full run took 85 s in 12 processes.
* ``check``: the parity gate. Checking a point (the float64 reference, eager, two calls of each
  backend, the comparison) took 307 of the 470 s that the measuring process spent on 180 series, one
  point after another. Timings need the GPU to themselves; checks do not, so with workers the
  measuring process only times, and the points are checked here afterwards, before any table is fit
  (dispatch.calibrate_checks.check_deferred): a backend still enters a cell only after it matched
  the reference at that shape. A fit point checks its winner (then the next best, if that fails);
  a held-out point every backend.

Jobs are grouped by kind of call (one series' calls stay in one worker, so no two workers compile the
same graph) and dealt to workers largest group first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from typing import Iterable, Optional

import torch

from dispatch import calibrate_bench as bench
from dispatch.registry import backends

WARMED = ("inductor", "triton")  # the backends whose compiles land in a cache that other processes read


def cases(work: Iterable[tuple], plan, only: Optional[set[str]]) -> list[list]:
    """Warm-up calls: each (backend, series, features) at every coarse token count; for Triton also
    the activations that share the series' timings (the member checks run them)."""
    out = []
    for s, features in work:
        for m in plan.grid(s.op, features):
            for name in WARMED:
                b = backends().get(name)
                if b is None or (only is not None and name not in only):
                    continue
                for act in [s.rep] + (list(s.members) if name == "triton" else []):
                    case = bench.Case(
                        s.op, s.dtype, act, s.mode == "training", s.dropout, m, features, plan.device
                    )
                    if not b.not_supported_reasons(case.call(), explicit=False):
                        out.append(
                            [name, s.op, str(s.dtype)[6:], act, case.training, s.dropout, m, list(features)]
                        )
    return out


def case_job(case: bench.Case) -> list:
    """A Case as JSON: [op, dtype, activation, training, dropout, m, features]."""
    return [
        case.op,
        str(case.dtype)[6:],
        case.activation,
        case.training,
        case.dropout,
        case.m,
        list(case.features),
    ]


def case_of(job: list, device: torch.device) -> bench.Case:
    op, dtype, act, training, dropout, m, features = job
    return bench.Case(op, getattr(torch, dtype), act, training, dropout, m, tuple(features), device)


def _chunks(jobs: list[list], workers: int, kind_of) -> list[list[list]]:
    """Jobs grouped by ``kind_of(job)``, groups dealt to ``workers`` lists largest first."""
    groups: dict[tuple, list[list]] = defaultdict(list)
    for j in jobs:
        groups[kind_of(j)].append(j)
    chunks: list[list[list]] = [[] for _ in range(workers)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(chunks, key=len).extend(group)
    return [c for c in chunks if c]


def _spawn(
    kind: str, chunks: list[list[list]], device: torch.device, deadline_s: float, bar=None
) -> tuple[list[str], int, list[str]]:
    """Runs each chunk in its own process. Each writes its lines to a file of its own (a pipe read one
    process after another would stall the later ones once full), flushed line by line, so a process
    stopped at the deadline still leaves what it finished. Returns (every line, how many processes
    were stopped, the last stderr line of each that failed)."""
    start = time.monotonic()
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    lines: list[str] = []
    errors: list[str] = []
    killed = 0
    with tempfile.TemporaryDirectory(prefix="fusedispatch-calibrate-") as folder:
        procs = []
        try:
            for i, chunk in enumerate(chunks):
                path = os.path.join(folder, f"jobs-{i}.json")
                with open(path, "w") as f:
                    json.dump({"kind": kind, "device": str(device), "jobs": chunk}, f)
                with open(path + ".err", "w") as err:
                    procs.append(
                        (
                            path,
                            subprocess.Popen(
                                [sys.executable, "-m", "dispatch.calibrate_workers", path],
                                stdout=subprocess.DEVNULL,
                                stderr=err,
                                env=env,
                            ),
                        )
                    )
        except OSError:
            for _, p in procs:
                p.kill()
                p.wait()
            raise
        for i, (path, p) in enumerate(procs):
            try:
                p.wait(timeout=max(deadline_s - (time.monotonic() - start), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                killed += 1
            if os.path.exists(path + ".out"):
                with open(path + ".out") as f:
                    lines.extend(f.read().splitlines())
            if p.returncode not in (0, -9):
                with open(path + ".err") as f:
                    tail = [ln for ln in f.read().splitlines() if ln.strip()][-1:]
                errors.append(f"worker {i} exited with {p.returncode}: {tail[0] if tail else ''}"[:300])
            if bar is not None:
                bar.set_postfix_str(f"{i + 1}/{len(procs)} workers", refresh=True)
    return lines, killed, errors


def warm(todo: list[list], workers: int, deadline_s: float, device: torch.device, bar=None) -> dict:
    """Runs the warm-up calls ``todo`` on ``device`` in ``workers`` processes. Returns a summary."""
    start = time.monotonic()
    chunks = _chunks(todo, max(1, workers), lambda c: (c[0], c[1], c[2], c[3], c[4], c[5], tuple(c[7])))
    lines, killed, errors = _spawn("warm", chunks, device, deadline_s, bar)
    by_backend: dict[str, float] = defaultdict(float)  # worker seconds: where the compiling goes
    for line in lines:
        if line.startswith("warmed "):
            _, name, seconds = line.split()
            by_backend[name] += float(seconds)
    return {
        "calls": len(todo),
        "workers": len(chunks),
        "seconds": round(time.monotonic() - start, 1),
        "worker_seconds": {n: round(t, 1) for n, t in sorted(by_backend.items())},
        "failed_calls": sum(line.startswith("failed") for line in lines),
        "workers_stopped_at_deadline": killed,
        "worker_errors": errors,
    }


CHECK_MEMORY = 16 * 2**30  # a check's peak at the plan's caps: float64 reference + eager + backend


def check_workers(workers: int, device: torch.device) -> int:
    """How many checking processes fit: each may hold ~CHECK_MEMORY of device memory at once."""
    if device.type != "cuda":
        return workers
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(workers, free // CHECK_MEMORY))


def check(
    jobs: list[list], workers: int, deadline_s: float, device: torch.device, bar=None
) -> tuple[dict, dict]:
    """Parity-checks ``jobs`` ([id, *case_job(case), [backend names]]) in up to ``workers`` processes
    (fewer if device memory is short). Returns ({id: {name: [passed, max relative error, why it
    failed]}}, a summary). A backend that ran out of memory there (the workers share the device) is
    left out of its job's results, and a job whose worker was stopped or died has none: the caller
    decides what to do with those. Raises OSError if no process can be started."""
    start = time.monotonic()
    workers = check_workers(workers, device)
    chunks = _chunks(jobs, max(1, workers), lambda j: (j[1], j[2], j[3], j[4], j[5], tuple(j[7])))
    lines, killed, errors = _spawn("check", chunks, device, deadline_s, bar)
    results = {}
    by_backend: dict[str, float] = defaultdict(float)  # worker seconds, the float64 reference apart
    for line in lines:
        try:
            r = json.loads(line) if line.startswith("{") else None
        except ValueError:
            r = None
        if isinstance(r, dict) and "id" in r and "results" in r:
            results[r["id"]] = r["results"]
            for name, t in r.get("seconds", {}).items():
                by_backend[name] += t
    summary = {
        "points": len(jobs),
        "workers": len(chunks),
        "seconds": round(time.monotonic() - start, 1),
        "worker_seconds": {n: round(t, 1) for n, t in sorted(by_backend.items())},
        "unfinished": len(jobs) - len(results),
        "workers_stopped_at_deadline": killed,
        "worker_errors": errors,
    }
    return results, summary


def gate(name: str, case: bench.Case, inp: bench.Inputs, refs: list, eager: list) -> list:
    """[passed, max relative error, why it failed] of backend ``name`` at ``case``."""
    c = bench.compare(eager, refs, eager) if name == "eager" else bench.check(name, case, inp, refs, eager)
    if c.ok:
        return [True, float(f"{c.error:.3g}"), ""]
    return [False, None, c.failure or f"max error {max(c.ratios):.2f}x the tolerance"]


def inputs(case: bench.Case) -> tuple[bench.Inputs, list, list]:
    """The point's inputs (seeded by the case, so every process draws the same), reference, eager."""
    inp = bench.make_inputs(case, zlib.crc32(repr(case).encode()))
    return inp, bench.reference(case, inp), bench.run_once("eager", case, inp)


def _oom(result: list) -> bool:
    return not result[0] and result[2].startswith("OutOfMemoryError")


def _worker(path: str) -> None:
    """Reads {"kind", "device", "jobs"} from the JSON file ``path`` and writes its lines to
    ``path + ".out"``. ``warm``: runs each call once (forward, or forward + backward) and writes its
    backend and seconds. ``check``: one JSON line of gate results (and seconds) per job, a backend
    that ran out of memory left out."""
    with open(path) as f:
        job = json.load(f)
    device = torch.device(job["device"])
    with open(path + ".out", "w") as out:
        for j in job["jobs"]:
            try:
                if job["kind"] == "warm":
                    start = time.monotonic()
                    case = case_of(j[1:], device)
                    bench.run_once(j[0], case, bench.make_inputs(case, 0))
                    out.write(f"warmed {j[0]} {time.monotonic() - start:.3f}\n")
                else:
                    case = case_of(j[1:8], device)
                    start = time.monotonic()
                    inp, refs, eager = inputs(case)
                    seconds = {"reference": time.monotonic() - start}
                    results = {}
                    for n in j[8]:
                        start = time.monotonic()
                        results[n] = gate(n, case, inp, refs, eager)
                        seconds[n] = time.monotonic() - start
                    results = {n: r for n, r in results.items() if not _oom(r)}
                    seconds = {n: round(t, 3) for n, t in seconds.items()}
                    out.write(json.dumps({"id": j[0], "results": results, "seconds": seconds}) + "\n")
            except Exception as exc:  # the measuring process decides (a missing result)
                out.write(f"failed {j} {bench.failure(exc)}\n")
            out.flush()
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    _worker(sys.argv[1])
