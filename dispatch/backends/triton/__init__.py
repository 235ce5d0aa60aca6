"""triton: our hand-written Triton kernels.

Supports: every op with a file here, ``<op>.py`` (``BACKEND.kernels``; ``python -m dispatch.info``
lists them), forward and backward; CUDA devices of compute capability >= 8.0 (bf16); float16,
bfloat16, float32; every activation, and fused_mlp's gated ones; deterministic (no float atomics:
reductions finish in a fixed order). On CPU it runs only through Triton's interpreter
(``TRITON_INTERPRET=1``), for tests, and only when asked for by name: the dispatcher never picks the
interpreter on its own.

Files, by role: each ``<op>.py`` serves one op, its kernels, launch settings and launchers (its
docstring says how), with the files it splits off: ``fused_linear.py`` infers on the matmul of
``matmul.py`` (its kernels, tile configs and ``launch``), ``fused_mlp.py`` runs the hidden layer's
passes of ``mlp_hidden.py`` or, in its "epilogues" variant, ``mlp_gemm.py``'s persistent GEMMs (and
gelu_tanh's first product in cuBLASLt's epilogue where nvmath-python is installed, the ``cuda`` extra:
``gelu_aux.py``), and an ``<op>_kernels.py`` holds an op's jitted kernels;
``activations.py`` (the activation table) and ``philox.py`` (the dropout RNG spec) are the jitted
helpers the kernels share; ``launch.py`` caches compiled kernels for cheap launches.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from dispatch import ops
from dispatch.contracts.activations import ACTIVATION_NAMES, GATED_NAMES
from dispatch.contracts.backend import Backend, Call

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - platforms without a triton wheel
    triton = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _unavailable() -> Optional[str]:
    if triton is None:
        return "triton is not installed"
    if not torch.cuda.is_available() and not _interpreting():
        return "triton needs a CUDA device, or TRITON_INTERPRET=1 for its CPU interpreter"
    return None


def _extra_reasons(call: Call, explicit: bool) -> list[str]:
    if call.device.type == "cpu":
        if not _interpreting():
            return [
                f"triton runs on cpu only through its interpreter (TRITON_INTERPRET=1); x is on {call.device}"
            ]
        if not explicit:
            return ["triton's CPU interpreter is for tests: it serves only calls that ask for triton by name"]
    return []


def _declare() -> Backend:
    return (
        Backend(
            name="triton",
            kernels=ops.KernelFiles(__name__) if triton is not None else {},
            devices=frozenset({"cuda", "cpu"}),
            dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
            activations=frozenset((*ACTIVATION_NAMES, *GATED_NAMES)),
            deterministic=True,
            summary="hand-written Triton kernels",
            min_capability=(8, 0),
            unavailable=_unavailable,
            extra_reasons=_extra_reasons,
            order=30,
        )
    )


BACKEND = _declare()
