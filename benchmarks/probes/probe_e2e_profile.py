"""Where a GPT-2 training step spends its time, eager vs dispatch.patch (issue 7).

Session 1 measured the patched model at 1.16x eager's tokens/s, session 3 at 1.04x and 1.08x with the
same backend picks for the fused ops (bench_e2e-*-2026-11-30.json). This profiles a few steps of each
config with torch.profiler and prints, per config: wall time per step, the GPU's busy time per step
(sum of kernel times), and the kernels that take the most time, so the two can be told apart: a GPU
that got slower kernels, or a host that stopped keeping the GPU fed.

    PYTHONPATH=. python3 benchmarks/probes/probe_e2e_profile.py [--steps 3] [--layers 12]
    PYTHONPATH=. python3 benchmarks/probes/probe_e2e_profile.py --tiny     # CPU smoke run
    ... --configs compile,compile+patched    # issue 7's other target: where compile+patched loses
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import bench_e2e  # noqa: E402


def step(model, x, y) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def profile(model, batches, steps: int, device: torch.device) -> tuple[float, float, list]:
    """(wall ms per step, kernel ms per step, [(kernel name, ms per step, calls per step)])."""
    for x, y in batches[:3]:  # warm-up: compiles, decisions, allocator
        step(model, x, y)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for x, y in batches[3 : 3 + steps]:
            step(model, x, y)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)

    kernels = [e for e in events if device_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA] if cuda else []
    busy = sum(device_us(e) for e in kernels) / 1e3 / steps
    top = sorted(kernels, key=device_us, reverse=True)[:15]
    return wall, busy, [(e.key[:70], device_us(e) / 1e3 / steps, e.count / steps) for e in top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--configs", default="eager,patched", help="from eager,patched,compile,compile+patched")
    a = p.parse_args()
    args = argparse.Namespace(
        tiny=a.tiny, layers=2 if a.tiny else a.layers, dropout=0.1, vocab=1024 if a.tiny else 50257,
        seq=64 if a.tiny else 1024, batch=4 if a.tiny else 8,
    )  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bench_e2e.gpt2_config(args)
    from transformers import GPT2LMHeadModel

    torch.manual_seed(bench_e2e.SEED)
    state = GPT2LMHeadModel(config).state_dict()
    tokens, _ = bench_e2e.markov_corpus(args.batch * (a.steps + 3), args.seq + 1)
    tokens = tokens.to(device)
    batches = [
        (tokens[i : i + args.batch, :-1], tokens[i : i + args.batch, 1:])
        for i in range(0, len(tokens), args.batch)
    ]
    summary = []
    for name in a.configs.split(","):
        model, _ = bench_e2e.build(config, state, device, patched="patched" in name)
        if name.startswith("compile"):  # the warm-up steps in profile() compile it
            model = torch.compile(model)
        wall, busy, top = profile(model, batches, a.steps, device)
        summary.append([name, f"{wall:.2f}", f"{busy:.2f}", f"{wall - busy:.2f}"])
        print(f"--- {name}: top kernels (ms per step, calls per step)")
        print(tabulate([[k, f"{ms:.3f}", f"{n:.0f}"] for k, ms, n in top], headers=["kernel", "ms", "calls"]))
        del model
        torch._dynamo.reset()
    print(tabulate(summary, headers=["config", "wall ms/step", "kernel ms/step", "not kernel"]))


if __name__ == "__main__":
    main()
