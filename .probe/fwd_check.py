"""Probe (not shipped): the shipped flat forward (no dropout) vs the tile kernel, inductor, a copy (H200, bf16)."""
import torch, triton.testing
from tabulate import tabulate
from dispatch import fused_bias_act_dropout
from dispatch.backends.triton import bias_act_dropout as bad

torch.set_grad_enabled(False)
fits = bad._flat_kernel_fits
rows = []
for (m, n, act) in ((12288, 20480, "relu"), (12288, 18176, "gelu"), (2048, 24576, "gelu"), (12288, 1536, "gelu"),
                    (65536, 4096, "gelu"), (8192, 3072, "gelu"), (256, 20480, "relu"), (2048, 5120, "gelu")):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    def tile():
        bad._flat_kernel_fits = lambda *a: False
        try:
            return bad.forward(x, b, act, 0.0, None)
        finally:
            bad._flat_kernel_fits = fits
    entries = {"copy": lambda: y.copy_(x), "inductor": lambda: fused_bias_act_dropout(x, b, act, 0.0, backend="inductor"),
               "triton": lambda: fused_bias_act_dropout(x, b, act, 0.0, backend="triton"), "tile": tile}
    assert fits(x, None, m, n)
    assert torch.equal(entries["triton"](), tile())
    entries["inductor"]()
    res = {}
    names = list(entries)
    for r in range(3):
        for name in names[r:] + names[:r]:
            res.setdefault(name, []).append(triton.testing.do_bench_cudagraph(entries[name], rep=20))
    cp = sorted(res["copy"])[1]
    for name, v in res.items():
        ms = sorted(v)[1]
        rows.append([f"{m}x{n} {act}", name, round(ms * 1e3, 1), round(ms / cp, 3)])
    del x, y; torch.cuda.empty_cache()
print(tabulate(rows, headers=["shape", "entry", "us", "x copy"]))
