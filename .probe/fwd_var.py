"""Probe (not shipped): no-dropout bias+act forward kernel variants vs the shipped tile kernel, inductor, a copy."""
import torch, triton, triton.language as tl, triton.testing
from tabulate import tabulate
from dispatch import fused_bias_act_dropout
from dispatch.backends.triton import bias_act_dropout as bad
from dispatch.backends.triton.activations import apply
from torch._inductor.utils import run_and_get_code

torch.set_grad_enabled(False)

@triton.jit
def tile32(X, B, Y, M, N, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None] * N + cols[None, :]  # int32
    if EVICT:
        z = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = apply(z, ACTIVATION)
    if EVICT:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    else:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

@triton.jit
def flat(X, B, Y, numel, N, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + offs % N, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    y = apply(z, ACTIVATION)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

def run_tile(x, b, y, act, bm, bn, w, ev):
    m, n = x.shape
    tile32[(triton.cdiv(m, bm), triton.cdiv(n, bn))](x, b, y, m, n, act, bm, bn, ev, num_warps=w)
    return y

def run_flat(x, b, y, act, blk, w):
    flat[(triton.cdiv(x.numel(), blk),)](x, b, y, x.numel(), x.shape[1], act, blk, num_warps=w)
    return y

rows = []
dumped = False
for (m, n, act) in ((12288, 20480, "relu"), (12288, 20480, "gelu"), (65536, 4096, "relu"), (65536, 4096, "gelu"),
                    (16384, 14336, "relu"), (8192, 3072, "gelu")):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x); y2 = torch.empty_like(x)
    ref = bad.forward(x, b, act, 0.0, None)
    if not dumped:
        _, code = run_and_get_code(lambda: fused_bias_act_dropout(x, b, act, 0.0, backend="inductor"))
        open("/tmp/ind_code.txt", "w").write("\n\n".join(code)); dumped = True
    entries = {"copy": lambda: y.copy_(x), "inductor": lambda: fused_bias_act_dropout(x, b, act, 0.0, backend="inductor"),
               "shipped": lambda: bad.forward(x, b, act, 0.0, None)}
    for bm, bn, w in ((1, 2048, 4), (2, 2048, 8), (4, 1024, 4), (8, 1024, 8)):
        for ev in (False, True):
            entries[f"tile32 {bm}x{bn} w{w}{' evict' if ev else ''}"] = (lambda bm=bm, bn=bn, w=w, ev=ev: run_tile(x, b, y2, act, bm, bn, w, ev))
    for blk, w in ((1024, 4), (2048, 4), (4096, 8), (8192, 8)):
        entries[f"flat {blk} w{w}"] = (lambda blk=blk, w=w: run_flat(x, b, y2, act, blk, w))
    for name, f in entries.items():
        out = f()
        if name not in ("copy", "inductor"):
            assert torch.equal(out, ref), name
    res = {}
    names = list(entries)
    for r in range(3):
        k = r * 5 % len(names)
        for name in names[k:] + names[:k]:
            res.setdefault(name, []).append(triton.testing.do_bench_cudagraph(entries[name], rep=20))
    cp = sorted(res["copy"])[1]
    part = []
    for name, v in res.items():
        ms = sorted(v)[1]
        part.append([f"{m}x{n} {act}", name, round(ms * 1e3, 1), round(ms / cp, 3)])
    print(tabulate(part), flush=True)
    rows += part
    del x, y, y2, ref; torch.cuda.empty_cache()
print(tabulate(rows, headers=["shape", "entry", "us", "x copy"]))
