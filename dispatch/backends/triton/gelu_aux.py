"""a = gelu_tanh(x @ W^T + b) and pre = x @ W^T + b from one cuBLASLt product, the GELU_AUX_BIAS
epilogue, through nvmath-python (the optional CUDA extra ``fusedispatch[cuda]``): PyTorch exposes the
epilogue only without its aux output (``torch._addmm_activation``), so a training step there needs a pass
for a or a GEMM more for pre. GPT-2's up projection at 8192 tokens, bf16, H100: 85 us against addmm's 65
plus a 33 us pass.

cuBLASLt writes an epilogue's outputs column-major, so the product is posed transposed, (W, x^T) -> a^T:
a^T column-major is a, (M, F), row-major; the aux output (pre^T) likewise. One plan per (M, H, F, dtype,
device), the last MAX_PLANS kept, its operands rebound each call and released after it (a plan holds
no tensor between calls).
A call returns None where it cannot run: nvmath not installed, operands it does not take, or a first
call for a shape while a CUDA graph is being captured (planning allocates and synchronizes; the
dispatcher plans ahead, ``prepare``, where its decision runs triton under capture alone).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import Tensor

DTYPES = (torch.float16, torch.bfloat16)
DEVICES = ("cuda",)
_ALIGN = 16  # bytes: cuBLASLt's plan assumes operands aligned as the first call's (torch allocates 512)
# key -> a planned nvmath Matmul (None where planning failed), least recently used first; a plan holds
# cuBLASLt's descriptors and workspace, and token counts change from batch to batch
_plans: OrderedDict[tuple, Any] = OrderedDict()
MAX_PLANS = 8
# prepare's stand-in x and W at most: 256 MiB in bf16 costs more memory than a capture's passes cost time
PREPARE_ELEMENTS = 2**27
_installed: list[bool] = []


def available() -> bool:
    """nvmath-python importable (looked up once, imported on the first product only)."""
    if not _installed:
        _installed.append(importlib.util.find_spec("nvmath") is not None)
    return _installed[0]


def _fits(m: int, h: int, f: int, dtype: torch.dtype, device: torch.device) -> bool:
    return device.type in DEVICES and dtype in DTYPES and min(m, h, f) > 8 and (m | h | f) % 8 == 0


def takes(x: Tensor, w: Tensor, b: Tensor) -> bool:
    """Operands the epilogue serves as planned: CUDA, float16/bfloat16, x (M, H) and W (F, H) row-major,
    b (F,) contiguous, all of one dtype, M, H, F multiples of 8 (aux rows 16-byte aligned) and > 8."""
    if not (x.dim() == w.dim() == 2 and b.dim() == 1 and w.dtype == b.dtype == x.dtype):
        return False
    (m, h), f = x.shape, w.shape[0]
    if not (_fits(m, h, f, x.dtype, x.device) and w.device == b.device == x.device):
        return False
    if w.shape[1] != h or b.shape[0] != f:
        return False
    contiguous = x.is_contiguous() and w.is_contiguous() and b.is_contiguous()
    return contiguous and all(t.data_ptr() % _ALIGN == 0 for t in (x, w, b))


def _plan(x: Tensor, w: Tensor, b: Tensor) -> Any:
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    mm = Matmul(w, x.t())
    mm.plan(epilog=MatmulEpilog.GELU_AUX_BIAS, epilog_inputs={"bias": b})
    return mm


def planned(x: Tensor, w: Tensor, b: Tensor) -> tuple[bool, Any]:
    """(whether the plan is new, the plan for these operands' key or None), planned here where it is
    missing and no CUDA graph is being captured."""
    if not (available() and takes(x, w, b)):
        return False, None
    key = (*x.shape, w.shape[0], x.dtype, x.device)
    if key in _plans:
        _plans.move_to_end(key)
        return False, _plans[key]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return False, None
    try:
        _plans[key] = _plan(x, w, b)
    except Exception as exc:  # nvmath or cuBLASLt declines this problem: the caller's other path
        _plans[key] = None
        what = f"x {tuple(x.shape)}, W {tuple(w.shape)}, {x.dtype} ({type(exc).__name__}: {exc})"
        warnings.warn(f"triton fused_mlp: cuBLASLt's GELU_AUX_BIAS product cannot run for {what}; the passes "
                      "run instead", RuntimeWarning, stacklevel=2)  # fmt: skip
    while len(_plans) > MAX_PLANS:
        _, old = _plans.popitem(last=False)
        if old is not None:
            old.free()
    return True, _plans[key]


def prepare(m: int, h: int, f: int, dtype: torch.dtype, device: torch.device) -> None:
    """Plans the product for x (m, h) and W (f, h) from empty stand-ins, holding none of them: for calls
    first made inside a CUDA-graph capture, where no plan can be made. Nothing is allocated where the
    product cannot run, inside a capture, or past PREPARE_ELEMENTS."""
    if not (available() and _fits(m, h, f, dtype, device)) or (m + f) * h > PREPARE_ELEMENTS:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # too late: no plan can be made inside the capture
    new = lambda *shape: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    made, mm = planned(new(m, h), new(f, h), new(f))
    if made and mm is not None:
        mm.release_operands()


def gelu_aux_bias(x: Tensor, w: Tensor, b: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """(a, pre), both (M, F) row-major, or None where this product cannot run (see the module)."""
    new, mm = planned(x, w, b)
    if mm is None:
        return None
    if not new:  # a new plan holds these operands already
        mm.reset_operands_unchecked(a=w, b=x.t(), epilog_inputs={"bias": b})
    try:
        a_t, aux = mm.execute()  # (F, M) column-major, {"gelu_aux": (F, M)}
    finally:
        mm.release_operands()
    a, pre = a_t.t(), aux["gelu_aux"].t()
    return a.contiguous(), pre.contiguous()  # no copies: both row-major as posed
