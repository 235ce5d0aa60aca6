"""Probe (not shipped): where a triton fused_linear training call's host time goes (H200 host)."""
import statistics, time
import torch
import torch.nn.functional as F
from tabulate import tabulate
from dispatch import fused_linear
from dispatch.autograd import FusedLinear
from dispatch.backends.triton import fused_linear as tfl

def mk(dev):
    M, K, N = 128, 768, 3072
    x = torch.randn(M, K, device=dev, requires_grad=True)
    w = torch.randn(N, K, device=dev, requires_grad=True)
    b = torch.randn(N, device=dev, requires_grad=True)
    return x, w, b, torch.randn(M, N, device=dev)

class Null:
    out = {}
    @staticmethod
    def forward(x, w, b, a): return Null.out[x.device.type], None
    @staticmethod
    def backward(g, x, w, b, s, a, needs): return None, None, None

E = {}
for dev in ("cpu", "cuda"):
    x, w, b, gy = mk(dev)
    Null.out[dev] = torch.empty(128, 3072, device=dev)
    E[f"null Function + grad(x, w, b), {dev}"] = lambda x=x, w=w, b=b, gy=gy: torch.autograd.grad(FusedLinear.apply(x, w, b, Null, "relu"), (x, w, b), gy, allow_unused=True)
xb, wb, bb, gyb = (t.to(torch.bfloat16).detach().requires_grad_(t.requires_grad) for t in mk("cuda"))
gyb = gyb.detach()
E["triton relu step (public op)"] = lambda: torch.autograd.grad(fused_linear(xb, wb, bb, "relu", backend="triton"), (xb, wb, bb), gyb)
E["triton relu step (FusedLinear.apply)"] = lambda: torch.autograd.grad(FusedLinear.apply(xb, wb, bb, tfl, "relu"), (xb, wb, bb), gyb)
E["pytorch relu step"] = lambda: torch.autograd.grad(torch.relu(F.linear(xb, wb, bb)), (xb, wb, bb), gyb)
y0, s0 = tfl.forward(xb.detach(), wb.detach(), bb.detach(), "relu")
E["tfl.forward + tfl.backward, main thread"] = lambda: (tfl.forward(xb.detach(), wb.detach(), bb.detach(), "relu"), tfl.backward(gyb, xb.detach(), wb.detach(), bb.detach(), s0, "relu", (True, True, True)))

E["triton relu forward only (FusedLinear.apply, grad on)"] = lambda: FusedLinear.apply(xb, wb, bb, tfl, "relu")
E["triton relu forward only (public op, grad on)"] = lambda: fused_linear(xb, wb, bb, "relu", backend="triton")
E["pytorch relu forward only (grad on)"] = lambda: torch.relu(F.linear(xb, wb, bb))
from dispatch.backends.triton import bias_act_dropout as tbad
E["tfl.backward alone"] = lambda: tfl.backward(gyb, xb.detach(), wb.detach(), bb.detach(), s0, "relu", (True, True, True))
E["backward_pass alone"] = lambda: tbad.backward_pass(gyb, s0, None, "relu", 0.0, None, True, True)
E["2 mm alone"] = lambda: (torch.mm(gyb, wb.detach()), torch.mm(gyb.t(), xb.detach()))
yp = torch.relu(F.linear(xb, wb, bb))
E["pytorch relu: grad of a kept graph (retain)"] = lambda: torch.autograd.grad(yp, (xb, wb, bb), gyb, retain_graph=True)

def measure(mt):
    torch.autograd.set_multithreading_enabled(mt)
    for f in E.values():
        for _ in range(20): f()
    torch.cuda.synchronize()
    res = {k: [] for k in E}
    for _ in range(7):
        for k, f in E.items():
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(100): f()
            res[k].append((time.perf_counter() - t0) / 100 * 1e6)
            torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in res.items()}

a = measure(True); bm = measure(False); a2 = measure(True)
print(tabulate([[k, round(a[k], 1), round(a2[k], 1), round(bm[k], 1)] for k in E],
               headers=["entry (M=128, 3072x768)", "host us", "again", "multithreading off"]))
