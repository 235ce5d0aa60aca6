"""Does any host call on the decode dropout path wait for the GPU? Each call runs right after a
~50 ms GPU sleep is queued: a call that synchronizes takes ~50 ms of host time instead of microseconds.
Then the same calls' host time with an idle GPU."""

import time

import torch
from tabulate import tabulate

from backends.triton import bias_act_dropout as tbad
from dispatch import fused_bias_act_dropout
from dispatch import rng as dropout_rng

x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
gen = torch.cuda.default_generators[0]
host = dropout_rng.draw_for(x)
cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.05)  # ~50 ms

cases = {
    "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
    "default_generators[0]": lambda: torch.cuda.default_generators[0],
    "gen.device": lambda: gen.device,
    "gen.initial_seed()": gen.initial_seed,
    "gen.get_offset()": gen.get_offset,
    "gen.set_offset(gen.get_offset())": lambda: gen.set_offset(gen.get_offset()),
    "draw_for(x)": lambda: dropout_rng.draw_for(x),
    "triton forward p=0.1 (fixed HostRng)": lambda: tbad.forward(x, b, "gelu", 0.1, host),
    "api p=0 (triton)": lambda: fused_bias_act_dropout(x, b, "gelu", 0.0, backend="triton"),
    "api p=0.1 (triton)": lambda: fused_bias_act_dropout(x, b, "gelu", 0.1, backend="triton"),
}
rows = []
for name, fn in cases.items():
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start = time.perf_counter()
    fn()
    busy = (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn()
    idle = (time.perf_counter() - start) / 200 * 1e6
    torch.cuda.synchronize()
    rows.append([name, busy, idle, "WAITS FOR THE GPU" if busy > 10_000 else ""])
print(tabulate(rows, headers=["call", "host us, GPU busy", "host us, loop", "verdict"], floatfmt=".1f"))
