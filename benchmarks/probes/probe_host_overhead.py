"""Where the host time of a decode-sized (1 x 4096 bf16) call goes: per-call host microseconds of each
layer (no synchronization inside the loop), do_bench GPU-side medians, and a cProfile of the public
op in training mode. Compares Triton's own launch (``kernel[grid](...)``) with ``Launcher`` on the
same arguments, and the two rng forms (a randint tensor vs host integers)."""

import cProfile
import pstats
import time

import torch
import triton
import triton.testing

from backends.triton import bias_act_dropout as tbad
from dispatch import fused_bias_act_dropout
from dispatch import rng as dropout_rng

dev = "cuda"
x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
b = torch.randn(4096, device=dev, dtype=torch.bfloat16)
gy = torch.randn_like(x)
rng = dropout_rng.draw(x.device)
host_rng = dropout_rng.draw_for(x)
xl, bl = x.clone().requires_grad_(), b.clone().requires_grad_()


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


y_out = torch.empty_like(x)
cases = {
    "torch.empty": lambda: torch.empty(1, 4096, device=dev),
    "torch.randint (rng draw)": lambda: dropout_rng.draw(x.device),
    "triton.cdiv": lambda: triton.cdiv(4096, 1024),
    "draw_for (host rng)": lambda: dropout_rng.draw_for(x),
    "kernel[grid] launch p=0": lambda: tbad._FORWARD.kernel[(1, 4)](
        x, b, y_out, x, 0, 0, 0, 0, 1, 4096, 4096, 1, 0, 1.0, "gelu", True, False, False, True, False, 1, 1024,
        num_warps=4,
    ),
    "Launcher launch p=0": lambda: tbad._FORWARD(
        (1, 4), (x, b, y_out, x, 0, 0, 0, 0, 1, 4096, 4096, 1, 0, 1.0),
        ("gelu", True, False, False, True, False, 1, 1024), 4,
    ),
    "direct fwd p=0": lambda: tbad.forward(x, b, "gelu", 0.0, None),
    "direct fwd p=0.1 (tensor rng)": lambda: tbad.forward(x, b, "gelu", 0.1, rng),
    "direct fwd p=0.1 (host rng)": lambda: tbad.forward(x, b, "gelu", 0.1, host_rng),
    "direct bwd p=0.1 (tensor rng)": lambda: tbad.backward(gy, x, b, "gelu", 0.1, rng, True, True),
    "direct bwd p=0.1 (host rng)": lambda: tbad.backward(gy, x, b, "gelu", 0.1, host_rng, True, True),
    "api inference p=0": lambda: fused_bias_act_dropout(x, b, "gelu", 0.0, backend="triton"),
    "api inference p=0.1": lambda: fused_bias_act_dropout(x, b, "gelu", 0.1, backend="triton"),
    "api train p=0 (autograd.grad)": lambda: torch.autograd.grad(
        fused_bias_act_dropout(xl, bl, "gelu", 0.0, backend="triton"), (xl, bl), gy
    ),
    "api train p=0.1 (autograd.grad)": lambda: torch.autograd.grad(
        fused_bias_act_dropout(xl, bl, "gelu", 0.1, backend="triton"), (xl, bl), gy
    ),
    "eager F.gelu+dropout train": lambda: torch.autograd.grad(
        torch.nn.functional.dropout(torch.nn.functional.gelu(xl + bl), 0.1), (xl, bl), gy
    ),
}
rows = []
for name, fn in cases.items():
    h = host_us(fn)
    g = triton.testing.do_bench(fn, return_mode="median") * 1e3
    rows.append((name, h, g))
    print(f"{name:34s} host {h:8.1f} us   do_bench {g:8.1f} us")

prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    torch.autograd.grad(fused_bias_act_dropout(xl, bl, "gelu", 0.1, backend="triton"), (xl, bl), gy)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
