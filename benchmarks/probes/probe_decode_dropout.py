"""Why does the public op with dropout cost ~30 us more host time than the direct triton call at
decode size? Host time per call of: direct with a fixed HostRng, direct with a fresh draw per call,
and the public op; then cProfile of the public op."""

import cProfile
import pstats
import time

import torch

from backends.triton import bias_act_dropout as tbad
from dispatch import fused_bias_act_dropout
from dispatch import rng as dropout_rng

x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
fixed = dropout_rng.draw_for(x)
cases = {
    "direct, fixed HostRng": lambda: tbad.forward(x, b, "gelu", 0.1, fixed),
    "direct, draw_for per call": lambda: tbad.forward(x, b, "gelu", 0.1, dropout_rng.draw_for(x)),
    "api p=0.1": lambda: fused_bias_act_dropout(x, b, "gelu", 0.1, backend="triton"),
    "api p=0": lambda: fused_bias_act_dropout(x, b, "gelu", 0.0, backend="triton"),
}
for name, fn in cases.items():
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(500):
        fn()
    torch.cuda.synchronize()
    print(f"{name:28s} {(time.perf_counter() - start) / 500 * 1e6:8.1f} us, launcher cache {len(tbad._FORWARD._compiled)}")
for name in ("direct, draw_for per call", "api p=0.1"):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        cases[name]()
    prof.disable()
    torch.cuda.synchronize()
    print("====", name)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
