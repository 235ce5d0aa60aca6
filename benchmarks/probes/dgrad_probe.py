"""Probe (not shipped): fused dgrad (grad_pre formed in operand loads) vs cuBLAS + separate passes. H200 bf16."""
import sys, time
import torch, triton.testing
import torch.nn.functional as F
from tabulate import tabulate
from dispatch.backends.triton import dgrad, bias_act_dropout

dev = torch.device("cuda")
rows = []
def g(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3

CONFIGS = [(128,128,64,8,3), (128,128,64,8,4), (128,256,64,8,3), (64,256,64,4,3), (128,64,64,4,4), (256,128,64,8,3)]
t0=time.time()
for (M, N, K) in ((8192, 3072, 768), (2048, 3072, 768), (8192, 4096, 1024), (8192, 11008, 4096)):
    for act in ("relu", "gelu_tanh"):
        shape = f"{M}x{N}x{K} {act}"
        gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        z = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        if act == "relu":
            z = torch.relu(z)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / N**0.5
        gref = (torch.where(z <= 0, 0, gy) if act == "relu" else torch.ops.aten.gelu_backward(gy, z, approximate="tanh"))
        gx_ref = gref @ w
        def torch_path():
            gp = torch.ops.aten.threshold_backward(gy, z, 0) if act == "relu" else torch.ops.aten.gelu_backward(gy, z, approximate="tanh")
            return gp @ w, gp.sum(0)
        def old_path():
            gp, gb = bias_act_dropout.backward_pass(gy, z, None, act, 0.0, None, True, True)
            return gp @ w, gb
        r = [shape, round(g(lambda: gref @ w), 1), round(g(torch_path), 1), round(g(old_path), 1)]
        best = None
        for cfg in CONFIGS:
            dgrad._override["config"] = cfg
            try:
                gx, gp, gb = dgrad.launch(gy, z, w, act, True, True)
                err = ((gx.float() - gx_ref.float()).norm() / gx_ref.float().norm()).item()
                eg = (gp.float() - gref.float()).abs().max().item()
                eb = ((gb - gref.float().sum(0)).norm() / gref.float().sum(0).norm()).item()
                t = g(lambda: dgrad.launch(gy, z, w, act, True, True))
                tn = g(lambda: dgrad.launch(gy, z, w, act, False, False))
                r.append(f"{t:.1f}/{tn:.1f}" + ("" if err < 1e-2 and eg < 0.05 and eb < 1e-2 else f" ERR {err:.1e},{eg:.1e},{eb:.1e}"))
            except Exception as exc:
                r.append(f"fail {type(exc).__name__}: {str(exc)[:60]}")
        dgrad._override.clear()
        rows.append(r)
        print(r, f"{time.time()-t0:.0f}s", flush=True)
print(tabulate(rows, headers=["shape", "mm alone", "torch bwd+sum+mm", "pass+mm"] + ["/".join(map(str, c)) + " G+b/none" for c in CONFIGS]))
