"""Triton fused_linear: Activation(x @ W^T + b), forward and backward (``FusedLinearImpl``).

Forward is one matmul (``backends/triton/matmul.py``) whose epilogue adds the bias, writes the
pre-activation for backward (non-identity activations) and applies the activation.

Backward forms grad_pre = grad_y * act'(pre) once, in x's dtype, and reuses it for both products:
    grad_x = grad_pre @ W      (M, K)     2MNK
    grad_W = grad_pre^T @ x    (N, K)     2MNK
    grad_b = column sums of grad_pre, from the pass that forms it (float32 per-block partials, then a
             fixed-order sum: deterministic, no atomics)
With ``saved`` (the pre-activation) one bandwidth-bound pass forms grad_pre (reads grad_y and pre,
writes grad_pre: 6 bytes per element in 16-bit). Without it the forward matmul is redone and its
epilogue forms grad_pre (+2MNK). Why not in grad_x's operand load: each grad_pre tile would be
re-derived for every output column tile (K / 256 times, 16x at K=4096), and act' on CUDA cores costs
more than the wgmma it feeds: ~30 FP32 instructions x 128x64 elements = ~1 us per 128x256x64 step
per SM for gelu vs ~0.6 us of wgmma (estimate: 128 FP32 lanes/clock, 989 TFLOP/s over 132 SMs).
For identity grad_pre is grad_y itself (any strides) and the pass only sums columns for grad_b.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dispatch.backends.triton import matmul
from dispatch.backends.triton.activations import grad as act_grad
from dispatch.backends.triton.launch import Launcher


@triton.jit
def _act_grad_kernel(
    GRAD_Y,  # (M, N) upstream gradient, any strides (stride 0 included)
    PRE,  # (M, N) pre-activation saved by forward, any strides
    GRAD_PRE,  # (M, N) output grad_y * act'(pre), row-major, x's dtype
    COLSUM,  # (row groups, N) float32 column sums of GRAD_PRE over each program's rows
    M,  # rows
    N,  # columns
    rows_per_program,  # a multiple of BLOCK_M
    stride_gm,  # GRAD_Y strides
    stride_gn,
    stride_pm,  # PRE strides
    stride_pn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_GRAD: tl.constexpr,  # False for identity: grad_pre is grad_y, only the sums are needed
    HAS_COLSUM: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    row_end = tl.minimum((pid_m + 1) * rows_per_program, M)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # reduced over rows once, after the loop
    for row in range(pid_m * rows_per_program, row_end, BLOCK_M):
        offs_m = row + tl.arange(0, BLOCK_M)
        if INDEX_64:
            offs_m = offs_m.to(tl.int64)
        mask = (offs_m < row_end)[:, None] & in_n[None, :]
        grad_y = tl.load(
            GRAD_Y + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0
        )
        if STORE_GRAD:
            pre = tl.load(
                PRE + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn, mask=mask, other=0.0
            )
            grad = act_grad(grad_y.to(tl.float32), pre.to(tl.float32), ACTIVATION).to(
                GRAD_PRE.dtype.element_ty
            )
            tl.store(GRAD_PRE + offs_m[:, None] * N + offs_n[None, :], grad, mask=mask)
        else:
            grad = grad_y
        total += grad.to(tl.float32)  # masked elements are 0: act' is finite at 0
    if HAS_COLSUM:
        tl.store(COLSUM + pid_m * N + offs_n, tl.sum(total, axis=0), mask=in_n)


# ----------------------------------------------------------------------------- launchers

_PROGRAMS_PER_SM = 4  # bandwidth pass: enough programs in flight to cover HBM latency
_ACT_GRAD = Launcher(_act_grad_kernel, tensors=4)


def launch_act_grad(
    grad_y: Tensor, pre: Optional[Tensor], activation: str, colsum: bool
) -> tuple[Tensor, Optional[Tensor]]:
    """(grad_y * act'(pre) in pre's dtype, or grad_y itself for identity; its float32 column sums)."""
    M, N = grad_y.shape
    store = activation != "identity"
    grad_pre = torch.empty((M, N), device=grad_y.device, dtype=grad_y.dtype) if store else grad_y
    if M == 0 or N == 0:
        return grad_pre, torch.zeros(N, device=grad_y.device, dtype=torch.float32) if colsum else None
    if not store and not colsum:
        return grad_pre, None
    interpreted = grad_y.device.type != "cuda"
    block_n = 16 if interpreted else min(256, 1 << (N - 1).bit_length())  # next power of 2
    block_m = 8 if interpreted else max(1, 4096 // block_n)
    col_programs = matmul._cdiv(N, block_n)
    target = matmul._sm_count(grad_y.device) * _PROGRAMS_PER_SM
    row_groups = min(matmul._cdiv(target, col_programs), matmul._cdiv(M, block_m))
    rows = matmul._cdiv(matmul._cdiv(M, row_groups), block_m) * block_m
    row_groups = matmul._cdiv(M, rows)
    sums = torch.empty((row_groups, N), device=grad_y.device, dtype=torch.float32) if colsum else grad_pre
    p = pre if store else grad_y
    sg, sp = grad_y.stride(), p.stride()
    index_64 = max(matmul._extent((M, N), sg), matmul._extent((M, N), sp), M * N) >= 2**31
    _ACT_GRAD(
        (row_groups, col_programs),
        (grad_y, p, grad_pre, sums, M, N, rows, sg[0], sg[1], sp[0], sp[1]),
        # BLOCK_M, BLOCK_N, ACTIVATION, STORE_GRAD, HAS_COLSUM, INDEX_64
        (block_m, block_n, activation, store, colsum, index_64),
        4,
    )
    return grad_pre, sums.sum(0) if colsum else None


def launch_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, save_pre: bool
) -> tuple[Tensor, Optional[Tensor]]:
    """(act(x @ W^T + b), x @ W^T + b if save_pre else None); x (M, K), W (N, K), any strides."""
    M, N = x.shape[0], weight.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    pre = torch.empty_like(y) if save_pre else None
    if y.numel():
        b = None if bias is None else bias.contiguous()  # the epilogue reads it with unit stride
        matmul.launch(x, weight.t(), y, epilogue="forward", activation=activation, bias=b, pre=pre)
    return y, pre


def launch_recompute_grad(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, grad_y: Tensor, colsum: bool
) -> tuple[Tensor, Optional[Tensor]]:
    """(grad_y * act'(x @ W^T + b) in x's dtype, its float32 column sums or None): the forward product
    redone, grad_pre written once by its epilogue."""
    M, N = x.shape[0], weight.shape[0]
    grad_pre = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if not grad_pre.numel():
        return grad_pre, torch.zeros(N, device=x.device, dtype=torch.float32) if colsum else None
    b = None if bias is None else bias.contiguous()
    sums = matmul.launch(x, weight.t(), grad_pre, epilogue="grad", activation=activation, bias=b,
                         grad_y=grad_y, colsum=colsum)  # fmt: skip
    return grad_pre, sums


def launch_mm(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) @ b (K, N), any strides, float32 accumulation, a new row-major (M, N) tensor."""
    c = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)
    if c.numel():
        matmul.launch(a, b, c, epilogue="plain")
    return c


# ----------------------------------------------------------------------------- FusedLinearImpl


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    """(y, saved): y = act(x @ W^T + b), saved = the pre-activation (None for identity)."""
    return launch_forward(x, weight, bias, activation, save_pre=activation != "identity")


def infer(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    """y = act(x @ W^T + b) for calls without autograd."""
    return launch_forward(x, weight, bias, activation, save_pre=False)[0]  # no pre-activation write


def backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    saved: Optional[Tensor],
    activation: str,
    needs: tuple[bool, bool, bool],
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    need_x, need_w, need_b = needs
    need_b = need_b and bias is not None
    if not (need_x or need_w or need_b):
        return None, None, None
    if activation == "identity" or saved is not None:
        grad_pre, sums = launch_act_grad(grad_y, saved, activation, need_b)
    else:
        grad_pre, sums = launch_recompute_grad(x, weight, bias, activation, grad_y, need_b)
    grad_x = launch_mm(grad_pre, weight) if need_x else None  # (M, N) @ (N, K)
    grad_w = launch_mm(grad_pre.t(), x) if need_w else None  # (N, M) @ (M, K)
    grad_b = sums.to(bias.dtype) if need_b else None
    return grad_x, grad_w, grad_b
