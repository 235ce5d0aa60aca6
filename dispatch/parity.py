"""python -m dispatch.parity: every available backend against the float64 reference.

Both ops, every activation and dtype, forward and backward, dropout off (p = 0) and on (p > 0), on a
grid of odd shapes; prints the max relative error (max|out - ref| / max|ref|) per backend, op and
dtype with PASS/FAIL against ``dispatch.contracts.tolerances`` and exits 1 on any failure.

``--quick`` covers every activation in float32 (with dropout), p = 0 once and every dtype with gelu:
each factor's every value, not their product. On CPU it keeps to a 45 s ``--budget``, shared by the
backends: compiling ones (inductor, nvfuser) took 10-75 s per case on 2 busy cores, so they may stop
early, their remaining cases listed as skipped. CPU shapes are small: Triton runs there only through
its interpreter (``TRITON_INTERPRET=1``), which parity includes, since it asks for backends by name.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from tabulate import tabulate

from dispatch import cases
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.registry import OPS, backends

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (M, N) for bias_act_dropout and (M, N, K) for fused_linear; odd sizes catch masking bugs at block edges.
# --quick uses the first shape. CPU shapes stay small: Triton's interpreter took ~0.1 s per call at
# 5x33 and ~3 s at 37x65x48 (fused_linear forward + backward) on 2 cores.
SHAPES = {
    "cpu": {
        "bias_act_dropout": [(5, 33), (1, 7), (37, 130)],
        "fused_linear": [(5, 17, 9), (1, 7, 3), (37, 65, 48)],
    },
    "cuda": {
        "bias_act_dropout": [(1823, 781), (1, 7), (37, 1000), (4096, 4096)],
        "fused_linear": [(1823, 781, 129), (1, 7, 3), (37, 300, 200), (2048, 4096, 1024)],
    },
}


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


Case = tuple[str, str, torch.dtype, bool, tuple[int, ...]]  # op, activation, dtype, dropout, shape


def grid(device: torch.device, quick: bool) -> list[Case]:
    """The cases, both ops interleaved and the most telling first (gelu, float32, dropout on), so a
    --budget that stops a slow backend early still leaves it checked on both ops."""
    per_op = []
    for op in OPS:
        shapes = SHAPES[device.type if device.type in SHAPES else "cuda"][op]
        drops = (True, False) if op == "bias_act_dropout" else (False,)
        acts = sorted(ACTIVATION_NAMES, key=lambda a: a != "gelu")
        if quick:
            shape = shapes[0]
            todo = [(op, a, torch.float32, drops[0], shape) for a in acts]
            todo[1:1] = [(op, "gelu", d, drops[0], shape) for d in DTYPES if d != torch.float32]
            todo += [(op, "gelu", torch.float32, d, shape) for d in drops[1:]]  # p = 0 once
        else:
            todo = [(op, a, d, p, s) for a in acts for d in DTYPES for p in drops for s in shapes]
        per_op.append(todo)
    return [c for group in itertools.zip_longest(*per_op) for c in group if c is not None]


def run(
    device: torch.device, quick: bool, only: Optional[Sequence[str]], budget: Optional[float]
) -> tuple[list[Row], dict[str, set[str]]]:
    """Checks every (backend, case); returns the rows and, per backend, why it skipped cases. Each
    backend but eager gets an equal share of ``budget`` seconds (compiles included)."""
    rows: dict[tuple[str, str, str], Row] = {}
    skipped: dict[str, set[str]] = {}
    names = [n for n in backends() if only is None or n in only]
    spent = dict.fromkeys(names, 0.0)
    runnable = [n for n in names if n != "eager" and backends()[n].unavailable() is None]
    share = budget / max(len(runnable), 1) if budget is not None else None
    for i, (op, activation, dtype, dropout, shape) in enumerate(grid(device, quick)):
        case = cases.Case(op, dtype, activation, True, dropout, shape[0], tuple(shape[1:]), device)
        call = case.call()
        inp = refs = eager = None
        for name in names:
            why = backends()[name].not_supported_reasons(call, explicit=True)
            if not why and share is not None and name != "eager" and spent[name] > share:
                why = [f"{name} used its share of --budget ({share:.0f} s); later cases were not run"]
            if why:
                skipped.setdefault(name, set()).update(why)
                continue
            if inp is None:
                inp = cases.make_inputs(case, seed=i)
                refs, eager = cases.reference(case, inp), cases.run_once("eager", case, inp)
            row = rows.setdefault((name, op, str(dtype)[6:]), Row(name, op, str(dtype)[6:]))
            start = time.monotonic()
            c = (
                cases.compare(eager, refs, eager)
                if name == "eager"
                else cases.check(name, case, inp, refs, eager)
            )
            row.seconds += time.monotonic() - start
            spent[name] += time.monotonic() - start
            row.cases += 1
            label = f"{activation}, {'x'.join(map(str, shape))}, p={case.p}"
            if c.failure:
                row.failures.append(f"{label}: {c.failure}")
                row.worst = float("inf")
                continue
            row.forward = max(row.forward, c.errors[0])
            row.backward = max(row.backward, *c.errors[1:])
            row.worst = max(row.worst, *c.ratios)
            parts = ["y", "grad_x", *(["grad_w"] if op == "fused_linear" else []), "grad_bias"]
            bad = [f"{part} {r:.2f}x the tolerance" for part, r in zip(parts, c.ratios) if r > 1.0]
            if bad:
                row.failures.append(f"{label}: {', '.join(bad)}")
    return list(rows.values()), skipped


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
        "allowed error: 2 * err(eager in the same dtype) + atol + rtol * max|ref| (dispatch/tolerances.py)"
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
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budget = (
        args.budget if args.budget is not None else (45.0 if args.quick and device.type == "cpu" else None)
    )
    start = time.monotonic()
    rows, skipped = run(device, args.quick, args.backends, budget or None)
    print(report(rows, skipped))
    failed = sum(bool(r.failures) for r in rows)
    verdict = "FAILED" if failed else "passed"
    seconds = time.monotonic() - start
    groups = f"{len(rows) - failed}/{len(rows)} backend x op x dtype groups pass"
    print(f"{verdict}: {groups} on {device} in {seconds:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
