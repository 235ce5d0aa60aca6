"""Probe (not shipped): host cost of one fused_linear training call and its pieces (H200 host)."""
import cProfile, pstats, statistics, time, io
import torch
import torch.nn.functional as F
from tabulate import tabulate
from dispatch import fused_linear
from dispatch.autograd import FusedLinear
from dispatch.backends.triton import fused_linear as tfl, bias_act_dropout as bad

dev = torch.device("cuda")
M, K, N = 128, 768, 3072
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5).requires_grad_()
b = torch.randn(N, device=dev, dtype=torch.bfloat16, requires_grad=True)
gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
xd, wd, bd = x.detach(), w.detach(), b.detach()

class Null:
    @staticmethod
    def forward(x, w, b, a): return gy, None
    @staticmethod
    def backward(g, x, w, b, s, a, needs): return None, None, None

entries = {}
for act in ("relu", "gelu_tanh"):
    f = torch.relu if act == "relu" else (lambda t: F.gelu(t, approximate="tanh"))
    y0, saved0 = tfl.forward(xd, wd, bd, act)
    entries[f"{act} pytorch step"] = lambda f=f: torch.autograd.grad(f(F.linear(x, w, b)), (x, w, b), gy)
    for be in ("triton", "eager", "cublaslt"):
        entries[f"{act} {be} step"] = lambda be=be, act=act: torch.autograd.grad(fused_linear(x, w, b, act, backend=be), (x, w, b), gy)
    entries[f"{act} triton forward (impl)"] = lambda act=act: tfl.forward(xd, wd, bd, act)
    entries[f"{act} triton backward (impl)"] = lambda act=act, s=saved0: tfl.backward(gy, xd, wd, bd, s, act, (True, True, True))
    entries[f"{act} backward_pass"] = lambda act=act, s=saved0: bad.backward_pass(gy, s, None, act, 0.0, None, True, True)
entries["2 mm"] = lambda: (torch.mm(gy, wd), torch.mm(gy.t(), xd))
entries["Function.apply null + grad"] = lambda: torch.autograd.grad(FusedLinear.apply(x, w, b, Null, "relu"), (x,), gy, allow_unused=True)
entries["_addmm_activation"] = lambda: torch._addmm_activation(bd, xd, wd.t(), use_gelu=False)

for fn in entries.values():
    for _ in range(20): fn()
torch.cuda.synchronize()
res = {k: [] for k in entries}
for r in range(7):
    for k, fn in entries.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100): fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[k].append((t1 - t0) / 100 * 1e6)
print(tabulate([[k, round(statistics.median(v), 1), round(min(v), 1), round(max(v), 1)] for k, v in res.items()],
               headers=["entry (M=128, 3072x768 bf16)", "host us median", "min", "max"]))
for act in ("relu",):
    pr = cProfile.Profile()
    fn = entries[f"{act} triton step"]
    pr.enable()
    for _ in range(300): fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[-5000:])
