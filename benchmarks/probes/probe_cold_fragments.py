"""Which part of the public op's fast path costs more after other torch work (issue 2, cold code)?

bench_dispatch_overhead's real-backend training rows stay over the null rows (triton bias_act_dropout
training 5.04 us against 1.89, session 10), and probe_overhead_cold found the extra paid by whichever
call runs the public op right after a real one. This reproduces that without a GPU and takes it apart:

1. ``busyK`` backends whose forward runs K tiny torch ops: the public op minus a direct call of the
   same forward, timed in adjacent pairs (bench_dispatch_overhead._paired_us), for K = 0, 4, 16.
2. Fragments of the fast path (the compile check, the tensor getters, the cache key and lookup, the
   whole op over a null backend) timed in pairs against the same K ops without them: each fragment's
   cost right after K torch ops.

    PYTHONPATH=. python3 benchmarks/probes/probe_cold_fragments.py [--calls 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_dispatch_overhead as bench  # noqa: E402

from dispatch import ACTIVATION_NAMES, api, fused_bias_act_dropout  # noqa: E402
from dispatch.activations import ACTIVATIONS  # noqa: E402
from dispatch.checks import FLOAT_DTYPES  # noqa: E402
from dispatch.registry import Backend, backends, register  # noqa: E402

M, N = bench.M, bench.N


class _Busy:
    """A backend op whose forward runs ``ops`` tiny torch additions: torch's dispatcher, allocator and
    kernels run between the public op's calls, as a real backend's do."""

    def __init__(self, ops: int):
        self.ops = ops

    def forward(self, x, bias, activation, p, rng):
        t = x
        for _ in range(self.ops):
            t = t + 1.0
        return t


def _register(name: str, op: object) -> None:
    if name not in backends():
        register(
            Backend(
                name=name,
                ops={"bias_act_dropout": op, "fused_linear": op},
                devices=frozenset({"cpu", "cuda"}),
                dtypes=frozenset({torch.float32}),
                activations=frozenset(ACTIVATION_NAMES),
                deterministic=True,
                summary="probe stand-in",
            )
        )


def _with_ops(ops: int, fragment: Callable[[], object], x: torch.Tensor, calls: int) -> float:
    """Median us of ``fragment`` right after ``ops`` torch additions, paired against the additions alone."""
    clock = time.perf_counter_ns

    def busy() -> None:
        t = x
        for _ in range(ops):
            t = t + 1.0

    diffs = []
    for i in range(calls):
        t0 = clock()
        busy()
        if i % 2:
            t1 = clock()
            busy()
            fragment()
        else:
            fragment()
            t1 = clock()
            busy()
        t2 = clock()
        with_fragment, without = (t2 - t1, t1 - t0) if i % 2 else (t1 - t0, t2 - t1)
        diffs.append((with_fragment - without) / 1e3)
    return statistics.median(diffs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    x, bias = torch.randn(M, N), torch.randn(N)
    rows = []
    for ops in (0, 4, 16):
        _register(f"busy{ops}", _Busy(ops))
        impl = _Busy(ops)

        def public(ops=ops):
            return fused_bias_act_dropout(x, bias, "gelu", backend=f"busy{ops}")

        def direct(impl=impl):
            return impl.forward(x, bias, "gelu", 0.0, None)

        for _ in range(200):
            public(), direct()
        got = [statistics.median(bench._paired_us(public, direct, args.calls)) for _ in range(args.rounds)]
        rows.append([f"public op - direct, backend of {ops} torch ops", f"{statistics.median(got):.2f}"])
    print(tabulate(rows, headers=["paired", "us"]))

    _register("null-probe", _Busy(0))
    fragments = {
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,  # the fast path's guard to session 11
        "torch.compiler.is_dynamo_compiling()": api._is_dynamo_compiling,  # its guard since session 12
        "tensor getters of the fast path": lambda: (
            x.dtype in FLOAT_DTYPES, x.shape, x.is_cuda, x.is_cpu, bias.dtype, bias.shape == (N,),
            bias.is_cpu, bias.is_contiguous(), x.requires_grad, bias.requires_grad,
        ),  # fmt: skip
        "cache key + lookup": lambda: api._impls_get(
            ("bias_act_dropout", -1, x.dtype, M, N, "gelu", False, False, None, api._requested_get())
        ),
        "activation in the table": lambda: "gelu" in ACTIVATIONS,
        "the public op, null backend": lambda: fused_bias_act_dropout(x, bias, "gelu", backend="null-probe"),
    }
    rows = []
    for name, fragment in fragments.items():
        cost = [
            statistics.median(_with_ops(ops, fragment, x, args.calls) for _ in range(args.rounds))
            for ops in (0, 8)
        ]
        rows.append([name, f"{cost[0]:.2f}", f"{cost[1]:.2f}"])
    print(tabulate(rows, headers=["fragment", "us after 0 torch ops", "us after 8 torch ops"]))


if __name__ == "__main__":
    main()
