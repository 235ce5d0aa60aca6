"""Triton fused_linear: Activation(x @ W^T + b), forward and backward (``KERNELS``).

Without autograd (``infer``): one Triton matmul (``matmul.py``) whose epilogue adds the bias and
applies the activation: the product is written once, as y.

With autograd the products run on cuBLAS (``torch.addmm``, the bias in its epilogue, and ``torch.mm``)
and the activation and its gradient on bias_act_dropout's kernels (``bias_act_dropout.py``, p = 0),
because cuBLAS is the faster GEMM and the rest is memory-bound: the Triton matmul keeping the
pre-activation took 102 us against torch.mm's 65 plus a 30 us pass (GPT-2 c_fc, bf16).
    forward   pre = x @ W^T + b                               cuBLAS, 2MNK
              y = act(pre), pre kept for backward             one pass: read pre, write y
    backward  grad_pre = grad_y * act'(pre),                  one pass: read grad_y and pre, write
              grad_b = its column sums                          grad_pre, float32 per-block partials
              grad_x = grad_pre @ W, grad_W = grad_pre^T @ x  cuBLAS, 2MNK each
PyTorch's act(F.linear(x, W, b)) makes the same products and two more passes: a separate reduction
over M x N for grad_b and gelu_backward, where our pass forms both in gelu_backward's time; the saved
tensors are the same (x, W and one M x N pre-activation).
relu: y = cuBLASLt's addmm with relu in its epilogue (``torch._addmm_activation``), and y is what
backward reads (y <= 0 exactly where pre <= 0): no forward pass, no pre-activation kept. As with
torch.relu, y modified in place before backward is then refused by autograd.
Identity: y = addmm(b, x, W^T); grad_pre is grad_y itself and a column-sum pass gives grad_b.

Tried and dropped (benchmarks/PERF.md): grad_pre formed inside the dgrad product's operand loads
(1.6-3.7x slower than torch.mm plus the pass); cuBLASLt's GELU_AUX_BIAS forward (174 us of host time
a call against _addmm_activation's 22).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dispatch.backends.triton import bias_act_dropout, matmul
from dispatch.backends.triton.launch import Launcher
from dispatch.contracts.backend import Kernels
from dispatch.ops.fused_linear import Grads, Needs


@triton.jit
def _column_sums_kernel(
    X,  # (M, N) input (grad_y), any strides (stride 0 included)
    PARTIALS,  # (row groups, N) float32 column sums of X over each program's rows
    M,  # rows
    N,  # columns
    rows_per_program,  # a multiple of BLOCK_M
    stride_xm,  # X strides
    stride_xn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INDEX_64: tl.constexpr,  # X reaches offsets >= 2**31: 64-bit offsets
):
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_n = offs_n.to(tl.int64)
    in_n = offs_n < N
    row_end = tl.minimum((pid_m + 1) * rows_per_program, M)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # reduced over rows once, after the loop
    for row in range(pid_m * rows_per_program, row_end, BLOCK_M):
        offs_m = row + tl.arange(0, BLOCK_M)
        if INDEX_64:
            offs_m = offs_m.to(tl.int64)
        mask = (offs_m < row_end)[:, None] & in_n[None, :]
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
        total += x.to(tl.float32)
    tl.store(PARTIALS + pid_m * N + offs_n, tl.sum(total, axis=0), mask=in_n)


# ----------------------------------------------------------------------------- launchers

_PROGRAMS_PER_SM = 4  # bandwidth pass: enough programs in flight to cover HBM latency
_COLUMN_SUMS = Launcher(_column_sums_kernel, tensors=2)


def launch_column_sums(x: Tensor) -> Tensor:
    """Float32 column sums (N,) of x (M, N), any strides: one float32 partial per row group and
    column, then a fixed-order sum of the partials (deterministic, no atomics)."""
    M, N = x.shape
    if M == 0 or N == 0:
        return torch.zeros(N, device=x.device, dtype=torch.float32)
    interpreted = x.device.type != "cuda"
    block_n = 16 if interpreted else min(256, 1 << (N - 1).bit_length())  # next power of 2
    block_m = 8 if interpreted else max(1, 4096 // block_n)
    col_programs = matmul._cdiv(N, block_n)
    target = matmul._sm_count(x.device) * _PROGRAMS_PER_SM
    row_groups = min(matmul._cdiv(target, col_programs), matmul._cdiv(M, block_m))
    rows = matmul._cdiv(matmul._cdiv(M, row_groups), block_m) * block_m
    row_groups = matmul._cdiv(M, rows)
    partials = torch.empty((row_groups, N), device=x.device, dtype=torch.float32)
    sx = x.stride()
    _COLUMN_SUMS(
        (row_groups, col_programs),
        (x, partials, M, N, rows, sx[0], sx[1]),
        dict(BLOCK_M=block_m, BLOCK_N=block_n, INDEX_64=matmul._extent((M, N), sx) >= 2**31),
        num_warps=4,
    )
    return partials.sum(0)


def launch_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    """act(x @ W^T + b) through the Triton matmul; x (M, K), W (N, K), any strides."""
    M, N = x.shape[0], weight.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if y.numel():
        b = None if bias is None else bias.contiguous()  # the epilogue reads it with unit stride
        matmul.launch(x, weight.t(), y, activation=activation, bias=b)
    return y


# ----------------------------------------------------------------------------- kernels


def forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, Optional[Tensor]]:
    """(y, saved) for a call with autograd: y = act(x @ W^T + b), saved = the pre-activation x @ W^T + b
    rounded to x's dtype as PyTorch's addmm rounds it (None for identity). Rounded before the bias was
    added, relu-like masks flipped wherever |x @ W^T| >> |x @ W^T + b|: bf16 grad_x 4x eager's error."""
    if activation == "relu":
        # relu's backward needs only where y > 0: y is kept (as torch.relu keeps its result), and the
        # activation runs in cuBLASLt's epilogue (234 us against 256 keeping the pre-activation); no
        # M x N tensor is kept beyond what the next layer keeps anyway (its input y).
        if bias is None:
            y = torch.mm(x, weight.t()).relu_()
        else:
            y = torch._addmm_activation(bias, x, weight.t(), use_gelu=False)
        return y, y
    pre = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
    if activation == "identity":
        return pre, None
    # pre, not y, even where y would do (leaky_relu: y > 0 exactly where pre > 0): F.leaky_relu keeps
    # its input, so a caller may modify its output in place before backward; a kept y would refuse that
    return bias_act_dropout.KERNELS.forward(pre, None, activation, 0.0, None), pre


def infer(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    """y = act(x @ W^T + b) for calls without autograd: one matmul, bias and activation in its epilogue."""
    return launch_forward(x, weight, bias, activation)


def backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], saved: Optional[Tensor],
             activation: str, needs: Needs) -> Grads:  # fmt: skip
    need_x, need_w, need_b = needs
    if activation == "identity":
        grad_pre = grad_y
        grad_b = launch_column_sums(grad_y).to(bias.dtype) if need_b else None
    else:  # one pass: grad_pre = grad_y * act'(pre) and its column sums (grad_b)
        grad_pre, grad_b = bias_act_dropout.backward_pass(
            grad_y, saved, None, activation, 0.0, None, need_x or need_w, need_b
        )
    grad_x = torch.mm(grad_pre, weight) if need_x else None  # (M, N) @ (N, K)
    grad_w = torch.mm(grad_pre.t(), x) if need_w else None  # (N, M) @ (M, K)
    return grad_x, grad_w, grad_b


KERNELS = Kernels(forward=forward, backward=backward, inference=infer)
