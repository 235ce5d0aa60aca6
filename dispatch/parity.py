"""python -m dispatch.parity: every available backend against the float64 reference.

Every op, each value of its variant trait (every activation) and dtype, forward and backward, dropout
off (p = 0) and on (p > 0), on a grid of odd shapes; prints the max relative error (max|out - ref| /
max|ref|) per backend, op and dtype with PASS/FAIL against ``dispatch.contracts.tolerances`` and exits 1
on any failure.

``--quick`` covers every variant in float32 (with dropout), p = 0 once and every dtype with gelu (an
op's first variant): each factor's every value, not their product. On CPU it keeps to a 45 s
``--budget``, shared by the backends: compiling ones (inductor, nvfuser) took 10-75 s per case on 2
busy cores, so they may stop early, their remaining cases listed as skipped. CPU shapes are small:
Triton runs there only through its interpreter (``TRITON_INTERPRET=1``), which parity includes, since
it asks for backends by name.
The last line counts the backend x op x dtype groups that ran and passed, and those not run or cut
short, with each backend's cause (budget, unavailable, not supported). A backend this device's table
picks anywhere that the budget cut short makes the verdict "incomplete" (exit code 2): a pass must have
checked every backend the dispatcher will run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from tabulate import tabulate

from dispatch import cases
from dispatch import ops
from dispatch.contracts.compiled import CompileNotice
from dispatch.registry import backends

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class Row:
    backend: str
    op: str
    dtype: str
    cases: int = 0
    forward: float = 0.0  # max relative error of the output
    backward: float = 0.0  # max relative error over the gradients
    worst: float = 0.0  # max error / allowed error; <= 1 passes
    seconds: float = 0.0  # wall time of its calls, compiles included
    failures: list[str] = field(default_factory=list)


Case = tuple[str, Optional[str], torch.dtype, bool, tuple[int, ...]]  # op, variant, dtype, dropout, shape
Group = tuple[str, str, str]  # backend, op, dtype: one row of the report
BUDGET, UNAVAILABLE, UNSUPPORTED = "budget", "unavailable", "not supported"  # why a case was not run


def grid(device: torch.device, quick: bool) -> list[Case]:
    """The cases, the ops interleaved and the most telling first (an op's first variant, gelu where it
    takes it; float32; dropout on), so a --budget that stops a slow backend early still leaves it checked
    on every op."""
    per_op = []
    for spec in ops.all_specs():
        op = spec.name
        shapes = spec.grid.parity.get(device.type) or spec.grid.parity["cuda"]
        drops = (True, False) if spec.dropout else (False,)
        acts = sorted(spec.variants(), key=lambda a: a != "gelu")
        if quick:
            shape, first = shapes[0], acts[0]
            todo = [(op, a, torch.float32, drops[0], shape) for a in acts]
            todo[1:1] = [(op, first, d, drops[0], shape) for d in DTYPES if d != torch.float32]
            todo += [(op, first, torch.float32, d, shape) for d in drops[1:]]  # p = 0 once
        else:
            todo = [(op, a, d, p, s) for a in acts for d in DTYPES for p in drops for s in shapes]
        per_op.append(todo)
    return [c for group in itertools.zip_longest(*per_op) for c in group if c is not None]


def run(
    device: torch.device, quick: bool, only: Optional[Sequence[str]], budget: Optional[float]
) -> tuple[list[Row], dict[str, set[str]], dict[Group, set[str]]]:
    """Checks every (backend, case); returns the rows, per backend why it skipped cases, and per group
    with skipped cases their causes (``BUDGET``, ``UNAVAILABLE``, ``UNSUPPORTED``). Each backend but
    eager gets an equal share of ``budget`` seconds (compiles included)."""
    rows: dict[Group, Row] = {}
    skipped: dict[str, set[str]] = {}
    unrun: dict[Group, set[str]] = {}
    names = [n for n in backends() if only is None or n in only]
    spent = dict.fromkeys(names, 0.0)
    runnable = [n for n in names if n != "eager" and backends()[n].unavailable() is None]
    share = budget / max(len(runnable), 1) if budget is not None else None
    for i, (op, activation, dtype, dropout, shape) in enumerate(grid(device, quick)):
        case = cases.case(op, dtype, activation, True, dropout, shape[0], tuple(shape[1:]), device)
        call = case.call()
        inp = refs = eager = None
        for name in names:
            group, backend = (name, op, str(dtype)[6:]), backends()[name]
            why = backend.not_supported_reasons(call, explicit=True)
            cause = UNAVAILABLE if backend.unavailable() else UNSUPPORTED
            if not why and share is not None and name != "eager" and spent[name] > share:
                why = [f"{name} used its share of --budget ({share:.0f} s); later cases were not run"]
                cause = BUDGET
            if why:
                skipped.setdefault(name, set()).update(why)
                unrun.setdefault(group, set()).add(cause)
                continue
            if inp is None:
                inp = cases.make_inputs(case, seed=i)
                refs, eager = cases.reference(case, inp), cases.run_once("eager", case, inp)
            row = rows.setdefault(group, Row(*group))
            start = time.monotonic()
            c = (
                cases.compare(eager, refs, eager)
                if name == "eager"
                else cases.check(name, case, inp, refs, eager)
            )
            row.seconds += time.monotonic() - start
            spent[name] += time.monotonic() - start
            row.cases += 1
            label = ", ".join(filter(None, (activation, "x".join(map(str, shape)), f"p={case.p}")))
            if c.failure:
                row.failures.append(f"{label}: {c.failure}")
                row.worst = float("inf")
                continue
            parts = ops.get(op).grid.outputs
            made = sum(not part.startswith("grad_") for part in parts)  # the op's outputs, then gradients
            row.forward = max(row.forward, *c.errors[:made])
            row.backward = max(row.backward, *c.errors[made:])
            row.worst = max(row.worst, *c.ratios)
            bad = [f"{part} {r:.2f}x the tolerance" for part, r in zip(parts, c.ratios) if r > 1.0]
            if bad:
                row.failures.append(f"{label}: {', '.join(bad)}")
    return list(rows.values()), skipped, unrun


def summary(rows: list[Row], unrun: dict[Group, set[str]]) -> str:
    """The verdict's counts: groups that ran and passed, groups not run at all and groups cut short
    by the budget, each with its backends' causes."""
    ran = {(r.backend, r.op, r.dtype) for r in rows}
    passed = sum(not r.failures for r in rows)
    parts = [f"{passed}/{len(rows)} run groups (backend x op x dtype) pass"]
    not_run = {g: why for g, why in unrun.items() if g not in ran}
    short = {g: {BUDGET} for g, why in unrun.items() if g in ran and BUDGET in why}
    for label, groups in (("not run", not_run), ("cut short by the budget", short)):
        causes: dict[str, set[str]] = {}
        for (backend, _, _), why in groups.items():
            causes.setdefault(backend, set()).update(why)
        if groups:
            noun = "group" if len(groups) == 1 else "groups"
            listed = "; ".join(f"{b}: {', '.join(sorted(c))}" for b, c in sorted(causes.items()))
            parts.append(f"{len(groups)} {noun} {label} ({listed})")
    return "; ".join(parts)


