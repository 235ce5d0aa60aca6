"""Per-expression host cost of the dispatcher's fast path (timeit, best of 5): CPU vs CUDA tensors, and
plain tensors (``x``, ``b``, ``w``) vs nn.Parameters (``bp``, ``wp``: what model code passes as bias and
weight), with the alternative forms of each check. Ends with the public ops over the null backend on
each kind of argument.

    PYTHONPATH=. python3 benchmarks/probes/probe_hot_path.py [--number 20000]
"""

import argparse
import os
import sys
import timeit

import torch
from tabulate import tabulate

os.environ.setdefault("DISPATCH_HEURISTICS_DIR", "/tmp/empty-heuristics")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_dispatch_overhead as bench  # noqa: E402

from dispatch import api, fused_bias_act_dropout, fused_linear, native  # noqa: E402, F401 (eval'd names)
from dispatch.select import ENV_VAR, clear_cache  # noqa: E402

EXPRS = [
    "x.dtype", "bp.dtype", "x.shape", "bp.shape", "x.is_cuda", "bp.is_cuda", "x.is_cpu",
    "x.get_device()", "bp.get_device()", "x.device", "x.requires_grad", "bp.requires_grad",
    "b.shape == (64,)", "bp.shape == (64,)", "b.is_contiguous()", "bp.is_contiguous()",
    "isinstance(x, Tensor)", "isinstance(bp, Tensor)", "type(bp) in TENSOR_TYPES",
    "x.stride(0)", "x.numel()", "x.data_ptr()", "x3.reshape(4, 64)", "x.view_as(x3)",
    "torch.compiler.is_compiling()", "api._is_dynamo_compiling()", "compiler._is_compiling_flag",
    "api._is_grad_enabled()",
    "fused_bias_act_dropout(x, b, 'gelu')", "fused_bias_act_dropout(x, bp, 'gelu')",
    "fused_linear(x, w, b, 'gelu')", "fused_linear(x, wp, bp, 'gelu')",
    "fused_bias_act_dropout(xg, bp, 'gelu', 0.1)", "fused_linear(xg, wp, bp, 'gelu')",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    native.wait()  # time the reads a warmed-up program makes (C++ once built, dispatch.native)
    print(f"fast path's tensor reads: {native.status()}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = {e: [e] for e in EXPRS}
    for dev in devices:
        device = torch.device(dev)
        bench._register_null(device)
        os.environ[ENV_VAR] = f"null-{dev}"
        clear_cache()
        x = torch.randn(4, 64, device=dev)
        b, w = torch.randn(64, device=dev), torch.randn(64, 64, device=dev)
        bp, wp = torch.nn.Parameter(b.clone()), torch.nn.Parameter(w.clone())
        env = dict(
            globals(), x=x, b=b, w=w, bp=bp, wp=wp, x3=x.view(2, 2, 64), xg=x.clone().requires_grad_(),
            Tensor=torch.Tensor, TENSOR_TYPES=frozenset({torch.Tensor, torch.nn.Parameter}),
            compiler=torch.compiler,
        )
        for e in EXPRS:
            eval(e, env)
            t = min(timeit.repeat(e, globals=env, number=args.number, repeat=5)) / args.number * 1e6
            rows[e].append(t)
    del os.environ[ENV_VAR]
    headers = ["expression"] + [f"{d} us" for d in devices]
    print(tabulate(list(rows.values()), headers=headers, floatfmt=".3f"))


if __name__ == "__main__":
    main()
