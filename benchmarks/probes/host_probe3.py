"""Probe (not shipped): split a triton fused_linear training step's host time (H200 host)."""
import json, os, statistics, time
import torch
import torch.nn.functional as F
from tabulate import tabulate
from dispatch.autograd import FusedLinear
from dispatch.backends.triton import fused_linear as tfl

M, K, N = 128, 768, 3072
dev = "cuda"
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(N, device=dev, dtype=torch.bfloat16, requires_grad=True)
gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
y0, s0 = tfl.forward(x.detach(), w.detach(), b.detach(), "relu")
gx0, gw0, gb0 = tfl.backward(gy, x.detach(), w.detach(), b.detach(), s0, "relu", (True, True, True))

class RealFwdNullBwd:
    forward = staticmethod(tfl.forward)
    @staticmethod
    def backward(g, x, w, b, s, a, needs): return None, None, None

class NullFwdRealBwd:
    @staticmethod
    def forward(x, w, b, a): return y0, s0
    backward = staticmethod(tfl.backward)

class NullFwdConstBwd:
    @staticmethod
    def forward(x, w, b, a): return y0, s0
    @staticmethod
    def backward(g, x, w, b, s, a, needs): return gx0, gw0, gb0

class NullFwdNullBwd:
    @staticmethod
    def forward(x, w, b, a): return y0, s0
    @staticmethod
    def backward(g, x, w, b, s, a, needs): return None, None, None

def step(impl):
    return lambda: torch.autograd.grad(FusedLinear.apply(x, w, b, impl, "relu"), (x, w, b), gy, allow_unused=True)

E = {
    "triton relu step": step(tfl),
    "real fwd, null bwd": step(RealFwdNullBwd),
    "null fwd, real bwd": step(NullFwdRealBwd),
    "null fwd, bwd returns kept grads": step(NullFwdConstBwd),
    "null fwd, null bwd (saves y)": step(NullFwdNullBwd),
    "pytorch relu step": lambda: torch.autograd.grad(torch.relu(F.linear(x, w, b)), (x, w, b), gy),
    "tfl.backward alone": lambda: tfl.backward(gy, x.detach(), w.detach(), b.detach(), s0, "relu", (True, True, True)),
}

def measure(mt, rounds=7):
    torch.autograd.set_multithreading_enabled(mt)
    for f in E.values():
        for _ in range(20): f()
    torch.cuda.synchronize()
    res = {k: [] for k in E}
    for _ in range(rounds):
        for k, f in E.items():
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(100): f()
            res[k].append((time.perf_counter() - t0) / 100 * 1e6)
            torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in res.items()}

a = measure(True); bm = measure(False); a2 = measure(True)
torch.autograd.set_multithreading_enabled(True)
out = os.environ.get("OUT", "/tmp")
from torch.profiler import profile, ProfilerActivity
for name in ("triton relu step", "pytorch relu step"):
    f = E[name]
    for _ in range(20): f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(30): f()
        torch.cuda.synchronize()
    tag = name.split()[0]
    prof.export_chrome_trace(f"{out}/trace_{tag}.json")
    print(name)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
print(tabulate([[k, round(a[k], 1), round(a2[k], 1), round(bm[k], 1)] for k in E],
               headers=["entry (M=128, 3072x768 bf16)", "host us", "again", "multithreading off"]))