def picked_backends(device: torch.device) -> set[str]:
    """Every backend the table serving ``device`` picks in some segment (or for CUDA-graph capture)."""
    from dispatch import heuristics

    table, _ = heuristics.table_for(device)
    if table is None:
        return set()
    segs = [s for by in table.index.values() for e in by.values() for s in e.segments]
    return {s.backend for s in segs} | {s.gpu_backend for s in segs if s.gpu_backend}


def unchecked_picks(picked: set[str], unrun: dict[Group, set[str]]) -> list[str]:
    """The picked backends whose cases the budget cut (ran on too few cases to vouch for them)."""
    return sorted({backend for (backend, _, _), why in unrun.items() if backend in picked and BUDGET in why})


def report(rows: list[Row], skipped: dict[str, set[str]]) -> str:
    table = [
        [
            r.backend,
            r.op,
            r.dtype,
            r.cases,
            f"{r.forward:.2e}",
            f"{r.backward:.2e}",
            f"{r.worst:.2f}",
            f"{r.seconds:.1f}",
            "FAIL" if r.failures else "PASS",
        ]
        for r in sorted(rows, key=lambda r: (r.backend != "eager", r.backend, r.op))
    ]
    headers = [
        "backend",
        "op",
        "dtype",
        "cases",
        "fwd max rel err",
        "bwd max rel err",
        "worst err/allowed",
        "seconds",
        "result",
    ]
    lines = [tabulate(table, headers=headers)]
    for r in rows:
        for f in r.failures[:5]:
            lines.append(f"FAIL {r.backend} {r.op} {r.dtype}: {f}")
        if len(r.failures) > 5:
            lines.append(f"FAIL {r.backend} {r.op} {r.dtype}: ... {len(r.failures) - 5} more")
    for name, why in sorted(skipped.items()):
        lines.append(f"skipped {name} for some or all cases: {'; '.join(sorted(why))}")
    lines.append(
        "allowed error: 2 * err(eager in the same dtype) + atol + rtol * max|ref| (contracts/tolerances.py)"
    )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dispatch.parity", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="cover each activation and dtype once (CI)")
    p.add_argument("--backends", nargs="+", help="check only these backends")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument(
        "--budget",
        type=float,
        help="seconds shared by the backends (default: 45 for --quick on CPU, "
        "where compiling backends take ~10 s per case; unlimited otherwise; 0: unlimited)",
    )
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", CompileNotice)  # compiling every kind is what this command does
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:  # the tables are found by the device's index
        device = torch.device("cuda", torch.cuda.current_device())
    budget = (
        args.budget if args.budget is not None else (45.0 if args.quick and device.type == "cpu" else None)
    )
    start = time.monotonic()
    rows, skipped, unrun = run(device, args.quick, args.backends, budget or None)
    print(report(rows, skipped))
    failed = any(r.failures for r in rows)
    seconds = time.monotonic() - start
    cut = [] if failed else unchecked_picks(picked_backends(device), unrun)
    verdict = "FAILED" if failed else "incomplete" if cut else "passed"
    print(f"{verdict} on {device} in {seconds:.0f} s: {summary(rows, unrun)}")
    if cut:
        print(f"incomplete: this device's table picks {', '.join(cut)}, whose cases the budget cut short; "
              f"check them all with: python -m dispatch.parity{' --quick' if args.quick else ''} "
              f"--backends {' '.join(cut)} --budget 0")  # fmt: skip
    return 1 if failed else 2 if cut else 0


if __name__ == "__main__":
    sys.exit(main())
