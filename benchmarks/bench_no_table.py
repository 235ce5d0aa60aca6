"""With no table: every op and every activation through the public op against the plain PyTorch composite
a user writes, on the wall clock (issue target: within 1.2x for calls of 50 us or more, the dispatcher's
few microseconds below that).

No table answers here (DISPATCH_HEURISTICS_DIR points at an empty folder and the shipped tables name
other devices), so each call runs on the first able backend: pytorch, the same composite. The two sides
are timed in interleaved rounds (``dispatch.timing.compare``), inference and training (forward and
backward), dropout on and off; a row's ratio is op / composite, its overhead op - composite in us.

    python benchmarks/bench_no_table.py [--quick] [--out DIR] [--threads N]
"""

from __future__ import annotations

import os
import statistics
import tempfile

import common
import torch
import torch.nn.functional as F
from tabulate import tabulate

os.environ["DISPATCH_HEURISTICS_DIR"] = tempfile.mkdtemp(prefix="no-table-")  # before dispatch reads it

from dispatch import explain, fused_bias_act_dropout, fused_linear, fused_mlp, timing  # noqa: E402
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS, GATED_NAMES, GATES  # noqa: E402

TARGET = 1.2  # op / composite for calls of LONG_US or more
LONG_US = 50.0
ROUNDS = 5


def _bias_act_dropout(act: str, m: int, n: int, p: float, device):
    x, b = torch.randn(m, n, device=device), torch.randn(n, device=device)
    f = ACTIVATIONS[act].forward
    return (x, b), (lambda x, b: fused_bias_act_dropout(x, b, act, p)), (lambda x, b: F.dropout(f(x + b), p))


def _fused_linear(act: str, m: int, n: int, k: int, device):
    x, w, b = (
        torch.randn(m, k, device=device),
        torch.randn(n, k, device=device) / k**0.5,
        torch.randn(n, device=device),
    )
    f = ACTIVATIONS[act].forward
    return (x, w, b), (lambda x, w, b: fused_linear(x, w, b, act)), (lambda x, w, b: f(F.linear(x, w, b)))


def _mlp(act: str, m: int, h: int, f: int, p: float, device):
    rows = 2 * f if act in GATES else f
    x, w_in = torch.randn(m, h, device=device), torch.randn(rows, h, device=device) / h**0.5
    b_in, w_out = torch.randn(rows, device=device), torch.randn(h, f, device=device) / f**0.5

    def composite(x, w_in, b_in, w_out):
        pre = F.linear(x, w_in, b_in)
        if act in GATES:
            gate, up = pre.chunk(2, dim=-1)
            a = ACTIVATIONS[GATES[act]].forward(gate) * up
        else:
            a = ACTIVATIONS[act].forward(pre)
        return F.linear(F.dropout(a, p), w_out)

    return (
        (x, w_in, b_in, w_out),
        (lambda x, w_in, b_in, w_out: fused_mlp(x, w_in, b_in, w_out, None, act, p)),
        composite,
    )


def cases(quick: bool, device) -> list[tuple[str, str, str, tuple, object]]:
    sizes = [(16, 64), (1024, 768)] if quick else [(4, 8), (64, 256), (1024, 768), (4096, 3072)]
    out = []
    for m, n in sizes:
        for act in ACTIVATION_NAMES:
            for p in (0.0, 0.1):
                out.append(
                    ("bias_act_dropout", act, f"{m}x{n} p={p}", _bias_act_dropout(act, m, n, p, device))
                )
            out.append(
                ("fused_linear", act, f"{m}x{n}x{n // 4 or 1}", _fused_linear(act, m, n, n // 4 or 1, device))
            )
        for act in ("gelu", "relu", *GATED_NAMES):
            f = max(8, n)
            out.append(
                ("fused_mlp", act, f"{m}x{n // 4 or 1}x{f} p=0.1", _mlp(act, m, n // 4 or 1, f, 0.1, device))
            )
    return out


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    args = p.parse_args()
    device = common.setup(args)
    rows = []
    with common.logged(args, "no_table"):
        for op, act, shape, (inputs, ours, theirs) in cases(args.quick, device):
            for mode in ("forward", "forward+backward"):
                grad_y = None
                if mode != "forward":
                    with torch.no_grad():
                        grad_y = torch.randn_like(theirs(*inputs))
                fns = {
                    "op": common.timed(ours, mode, inputs, grad_y),
                    "pytorch": common.timed(theirs, mode, inputs, grad_y),
                }
                samples = {n: [] for n in fns}
                for _ in range(ROUNDS):
                    for name, fn in fns.items():
                        samples[name].append(timing.wall_ms(fn, device, rep_ms=20.0) * 1e3)
                op_us, pt_us = (statistics.median(samples[n]) for n in ("op", "pytorch"))
                ratio = op_us / pt_us
                ok = ratio <= TARGET if pt_us >= LONG_US else True
                rows.append(dict(op=op, activation=act, shape=shape, mode=mode, op_us=round(op_us, 1),
                                 pytorch_us=round(pt_us, 1), ratio=round(ratio, 3),
                                 overhead_us=round(op_us - pt_us, 1), ok=ok))  # fmt: skip
        ran_on = {
            explain(
                "fused_linear", torch.randn(2, 4, device=device), torch.randn(3, 4, device=device)
            ).backend.name
        }
        long_rows = [r for r in rows if r["pytorch_us"] >= LONG_US]
        short = [r["overhead_us"] for r in rows if r["pytorch_us"] < LONG_US]
        summary = {
            "backend with no table": sorted(ran_on),
            "calls >= 50 us within 1.2x": f"{sum(r['ok'] for r in long_rows)}/{len(long_rows)}",
            "worst ratio >= 50 us": max((r["ratio"] for r in long_rows), default=None),
            "median overhead < 50 us (us)": statistics.median(short) if short else None,
        }
        common.write(args, "no_table", {"rows": rows, "summary": summary}, device)
        print(tabulate([r.values() for r in rows], headers=list(rows[0]), tablefmt="github"))
        for k, v in summary.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
