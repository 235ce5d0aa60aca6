"""Host cost of the CUDA generator calls behind the dropout draw (dispatch.rng.draw_for), with the
stream idle and with work queued (issue 3's decode rows: the public op with dropout measured 24 us
against 4.4 us without, by do_bench, whose L2 flush keeps kernels queued while the host works).

Hypothesis of session 4: get_offset() and set_offset() each ask CUDA whether the stream is capturing
(cudaStreamIsCapturing), and that query is slow while kernels are queued (14 us seen once, session 2).
Refuted in session 5 (the whole draw: 3.4 us idle, 4.1 us queued); the rows after the draw's time the
triton forward and the public op with and without dropout, to find where the rest goes.

    PYTHONPATH=. python3 benchmarks/probes/probe_generator_calls.py
"""

from __future__ import annotations

import statistics
import time

import torch
import triton.testing
from tabulate import tabulate

from backends.triton import bias_act_dropout as triton_bad
from dispatch import fused_bias_act_dropout
from dispatch import rng as dropout_rng


def per_call_us(fn, calls: int = 200, queued: bool = False) -> float:
    """Median over 5 loops of the host time per call; with ``queued``, a 256 MB memset is put on the
    stream before each call (what do_bench does, and what a model's previous kernels do)."""
    flush = torch.empty(2**26, dtype=torch.int32, device="cuda")
    loops = []
    for _ in range(5):
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(calls):
            if queued:
                flush.zero_()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        loops.append(total / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(loops)


def main() -> None:
    torch.cuda.init()  # default_generators is empty until CUDA is initialized
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    rng = dropout_rng.draw_for(x)
    xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
    gy = torch.randn_like(x)
    offset = gen.get_offset()
    calls = {
        "gen.initial_seed()": gen.initial_seed,
        "gen.get_offset()": gen.get_offset,
        "gen.set_offset(same)": lambda: gen.set_offset(offset),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "dispatch.rng.draw_for(x)": lambda: dropout_rng.draw_for(x),
        "dispatch.rng.draw(device) (randint kernel)": lambda: dropout_rng.draw(x.device),
        "x.add_(0) (one kernel launch)": lambda: x.add_(0),
        # session 5 found the draw at ~4 us: the rest of the decode row's 20 us is after it
        "triton forward, no dropout": lambda: triton_bad.forward(x, bias, "gelu", 0.0, None),
        "triton forward, dropout (rng drawn once)": lambda: triton_bad.forward(x, bias, "gelu", 0.1, rng),
        "public op, no dropout": lambda: fused_bias_act_dropout(x, bias, "gelu", 0.0, backend="triton"),
        "public op, dropout 0.1": lambda: fused_bias_act_dropout(x, bias, "gelu", 0.1, backend="triton"),
        # issue 3's decode forward+backward target (60 us, do_bench) against the autograd engine's own
        # floor: torch.autograd.grad of one trivial op, measured the same way
        "public op, dropout 0.1, fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(
            fused_bias_act_dropout(xg, bg, "gelu", 0.1, backend="triton"), (xg, bg), gy
        ),
        "autograd.grad of x * 2 (the engine's floor)": lambda: torch.autograd.grad(xg * 2, (xg,), gy),
    }
    launches = {name for name in calls if name.startswith(("triton", "public", "x.add_", "autograd"))}
    rows = [
        [
            name,
            f"{per_call_us(fn):.2f}",
            f"{per_call_us(fn, queued=True):.2f}",
            # the decode numbers are do_bench medians: device time, plus whatever host time
            # the L2 flush before each call does not cover
            f"{triton.testing.do_bench(fn, return_mode='median') * 1e3:.2f}" if name in launches else "",
            f"{kernel_us(fn):.2f}" if name in launches else "",
        ]
        for name, fn in calls.items()
    ]
    print(tabulate(rows, headers=["call", "idle us", "work queued us", "do_bench us", "kernels us"]))


def kernel_us(fn, calls: int = 50) -> float:
    """GPU time of the kernels one call launches (profiler, summed over the call's kernels)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / calls


if __name__ == "__main__":
    main()
