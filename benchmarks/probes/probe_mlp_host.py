"""Host time of one GPT-2 MLP block, forward + backward, original vs dispatch.patch (issue 7).

At batch 1 (session 10, bench_e2e_batch1) the whole training step is host-bound: eager 25.65 ms a
step, patched 26.92 ms. The patched model launches fewer kernels, so the extra 1.3 ms is Python of
ours: 12 blocks x (two fused_linear calls + one dropout call), ~50 us each forward + backward. This
times, on tensors small enough that the GPU never makes the host wait (16 tokens), the host cost per
block of: the original MLP, the patched one, the patched one with the eager backend's fused_linear
forced back through the autograd.Function (``differentiable`` off: the code before session 10), and
each replaced piece alone next to what it replaces. Loops of --calls iterations (forward under bf16
autocast, backward), the variants interleaved, --rounds rounds, median microseconds per iteration.

    PYTHONPATH=. python3 benchmarks/probes/probe_mlp_host.py [--calls 500] [--rounds 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
from tabulate import tabulate

import dispatch
from backends.eager import fused_linear as eager_fused_linear
from dispatch.nn import FusedBiasActDropout, FusedLinear
from dispatch.select import clear_cache


def _loop(step: Callable[[], None], calls: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--profile", type=int, default=2000, help="cProfile this many steps of the fused modules")
    args = p.parse_args()
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = GPT2Config(n_embd=768, n_layer=1, n_head=12, resid_pdrop=0.1)
    hf = GPT2MLP(4 * 768, config).to(device).train()
    patched = copy.deepcopy(hf)
    print(dispatch.patch(patched))
    x = torch.randn(1, args.tokens, 768, device=device, requires_grad=True)
    grad = torch.randn(1, args.tokens, 768, device=device)
    grad_up = torch.randn(1, args.tokens, 3072, device=device)
    linear = torch.nn.Linear(768, 3072, device=device)
    fused = FusedLinear(768, 3072, activation="gelu_tanh", device=device)
    gelu = torch.nn.GELU(approximate="tanh")
    drop, fused_drop = torch.nn.Dropout(0.1), FusedBiasActDropout(768, "identity", 0.1, bias=False)
    h = torch.randn(1, args.tokens, 768, device=device, requires_grad=True)

    def run(module: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor, g: torch.Tensor):
        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = module(inp)
            out.backward(g.to(out.dtype))

        return step

    # name: (step, with the eager fused_linear's ``differentiable`` off: the autograd.Function path)
    variants = {
        "GPT2MLP (original)": (run(hf, x, grad), False),
        "GPT2MLP patched": (run(patched, x, grad), False),
        "GPT2MLP patched, Function path": (run(patched, x, grad), True),
        "nn.Linear + GELU(tanh)": (run(lambda t: gelu(linear(t)), x, grad_up), False),
        "FusedLinear(gelu_tanh)": (run(fused, x, grad_up), False),
        "FusedLinear(gelu_tanh), Function path": (run(fused, x, grad_up), True),
        "nn.Dropout(0.1)": (run(drop, h, grad), False),
        "FusedBiasActDropout(0.1)": (run(fused_drop, h, grad), False),
    }
    native = eager_fused_linear.differentiable
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (step, off) in variants.items():
            eager_fused_linear.differentiable = (lambda activation: None) if off else native
            clear_cache()
            for _ in range(20):
                step()
            samples[name].append(_loop(step, args.calls, cuda))
    eager_fused_linear.differentiable = native
    clear_cache()
    base = statistics.median(samples["GPT2MLP (original)"])
    rows = [
        [name, f"{statistics.median(got):.1f}", f"{min(got):.1f}", f"{statistics.median(got) - base:+.1f}"]
        for name, got in samples.items()
    ]
    print(f"host us per forward + backward ({device.type}, {args.tokens} tokens, bf16 autocast)")
    print(tabulate(rows, headers=["variant", "median us", "min us", "vs original MLP"]))
    for name in ("FusedBiasActDropout(0.1)", "FusedLinear(gelu_tanh)", "nn.Dropout(0.1)"):
        if args.profile:
            _profile(name, variants[name][0], args.profile, cuda)


def _profile(name: str, step: Callable[[], None], calls: int, cuda: bool) -> None:
    """Where the host time of ``step`` goes, by Python function (cProfile, its own overhead included)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    if cuda:
        torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"--- cProfile, {name}, {calls} steps (tottime = own time, not counting callees)")
    print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
