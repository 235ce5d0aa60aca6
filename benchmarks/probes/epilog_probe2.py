"""Probe (not shipped): nvmath cuBLASLt AUX epilogues vs PyTorch; composed training steps. H200 bf16."""
import time
import torch, triton.testing
import torch.nn.functional as F
from tabulate import tabulate
from nvmath.linalg.advanced import Matmul, MatmulEpilog
from dispatch.backends.triton import bias_act_dropout

dev = torch.device("cuda")
rows = []
def bench(shape, name, fn):
    try:
        fn(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50): fn()
        torch.cuda.synchronize()
        host = (time.perf_counter() - t0) / 50 * 1e6
        g = triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
        rows.append([shape, name, round(g, 1), round(host, 1)])
    except Exception as exc:
        rows.append([shape, name, f"failed {type(exc).__name__}: {str(exc)[:80]}", ""])
    print(rows[-1], flush=True)

def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()

for M, K, N in ((8192, 768, 3072), (2048, 768, 3072), (8192, 1024, 4096), (8192, 3072, 768)):
    shape = f"{M}x{N}x{K}"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5).requires_grad_()
    b = torch.randn(N, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    for act in ("gelu_tanh", "relu"):
        f = (lambda t: F.gelu(t, approximate="tanh")) if act == "gelu_tanh" else torch.relu
        def pt_fwd(): return f(F.linear(xd, wd, bd))
        def pt_step():
            y = f(F.linear(x, w, b)); return torch.autograd.grad(y, (x, w, b), gy)
        bench(shape, f"{act} pytorch fwd", pt_fwd)
        bench(shape, f"{act} pytorch train", pt_step)
        bench(shape, f"{act} _addmm_activation fwd", lambda: torch._addmm_activation(bd, xd, wd.t(), use_gelu=act == "gelu_tanh"))
        ep = MatmulEpilog.GELU_AUX_BIAS if act == "gelu_tanh" else MatmulEpilog.RELU_AUX_BIAS
        mm = Matmul(wd, xd.t())
        mm.plan(epilog=ep, epilog_inputs={"bias": bd})
        yT, aux = mm.execute()
        print(shape, act, "aux", {k: (tuple(v.shape), v.stride(), v.dtype) for k, v in aux.items()}, "rel y", rel(yT.t(), pt_fwd()), flush=True)
        bench(shape, f"{act} nvmath AUX_BIAS fwd", lambda: mm.execute())
        def reset_exec():
            mm.reset_operands(a=wd, b=xd.t(), epilog_inputs={"bias": bd}); return mm.execute()
        bench(shape, f"{act} nvmath reset+execute", reset_exec)
        if act == "gelu_tanh":
            pre = aux["gelu_aux"].t()
            def cand_step():
                yT, aux = mm.execute()
                gp, gb = bias_act_dropout.backward_pass(gy, aux["gelu_aux"].t(), None, act, 0.0, None, True, True)
                return gp @ wd, gp.t() @ xd, gb
        else:
            def cand_step():
                y = torch._addmm_activation(bd, xd, wd.t(), use_gelu=False)
                gp, gb = bias_act_dropout.backward_pass(gy, y, None, act, 0.0, None, True, True)
                return gp @ wd, gp.t() @ xd, gb
        def cur_step():
            pre = torch.addmm(bd, xd, wd.t())
            y = bias_act_dropout.trusted.forward(pre, None, act, 0.0, None)
            gp, gb = bias_act_dropout.backward_pass(gy, pre, None, act, 0.0, None, True, True)
            return gp @ wd, gp.t() @ xd, gb
        bench(shape, f"{act} candidate step (no autograd)", cand_step)
        bench(shape, f"{act} current triton step (no autograd)", cur_step)
        bench(shape, f"{act} 3 products alone", lambda: (torch.addmm(bd, xd, wd.t()), gy @ wd, gy.t() @ xd))
print(tabulate(rows, headers=["MxNxK", "entry", "GPU us (graph)", "host us/call (50, synced)"]))
