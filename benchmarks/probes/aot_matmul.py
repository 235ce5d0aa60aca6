"""Compiles fused_linear's matmul kernels for sm_90 without a GPU: does each (config, epilogue,
variant) compile with the installed Triton, does its shared memory fit an H200's 227 KiB a block, and
how many registers and bytes of stack (spills) does a thread use (cuobjdump, bundled with Triton)?

Useful before spending device time on a sweep (a config over the limit fails at launch there). Run it
with the device's Triton version on the path to check that version, e.g. an unpacked triton 3.6 wheel:

    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/probes/aot_matmul.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from tabulate import tabulate
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from backends.triton import matmul  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on the H100/H200
INTS = ("M", "N", "K", "stride_cm", "stride_gm", "stride_gn")


def _registers(cubin: bytes) -> str:
    """"REG:n STACK:m" of a cubin by the cuobjdump that ships with Triton, or "" without one."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"{found[1]} regs, {found[2]} B stack" if found else ""


def compile_tma(cfg: matmul.Config, epilogue: str, save_pre: bool, store_tma: bool) -> tuple[int, str]:
    """(shared memory in bytes, registers and stack a thread) of the TMA kernel compiled for sm_90
    (bf16, gelu_tanh, K-major operands)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    out = f"tensordesc<bf16[{bm}, {bn}]>" if store_tma else "*bf16"
    runtime = {n: "i32" for n in INTS}
    runtime.update(
        A_DESC=f"tensordesc<bf16[{bm}, {bk}]>", B_DESC=f"tensordesc<bf16[{bn}, {bk}]>", C=out, PRE=out,
        BIAS="*bf16", GRAD_Y="*bf16", COLSUM="*fp32",
    )  # fmt: skip
    constexprs = dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, NUM_PROGRAMS=132, A_KMAJOR=True,
        B_KMAJOR=True, FLATTEN=False, EPILOGUE=epilogue, ACTIVATION="gelu_tanh", HAS_BIAS=epilogue != "plain",
        SAVE_PRE=save_pre, HAS_COLSUM=epilogue == "grad", INPUT_PRECISION="tf32", INDEX_64=False,
        DOT_FP32=False, STORE_TMA=store_tma,
    )  # fmt: skip
    fn = matmul._matmul_tma_kernel
    signature = {n: runtime.get(n, "constexpr") for n in fn.arg_names}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=SM90, options=options)
    return kernel.metadata.shared, _registers(kernel.asm["cubin"])


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
    from sweep_fused_linear import CANDIDATES

    rows = []
    for cfg in dict.fromkeys((*matmul.CONFIGS_16, *CANDIDATES)):
        for epilogue, save_pre in (("forward", True), ("forward", False), ("plain", False), ("grad", False)):
            for store_tma in (False, True):
                try:
                    smem, regs = compile_tma(cfg, epilogue, save_pre, store_tma)
                    verdict = "fits" if smem <= SMEM_LIMIT else "OVER the H200's limit"
                except Exception as exc:  # a compile error: reported, the sweep goes on
                    smem, regs, verdict = None, "", f"{type(exc).__name__}: {str(exc)[:80]}"
                label = epilogue + ("+pre" if save_pre else "")
                rows.append([f"{cfg} g{cfg.group_m}", label, store_tma, smem, regs, verdict])
    print(f"triton {triton.__version__}, sm_90")
    print(tabulate(rows, headers=["config", "epilogue", "tma store", "shared bytes", "a thread", ""]))


if __name__ == "__main__":
    main()
