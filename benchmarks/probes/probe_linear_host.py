"""Where the host time of a triton fused_linear call goes at small M.

Session 5's calibration timed triton's fused_linear training (bf16, 3072x768, gelu) at ~0.7 ms a call
from M = 1 to M = 16384, and its inference at ~0.17 ms (eager: 0.5 and 0.08 ms): flat in M, so host
time. A count of what one training call does (forward: two allocations, a plan, two TMA descriptors,
one launch; backward: the activation-gradient kernel, two matmul launches, a column sum) predicts
~0.2-0.3 ms. This probe times each piece on its own, host time per call with the stream idle, then
profiles whole calls with cProfile, to find the rest.

    PYTHONPATH=. python3 benchmarks/probes/probe_linear_host.py
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import torch
from tabulate import tabulate

from backends.triton import fused_linear as tfl
from backends.triton import matmul
from dispatch import fused_linear

M, N, K = 1, 3072, 768
ACT = "gelu_tanh"


def per_call_us(fn, calls: int = 200) -> float:
    """Median over 5 loops of the wall time per call, synchronized at the end of each loop."""
    loops = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(loops)


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
    b = torch.randn(N, device=dev, dtype=dt)
    g = torch.randn(M, N, device=dev, dtype=dt)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    y, pre = tfl.forward(x, w, b, ACT)
    cfg, _, layouts = matmul.plan(x, w.t())

    def train(backend: str):
        def step():
            for t in (xg, wg, bg):
                t.grad = None
            fused_linear(xg, wg, bg, ACT, backend=backend).backward(g)

        return step

    def train_chain(backend: str, chain: int = 4):
        def step():
            for t in (xg, wg, bg):
                t.grad = None
            outs = [fused_linear(xg, wg, bg, ACT, backend=backend) for _ in range(chain)]
            torch.autograd.backward(outs, [g] * chain)

        return step

    pieces = {
        "torch.empty((M, N))": lambda: torch.empty((M, N), device=dev, dtype=dt),
        "matmul.plan(x, w.t())": lambda: matmul.plan(x, w.t()),
        "matmul._descriptor (one)": lambda: matmul._descriptor(x, layouts[0], 1, cfg.block_m, cfg.block_k),
        "matmul.launch (forward epilogue)": lambda: matmul.launch(x, w.t(), y, epilogue="forward",
                                                                  activation=ACT, bias=b, pre=pre),
        "launch_forward (y and pre)": lambda: tfl.launch_forward(x, w, b, ACT, True),
        "launch_act_grad": lambda: tfl.launch_act_grad(g, pre, ACT, True),
        "launch_mm grad_x": lambda: tfl.launch_mm(g, w),
        "launch_mm grad_w": lambda: tfl.launch_mm(g.t(), x),
        "tfl.backward (all three grads)": lambda: tfl.backward(g, x, w, b, pre, ACT, (True, True, True)),
        "public op, inference, triton": lambda: fused_linear(x, w, b, ACT, backend="triton"),
        "public op, inference, eager": lambda: fused_linear(x, w, b, ACT, backend="eager"),
        "public op, training, triton": train("triton"),
        "public op, training, eager": train("eager"),
        "training x4, one backward, triton (per call)": train_chain("triton"),
        "training x4, one backward, eager (per call)": train_chain("eager"),
        "autograd engine alone: (x * 2).sum().backward()": lambda: (xg * 2).sum().backward(),
    }
    for fn in pieces.values():  # compile and warm everything first
        fn()
    torch.cuda.synchronize()
    rows = []
    for name, fn in pieces.items():
        us = per_call_us(fn)
        rows.append([name, f"{us / 4 if 'x4' in name else us:.1f}"])
    print(tabulate(rows, headers=["piece", "host us a call"]))
    for name in ("public op, training, triton", "public op, training, eager"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            pieces[name]()
        prof.disable()
        torch.cuda.synchronize()
        print(f"==== cProfile, 200 calls: {name}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
