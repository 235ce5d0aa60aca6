"""Per-expression host cost of the dispatcher's fast path on CPU vs CUDA tensors (timeit, best of 5):
which attribute reads and calls cost more for CUDA tensors."""

import os
import timeit

import torch
from tabulate import tabulate

os.environ.setdefault("DISPATCH_HEURISTICS_DIR", "/tmp/empty-heuristics")
from dispatch import fused_bias_act_dropout  # noqa: E402

EXPRS = [
    "x.dtype", "x.shape", "x.is_cuda", "x.is_cpu", "x.get_device()", "x.device", "x.requires_grad",
    "b.shape == (64,)", "b.is_contiguous()", "b.get_device() == d", "x.stride(0)", "x.numel()",
    "x.data_ptr()", "x.new_empty((4, 64))", "x3.reshape(4, 64)", "x.view_as(x3)",
    "api._is_compiling()", "api._is_grad_enabled()", "fused_bias_act_dropout(x, b, 'gelu')",
]
rows = []
for dev in ("cpu", "cuda"):
    x = torch.randn(4, 64, device=dev)
    b = torch.randn(64, device=dev)
    x3 = x.view(2, 2, 64)
    d = x.get_device()
    fused_bias_act_dropout(x, b, "gelu", backend="eager")
    env = dict(globals(), x=x, b=b, x3=x3, d=d)
    for i, e in enumerate(EXPRS):
        t = min(timeit.repeat(e, globals=env, number=20000, repeat=5)) / 20000 * 1e6
        if dev == "cpu":
            rows.append([e, t, None])
        else:
            rows[i][2] = t
print(tabulate(rows, headers=["expression", "cpu us", "cuda us"], floatfmt=".3f"))
