"""Why does the public op cost ~5 us over the triton bias_act_dropout training call, and ~2 us over the
null backend (issue 2, bench_dispatch_overhead's one row over 3 us, sessions 9-10)?

The public op and the direct call run the same Python apart from the fast path's checks and the cached
lookup. Two explanations predict different numbers here:

- host state: after a triton launch (its C launcher, the CUDA driver, the autograd graph of a real
  call) the fast path's bytecode and tensor getters run from cold caches. Then the null backend's
  overhead, timed right after an untimed triton call, rises to the triton row's;
- something in the pair itself (the api's call reaching triton differently): then it stays at ~2 us.

Rows: api - direct in adjacent pairs (order swapped each pair), each timed call preceded by an
untimed "prelude" call, median over --calls pairs, median of --rounds; against the chosen backend's
checked op (what bench_dispatch_overhead's direct side calls), its ``trusted`` entry (what the public
op calls since session 11) and the null backend. Then the fast path's fragments, each timed hot and
right after a triton training call (fragment + prelude vs prelude alone).

    PYTHONPATH=. python3 benchmarks/probes/probe_dropout_overhead.py [--calls 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_dispatch_overhead as bench  # noqa: E402

from dispatch import api, explain, fused_bias_act_dropout  # noqa: E402
from dispatch import rng as dropout_rng  # noqa: E402
from dispatch.api import _BiasActDropout  # noqa: E402
from dispatch.checks import FLOAT_DTYPES  # noqa: E402
from dispatch.registry import backends  # noqa: E402

M, N = bench.M, bench.N


def _paired(api_call: Callable, direct: Callable, prelude: Optional[Callable], calls: int) -> float:
    """Median of api - direct (us), each timed call right after an untimed ``prelude()``."""
    clock = time.perf_counter_ns
    diffs = []
    for i in range(calls):
        first, second = (api_call, direct) if i % 2 == 0 else (direct, api_call)
        if prelude is not None:
            prelude()
        t0 = clock()
        first()
        t1 = clock()
        if prelude is not None:
            prelude()
        t2 = clock()
        second()
        t3 = clock()
        a, d = (t1 - t0, t3 - t2) if i % 2 == 0 else (t3 - t2, t1 - t0)
        diffs.append((a - d) / 1e3)
    return statistics.median(diffs)


def _fragment(fragment: Callable, prelude: Optional[Callable], calls: int) -> float:
    """Median us of ``fragment`` right after ``prelude`` (paired against an empty timed region)."""
    clock = time.perf_counter_ns
    diffs = []
    for _ in range(calls):
        if prelude is not None:
            prelude()
        t0 = clock()
        fragment()
        t1 = clock()
        if prelude is not None:
            prelude()
        t2 = clock()
        t3 = clock()
        diffs.append(((t1 - t0) - (t3 - t2)) / 1e3)
    return statistics.median(diffs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (triton interpreted)")
    args = p.parse_args()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    null_name = bench._register_null(device)
    null = backends()[null_name].ops["bias_act_dropout"]
    x = torch.randn(M, N, device=device).requires_grad_()
    xp = torch.randn(M, N, device=device).requires_grad_()  # the preludes' own input
    bias = torch.randn(N, device=device)
    triton = backends()["triton"].ops["bias_act_dropout"]
    eager = backends()["eager"].ops["bias_act_dropout"]
    chosen = explain("fused_bias_act_dropout", x, bias, "gelu", 0.1).backend.name
    print(f"dispatcher's choice for the training row: {chosen}")

    def direct(impl):
        return lambda: _BiasActDropout.apply(x, bias, impl, "gelu", 0.1, dropout_rng.draw_for(x))

    def prelude(impl, grad: bool = True):
        if grad:
            return lambda: _BiasActDropout.apply(xp, bias, impl, "gelu", 0.1, dropout_rng.draw_for(xp))
        return lambda: impl.forward(xp.detach(), bias, "gelu", 0.1, dropout_rng.draw_for(xp))

    preludes = {
        "none": None,
        "triton training call": prelude(triton),
        "triton forward, no autograd": prelude(triton, grad=False),
        "eager training call": prelude(eager),
        "null training call": prelude(null),
    }
    rows = []
    chosen_op = backends()[chosen].ops["bias_act_dropout"]
    sides = [  # (row label, backend, the direct side's op)
        (chosen, chosen, chosen_op),
        (f"{chosen}, direct = its trusted entry", chosen, getattr(chosen_op, "trusted", chosen_op)),
        (null_name, null_name, null),
    ]
    for label, backend, impl in sides:
        call = lambda backend=backend: fused_bias_act_dropout(x, bias, "gelu", 0.1, backend=backend)  # noqa: E731
        for name, pre in preludes.items():
            for _ in range(100):
                call(), direct(impl)()
            got = [_paired(call, direct(impl), pre, args.calls) for _ in range(args.rounds)]
            rows.append([label, name, f"{statistics.median(got):.2f}", " ".join(f"{g:.2f}" for g in got)])
    print(tabulate(rows, headers=["backend", "prelude before each timed call", "api - direct us", "rounds"]))

    index = max(x.get_device(), -1)  # the cache key's device item
    fragments = {
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,  # the fast path's guard to session 11
        "torch.compiler.is_dynamo_compiling()": api._is_dynamo_compiling,  # its guard since session 12
        "x getters (dtype, shape, is_cuda, get_device)": lambda: (
            x.dtype in FLOAT_DTYPES, x.shape, x.is_cuda, x.get_device()
        ),
        "bias checks (dtype, shape, is_cuda, get_device, is_contiguous)": lambda: (
            bias.dtype, bias.shape == (N,), bias.is_cuda, bias.get_device(), bias.is_contiguous()
        ),
        "requires_grad + grad mode": lambda: x.requires_grad and api._is_grad_enabled(),
        "cache key + lookup": lambda: api._impls_get(
            ("bias_act_dropout", index, x.dtype, M, N, "gelu", True, True, None, api._requested_get())
        ),
        "dropout_rng.draw_for(x)": lambda: dropout_rng.draw_for(x),
        "whole api, null backend": lambda: fused_bias_act_dropout(x, bias, "gelu", 0.1, backend=null_name),
        "direct, null backend": direct(null),
    }
    rows = []
    for name, fragment in fragments.items():
        cells = []
        for pre in ("none", "triton training call"):
            got = [_fragment(fragment, preludes[pre], args.calls) for _ in range(args.rounds)]
            cells.append(statistics.median(got))
        rows.append([name, *(f"{c:.2f}" for c in cells)])
    print(tabulate(rows, headers=["fragment", "us, hot", "after a triton training call"]))


if __name__ == "__main__":
    main()
