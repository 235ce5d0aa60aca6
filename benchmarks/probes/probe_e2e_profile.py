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
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import bench_e2e  # noqa: E402


def profile(model, batches, steps: int, device: torch.device) -> tuple[float, float, list, list]:
    """(wall ms per step, kernel ms per step, [(kernel name, ms per step, calls per step)] for every
    kernel, the longest first, and the same for host ops by their self CPU time)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    for x, y in batches[:3]:  # warm-up: compiles, decisions, allocator
        bench_e2e.step(model, opt, x, y, device)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for x, y in batches[3 : 3 + steps]:
            bench_e2e.step(model, opt, x, y, device)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)

    kernels = [e for e in events if device_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA] if cuda else []
    busy = sum(device_us(e) for e in kernels) / 1e3 / steps
    ranked = sorted(kernels, key=device_us, reverse=True)
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return (
        wall,
        busy,
        [(e.key, device_us(e) / 1e3 / steps, e.count / steps) for e in ranked],
        [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in host],
    )


def _shape_of(name: str) -> str:
    """A kernel's name without inductor's running number (triton_poi_fused_add_3 -> ..._add_N), so
    the same fusion in two compiled models compares equal."""
    head, _, tail = name.rpartition("_")
    return f"{head}_N" if name.startswith("triton_") and tail.isdigit() else name


def diff(a: list, b: list, rows: int = 25) -> list:
    """Kernels whose time or count per step differ most between configs a and b."""
    per: dict = {}
    for i, kernels in enumerate((a, b)):
        for name, ms, calls in kernels:
            entry = per.setdefault(_shape_of(name), [0.0, 0.0, 0.0, 0.0])
            entry[i] += ms
            entry[2 + i] += calls
    out = sorted(per.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]), reverse=True)[:rows]
    return [
        [k[:70], f"{v[0]:.3f}", f"{v[1]:.3f}", f"{v[1] - v[0]:+.3f}", f"{v[2]:.0f}", f"{v[3]:.0f}"]
        for k, v in out
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--configs", default="eager,patched", help="from eager,patched,compile,compile+patched")
    p.add_argument("--bias-in-dropout", action="store_true", help="patch(bias_in_linear=False)")
    p.add_argument("--no-linear-dropout", action="store_true", help="patch(linear_dropout=False)")
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
    summary, profiles, host_profiles = [], {}, {}
    for name in a.configs.split(","):
        model, _ = bench_e2e.build(
            config, state, device, "patched" in name, not a.bias_in_dropout, not a.no_linear_dropout
        )
        if name.startswith("compile"):  # the warm-up steps in profile() compile it
            model = torch.compile(model)
        wall, busy, kernels, host = profile(model, batches, a.steps, device)
        launches = sum(n for _, _, n in kernels)
        host_ms = sum(ms for _, ms, _ in host)
        summary.append(
            [name, f"{wall:.2f}", f"{busy:.2f}", f"{wall - busy:.2f}", f"{launches:.0f}", f"{host_ms:.2f}"]
        )
        host_profiles[name] = host
        print(f"--- {name}: top kernels (ms per step, calls per step)")
        rows = [[k[:70], f"{ms:.3f}", f"{n:.0f}"] for k, ms, n in kernels[:15]]
        print(tabulate(rows, headers=["kernel", "ms", "calls"]))
        profiles[name] = kernels
        del model
        torch._dynamo.reset()
    names = list(profiles)
    if len(names) >= 2:
        first, second = names[:2]
        print(f"--- kernels that differ most: {first} -> {second} (ms and calls per step)")
        heads = ["kernel", f"ms {first}", f"ms {second}", "diff", f"calls {first}", f"calls {second}"]
        print(tabulate(diff(profiles[first], profiles[second]), headers=heads))
        print("--- host ops that differ most (self CPU ms and calls per step, under the profiler)")
        print(tabulate(diff(host_profiles[first], host_profiles[second]), headers=heads))
    heads = ["config", "wall ms/step", "kernel ms/step", "not kernel", "kernels/step", "host op ms/step"]
    print(tabulate(summary, headers=heads))


if __name__ == "__main__":
    main()
