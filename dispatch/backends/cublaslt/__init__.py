"""cublaslt: fused_linear with bias and activation in cuBLASLt's GEMM epilogue
(``torch._addmm_activation``).

Supports: fused_linear only, forward and backward (PyTorch gives no backward; ours reads relu's kept
output, and for gelu_tanh recomputes the pre-activation with one GEMM, see ``fused_linear.py``); CUDA
only; float16, bfloat16, float32; activations relu and gelu_tanh (the two epilogues PyTorch exposes);
bias optional (a zero bias keeps the epilogue); x in any layout. Needs M, N and K > 1: cuBLASLt
rejects single rows or columns and PyTorch then runs an unfused GEMM, so those calls are refused here.
Deterministic as cuBLAS is (same GPU, same library version).
"""

from __future__ import annotations

from typing import Optional

import torch

from dispatch import ops
from dispatch.contracts.backend import Backend, Call


def _unavailable() -> Optional[str]:
    if not torch.cuda.is_available():
        return "cublaslt needs a CUDA device (cuBLASLt); torch.cuda.is_available() is False"
    return None


def _extra_reasons(call: Call, explicit: bool) -> list[str]:
    m, n, k = call.shape
    if min(m, n, k) < 2:
        why = "cublaslt's fused epilogue needs M, N and K > 1 (otherwise PyTorch runs an unfused GEMM)"
        return [f"{why}; got M={m}, N={n}, K={k}"]
    return []


def _declare() -> Backend:
    from dispatch.backends.cublaslt import fused_linear

    return (
        Backend(
            name="cublaslt",
            kernels=ops.KernelFiles(__name__),
            devices=frozenset({"cuda"}),
            dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
            activations=frozenset(fused_linear.USE_GELU),
            deterministic=True,
            summary="cuBLASLt GEMM with bias + relu/gelu_tanh epilogue (torch._addmm_activation)",
            unavailable=_unavailable,
            extra_reasons=_extra_reasons,
            label=lambda: "cuBLASLt epilogue",
            order=20,
        )
    )


BACKEND = _declare()
