"""mlp_gemm's epilogue kernels compiled for sm_90 ahead of time, on any machine (no GPU needed: Triton's
own ptxas), with the registers and spill stack each build takes: the check that a tile config keeps
its epilogue in registers before a GPU session times it.

    python benchmarks/aot_sm90.py            # the configs _config picks from, bf16, TMA main loop

Uses Triton's compiler API (``triton.compile(ASTSource, target=GPUTarget("cuda", 90, 32))``) and
``cuobjdump --dump-resource-usage`` from Triton's wheel. Stack > 0 means spills to local memory.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import common  # noqa: F401  (sys.path: the repository)
import triton
from tabulate import tabulate
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dispatch.backends.triton import matmul, mlp_gemm

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
TENSORS = {
    "up": {"PRE": "*bf16", "OUT": "*bf16", "BIAS": "*bf16", "BIAS_UP": "*bf16", "RNG": "*i64"},
    "grad": {"PRE": "*bf16", "GP": "*bf16", "A_OUT": "*bf16", "PARTIALS": "*fp32", "RNG": "*i64"},
}


def build(kernel, kind: str, cfg: matmul.Config, constexprs: dict):
    """The sm_90 build of ``kernel`` (a TMA main loop over bf16) for ``cfg`` and ``constexprs``."""
    b_block = [cfg.block_n, cfg.block_k] if constexprs["B_KMAJOR"] else [cfg.block_k, cfg.block_n]
    descs = {"A": [cfg.block_m, cfg.block_k], "B": b_block, "B_UP": b_block}
    names = kernel.arg_names
    signature, values = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name], values[(i,)] = "constexpr", constexprs[name]
        elif name in descs:
            signature[name] = f"tensordesc<bf16{descs[name]}>"
        else:
            signature[name] = TENSORS[kind].get(name, "fp32" if name == "scale" else "i32")
    source = ASTSource(fn=kernel, signature=signature, constexprs=values)
    return triton.compile(
        source, target=TARGET, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    )


def usage(compiled) -> tuple[str, str]:
    """(registers, stack bytes) of a build, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True)
    parts = [part for line in out.stdout.splitlines() if "REG:" in line for part in line.split()]
    fields = dict(part.split(":") for part in parts if part.count(":") == 1)
    return fields.get("REG", "?"), fields.get("STACK", "?")


def main() -> None:
    shared = dict(GROUP_M=8, NUM_PROGRAMS=132, USE_TMA=True, A_KMAJOR=True, GROUPED=True, RNG_ON_DEVICE=False,
                  INPUT_PRECISION="ieee", INDEX_64=False, DOT_FP32=False, WARP_SPECIALIZE=False)  # fmt: skip
    rows = []
    light = tuple(c for c in matmul.CONFIGS_16 if c.block_n <= mlp_gemm.LIGHT_BLOCK_N)
    builds = [
        ("up", "light", False, False),
        ("up", "pre", False, False),
        ("up", "heavy", False, True),
        ("up", "heavy", True, True),
        ("grad", "heavy", False, False),
        ("grad", "heavy", True, True),
    ]
    for kind, epilogue, gated, drop in builds:
        table = mlp_gemm.HEAVY_CONFIGS_16 if epilogue == "heavy" else light
        for cfg in table:
            c = dict(shared, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated,
                     DROPOUT=drop, ACTIVATION="silu" if gated else "gelu_tanh",
                     EPILOGUE_SPLIT=cfg.epilogue_split)  # fmt: skip
            if kind == "up":
                kernel = mlp_gemm._up_kernel
                c.update(B_KMAJOR=True, HAS_BIAS=True, STORE_PRE=epilogue != "light")
            else:
                kernel = mlp_gemm._grad_kernel
                c.update(B_KMAJOR=False, NEED_PRE=True, NEED_A=True, NEED_BIAS=True)
            compiled = build(kernel, kind, cfg, c)
            regs, stack = usage(compiled)
            rows.append([kind, epilogue, gated, drop, str(cfg), regs, stack, compiled.metadata.shared])
    print(
        tabulate(
            rows, headers=["kernel", "epilogue", "gated", "dropout", "config", "regs", "stack B", "smem B"]
        )
    )


if __name__ == "__main__":
    main()
