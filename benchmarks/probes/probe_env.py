"""Probe of the device's software and ceilings (first session): API availability on triton 3.6 /
torch 2.11, copy bandwidth and bf16 matmul rate on random data."""

import inspect
import warnings

import torch
import triton
import triton.language as tl
import triton.testing

print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
import triton.language.random as R

print(inspect.getsource(R.randint4x.fn) + inspect.getsource(R.philox.fn))
print("has make_tensor_descriptor", hasattr(tl, "make_tensor_descriptor"), "set_allocator", hasattr(triton, "set_allocator"))
print("join", hasattr(tl, "join"), "interleave", hasattr(tl, "interleave"), "reshape sig", inspect.signature(tl.reshape))
print("addmm_activation", hasattr(torch, "_addmm_activation"))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    from functorch.compile import memory_efficient_fusion

    f = memory_efficient_fusion(lambda a: torch.nn.functional.gelu(a + 1.0) * 2)
    a = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    f(a).sum().backward()
    print("mef ok; warnings:", [str(x.message)[:120] for x in w])
print("fuser flags: texpr", torch._C._jit_texpr_fuser_enabled(), "can_fuse_on_gpu", torch._C._jit_can_fuse_on_gpu())
for n in (2**28,):
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    print(f"copy {n} bf16: {ms:.3f} ms, {2 * n * 2 / ms / 1e9:.2f} TB/s")
x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
print(f"copy 65536x4096 bf16: {ms:.3f} ms, {2 * x.numel() * 2 / ms / 1e9:.2f} TB/s")
for (m, n, k) in [(8192, 4096, 16384), (8192, 8192, 8192)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b.t(), return_mode="median")
    print(f"mm {m}x{n}x{k}: {2 * m * n * k / ms / 1e9:.0f} TFLOP/s")
