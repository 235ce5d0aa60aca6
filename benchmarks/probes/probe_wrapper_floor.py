"""What does any Python between a real backend's calls cost, next to the dispatcher's fast path
(issue 2: the real-backend rows of bench_dispatch_overhead sit ~1 us above the null backend's)?

For each backend call (eager fused_linear inference, triton bias_act_dropout training on CUDA, and the
null backend), loops of back-to-back calls timed as bench_dispatch_overhead does (median over passes,
loop order alternated), each against the direct call:

- ``wrapper``: one Python function around the direct call, nothing else;
- ``wrapper + getters``: the same plus the tensor reads of the public op's fast path (types, dtypes,
  shapes, devices, requires_grad, bias contiguity), no key and no lookup;
- ``api``: the public op;
- ``direct (A/A)``: the direct call against itself.

If ``wrapper`` already costs most of what ``api`` does over the null backend's overhead, the extra is
the host state any Python pays after a real call; if it scales with ``wrapper + getters``, with the
amount of Python.

    PYTHONPATH=. python3 benchmarks/probes/probe_wrapper_floor.py [--calls 1000] [--repeats 11]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_dispatch_overhead as bench  # noqa: E402

from dispatch import explain, fused_bias_act_dropout, fused_linear, native  # noqa: E402
from dispatch import rng as dropout_rng  # noqa: E402
from dispatch.api import _BiasActDropout  # noqa: E402
from dispatch.registry import backends, fused_linear_inference  # noqa: E402
from dispatch.select import ENV_VAR, clear_cache  # noqa: E402

M, N, K = bench.M, bench.N, bench.K


def _getters(x, w, b) -> bool:
    return (
        type(x) is torch.Tensor and x.dtype is not None and len(x.shape) > 0 and x.is_cuda
        and x.get_device() >= 0 and (w is None or (w.dtype is not None and w.is_cuda and w.get_device() >= 0
                                                    and len(w.shape) == 2))
        and b.dtype is not None and b.is_cuda and b.get_device() >= 0 and b.shape == (N,)
        and b.is_contiguous() and (x.requires_grad or b.requires_grad or True)
    )  # fmt: skip


def _cases(device: torch.device) -> list[tuple[str, object, object]]:
    xk, w = torch.randn(M, K, device=device), torch.randn(N, K, device=device)
    bias = torch.randn(N, device=device)
    x_grad = torch.randn(M, N, device=device, requires_grad=True)
    lin = explain("fused_linear", xk, w, bias, "gelu")
    infer = fused_linear_inference(lin.backend.ops["fused_linear"])
    drop = explain("fused_bias_act_dropout", x_grad, bias, "gelu", 0.1)
    bad = drop.backend.ops["bias_act_dropout"]

    def lin_direct():
        return infer(xk, w, bias, "gelu")

    def drop_direct():
        return _BiasActDropout.apply(x_grad, bias, bad, "gelu", 0.1, dropout_rng.draw_for(x_grad))

    def wrap(fn, *args):
        return fn()

    def wrap_get(fn, x, w, b):
        _getters(x, w, b)
        return fn()

    null = backends()[bench._register_null(device)].ops["fused_linear"]
    null_infer = fused_linear_inference(null)

    def null_direct():
        return null_infer(xk, w, bias, "gelu")

    def variants(direct, x, w, api):
        with_getters = lambda: wrap_get(direct, x, w, bias)  # noqa: E731
        return {"wrapper": lambda: wrap(direct), "wrapper + getters": with_getters, "api": api}

    return [
        (f"{lin.backend.name} fused_linear inference", lin_direct,
         variants(lin_direct, xk, w, lambda: fused_linear(xk, w, bias, "gelu")), None),
        (f"{drop.backend.name} bias_act_dropout training", drop_direct,
         variants(drop_direct, x_grad, None, lambda: fused_bias_act_dropout(x_grad, bias, "gelu", 0.1)),
         None),
        ("null fused_linear inference", null_direct,
         variants(null_direct, xk, w, lambda: fused_linear(xk, w, bias, "gelu")), f"null-{device.type}"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    native.wait()  # time the reads a warmed-up program makes (C++ once built, dispatch.native)
    print(f"fast path's tensor reads: {native.status()}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for label, direct, variants, env in _cases(device):
        if env:
            os.environ[ENV_VAR] = env
        clear_cache()
        results = {name: [] for name in ["direct (A/A)", *variants]}
        for repeat in range(args.repeats):
            for name in results:
                side = direct if name == "direct (A/A)" else variants[name]
                api_us, direct_us = bench._sample(side, direct, args.calls, device, repeat % 2 == 0)
                results[name].append(api_us - direct_us)
        os.environ.pop(ENV_VAR, None)
        clear_cache()
        rows.append([label] + [f"{statistics.median(v):+.2f}" for v in results.values()])
        headers = ["direct call", *results]
    print(tabulate(rows, headers=["us over the direct call", *headers[1:]]))


if __name__ == "__main__":
    main()
