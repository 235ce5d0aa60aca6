"""Is the public op's overhead over a real backend larger than over the null backend, and why?

bench_dispatch_overhead's null rows (a backend returning a preallocated output) put the checks and
the cached decision at ~2 us a call on the H200 host (session 9), but its training rows over real
backends come out at 3.2-4.6 us (api minus direct), in every session. Both sides of those rows run the
same Python apart from the checks and the lookup. Two explanations predict different things here:

- cold code: after a real backend's kernels (launch code, oneDNN, the allocator) the checks' bytecode
  and tensor getters have left the CPU caches, so they cost more than in the null rows' hot loop. Then
  "direct real + api null" costs as much as "api real + direct null" (the api call runs cold in both);
- something tied to the real call itself (an allocation, the autograd graph, GC): then the first pair
  stays the cheaper one.

Loops per op (training calls, as in the benchmark), each timed as min over rounds of --calls calls,
with the garbage collector on and off: A = api over the chosen backend, D = direct call of it,
A+DN / D+AN = one real and one null call per iteration, the api on the real or on the null side.

    PYTHONPATH=. python3 benchmarks/probes/probe_overhead_cold.py [--calls 2000] [--rounds 25]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Callable

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_dispatch_overhead as bench  # noqa: E402

from dispatch import fused_bias_act_dropout, fused_linear  # noqa: E402


def _pairs(device: torch.device) -> list[tuple[str, str, Callable, Callable, Callable, Callable]]:
    """(op, backend, api real, direct real, api null, direct null) for the two training rows. The null
    backend is requested by backend= on its api calls, so that the real calls keep the dispatcher's
    own choice (the cached steady-state path either way)."""
    null_name = bench._register_null(device)
    null_direct = {c[1]: c[4] for c in bench._null_cases(device) if c[2].startswith("training")}
    x = torch.randn(bench.M, bench.N, device=device).requires_grad_()
    xk = torch.randn(bench.M, bench.K, device=device).requires_grad_()
    w = torch.randn(bench.N, bench.K, device=device).requires_grad_()
    bias = torch.randn(bench.N, device=device)
    null_api = {
        "bias_act_dropout": lambda: fused_bias_act_dropout(x, bias, "gelu", 0.1, backend=null_name),
        "fused_linear": lambda: fused_linear(xk, w, bias, "gelu", backend=null_name),
    }
    return [
        (case[1], case[0], case[3], case[4], null_api[case[1]], null_direct[case[1]])
        for case in bench._chosen_cases(device)
        if case[2].startswith("training")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--devices", default="cpu,cuda", help="of cpu,cuda (cuda where present)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wanted = args.devices.split(",")
    devices = [torch.device("cpu")] if "cpu" in wanted else []
    devices += [torch.device("cuda")] if "cuda" in wanted and torch.cuda.is_available() else []
    rows = []
    for device in devices:
        for op, backend, a, d, an, dn in _pairs(device):
            loops = {
                "A": a,
                "D": d,
                "AN": an,
                "DN": dn,
                "A+DN": lambda: (a(), dn()),
                "D+AN": lambda: (d(), an()),
            }
            for gc_on in (True, False):
                (gc.enable if gc_on else gc.disable)()
                best = {}
                for name, fn in loops.items():
                    for _ in range(200):
                        fn()
                    best[name] = min(bench._per_call_us(fn, args.calls, device) for _ in range(args.rounds))
                gc.enable()
                print(device.type, op, backend, f"gc {gc_on}", {k: round(v, 2) for k, v in best.items()}, flush=True)
                rows.append(
                    [device.type, op, backend, "on" if gc_on else "off"]
                    + [round(best[k], 2) for k in loops]
                    + [
                        round(best["A"] - best["D"], 2),
                        round(best["AN"] - best["DN"], 2),
                        round(best["A+DN"] - best["D+AN"], 2),
                    ]
                )
    print(
        tabulate(
            rows,
            headers=[
                "device",
                "op",
                "backend",
                "gc",
                *["A", "D", "AN", "DN", "A+DN", "D+AN"],
                "A-D",
                "AN-DN",
                "(A+DN)-(D+AN)",
            ],
        )
    )


if __name__ == "__main__":
    main()
