"""Launch-setting sweep for the Triton bias_act_dropout kernels on large shapes: each setting is
checked bit for bit against the shipped setting (elementwise math, so tiling must not change y or
grad_x) and timed with do_bench next to a device copy of the same tensor."""

import itertools

import torch
import triton.testing
from tabulate import tabulate

from backends.triton import bias_act_dropout as op
from dispatch import rng as dropout_rng

SHAPES = [(65536, 4096), (16384, 14336)]
FORWARD = [(64, 4), (32, 4), (64, 8), (128, 8), (32, 2), (16, 4)]  # (bytes a thread, warps)
MAX_N = [1024, 512, 2048]
BACKWARD = [(8, 8), (16, 8), (8, 4), (16, 4), (4, 8)]  # (elements a thread, warps)
ROWS = [64, 32, 128]

default = (op.FORWARD_BYTES_PER_THREAD, op.FORWARD_WARPS, op.MAX_BLOCK_N, op.BACKWARD_PER_THREAD,
           op.BACKWARD_WARPS, op.MAX_ROWS_PER_PROGRAM)


def apply(fb, fw, mn, bp, bw, rows):
    op.FORWARD_BYTES_PER_THREAD, op.FORWARD_WARPS, op.MAX_BLOCK_N = fb, fw, mn
    op.BACKWARD_PER_THREAD, op.BACKWARD_WARPS, op.MAX_ROWS_PER_PROGRAM = bp, bw, rows
    op.config.cache_clear()


def ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


rows_out = []
for m, n in SHAPES:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn_like(x)
    rng = dropout_rng.draw(x.device)
    dst = torch.empty_like(x)
    copy = ms(lambda: dst.copy_(x))
    apply(*default)
    ref_y = op.forward(x, b, "gelu", 0.1, rng)
    ref_gx, ref_gb = op.backward(gy, x, b, "gelu", 0.1, rng, True, True)
    for fb, fw in FORWARD:
        for mn in MAX_N:
            apply(fb, fw, mn, *default[3:])
            try:
                y = op.forward(x, b, "gelu", 0.1, rng)
                ok = torch.equal(y, ref_y)
                t1 = ms(lambda: op.forward(x, b, "gelu", 0.1, rng))
                t0 = ms(lambda: op.forward(x, b, "gelu", 0.0, None))
                rows_out.append([f"{m}x{n}", "fwd", f"{fb}B/t w{fw} maxN{mn}", ok, t1 / copy, t0 / copy])
            except Exception as e:  # a setting the compiler rejects: recorded, not fatal
                rows_out.append([f"{m}x{n}", "fwd", f"{fb}B/t w{fw} maxN{mn}", repr(e)[:60], None, None])
    for (bp, bw), rows in itertools.product(BACKWARD, ROWS):
        apply(*default[:3], bp, bw, rows)
        try:
            gx, gb = op.backward(gy, x, b, "gelu", 0.1, rng, True, True)
            ok = torch.equal(gx, ref_gx) and torch.allclose(gb.float(), ref_gb.float(), rtol=1e-2, atol=1e-1)
            t1 = ms(lambda: op.backward(gy, x, b, "gelu", 0.1, rng, True, True))
            t0 = ms(lambda: op.backward(gy, x, b, "gelu", 0.0, None, True, True))
            rows_out.append([f"{m}x{n}", "bwd", f"{bp}/t w{bw} rows{rows}", ok, t1 / copy, t0 / copy])
        except Exception as e:
            rows_out.append([f"{m}x{n}", "bwd", f"{bp}/t w{bw} rows{rows}", repr(e)[:60], None, None])
    apply(*default)
print(f"default: {default}")
print(tabulate(rows_out, headers=["shape", "pass", "setting", "exact", "p=0.1 / copy", "p=0 / copy"], floatfmt=".3f"))
