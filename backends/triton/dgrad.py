"""fused_linear's backward product with the activation's gradient in its operand loads.

    grad_x (M, K) = grad_pre (M, N) @ W (N, K),   grad_pre = grad_y * act'(z) formed tile by tile

One persistent Triton matmul (TMA operand loads, grouped tile order, as ``matmul.py``) reads grad_y and
the saved tensor z (the pre-activation, or for relu the output y: y <= 0 exactly where pre <= 0), forms
grad_pre in registers in x's dtype (PyTorch's rounding of its gelu_backward output) and feeds it to the
tensor cores as the A operand. The programs that own a row strip's first column tile also write that
strip of grad_pre (for the weight gradient's cuBLAS product) and its float32 column sums (one partial
row per row strip, for grad_b), so the separate pass over M x N of the other design is gone:

    separate pass   read grad_y, z; write grad_pre      3 x M x N x 2 bytes, then the dgrad reads
                    grad_pre again: 4 x M x N x 2 bytes around two kernels
    this kernel     read grad_y, z; write grad_pre      3 x M x N x 2 bytes inside one product

The cost moves to the ALU: every column tile of a row strip forms the same grad_pre tile again
(K / BLOCK_N times), cheap for relu (a select) and ~25 instructions an element for gelu_tanh.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dispatch.backends.triton import matmul
from dispatch.backends.triton.activations import grad
from dispatch.backends.triton.launch import Launcher
from dispatch.backends.triton.matmul import TensorDescriptor, _tile_coords


@triton.jit
def _dgrad_kernel(
    GY_DESC,  # descriptor over grad_y (M, N), block (BLOCK_M, BLOCK_K)
    Z_DESC,  # descriptor over z (M, N), the saved tensor, same block
    W_DESC,  # descriptor over W (N, K), block (BLOCK_K, BLOCK_N)
    GX,  # (M, K) grad_x, row-major
    G,  # (M, N) grad_pre, row-major (written when WRITE_G)
    PARTIALS,  # (cdiv(M, BLOCK_M), N) float32 column sums of grad_pre by row strip (when NEED_BIAS)
    M,  # rows
    N,  # the reduction: fused_linear's output features
    K,  # columns of grad_x: fused_linear's input features
    stride_gxm,  # GX row stride
    stride_gm,  # G row stride
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    WRITE_G: tl.constexpr,
    NEED_BIAS: tl.constexpr,
    INDEX_64: tl.constexpr,
    DOT_FP32: tl.constexpr,  # CPU interpreter + bfloat16: upcast the operands of tl.dot
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(K, BLOCK_N)
    k_tiles = tl.cdiv(N, BLOCK_K)
    dtype = GX.dtype.element_ty
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        if INDEX_64:
            offs_m = offs_m.to(tl.int64)
        in_m = offs_m < M
        writer = pid_n == 0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            # TMA zero-fills past the edges: grad_y = 0 there, so grad_pre = 0 for every activation
            # (act' is finite at z = 0) and padded rows and columns add nothing to the sums
            gy = GY_DESC.load([off_m, off_k]).to(tl.float32)
            z = Z_DESC.load([off_m, off_k]).to(tl.float32)
            g = grad(gy, z, ACTIVATION).to(dtype)
            if WRITE_G or NEED_BIAS:
                if writer:
                    offs_k = off_k + tl.arange(0, BLOCK_K)
                    in_k = offs_k < N
                    if WRITE_G:
                        tl.store(
                            G + offs_m[:, None] * stride_gm + offs_k[None, :], g,
                            mask=in_m[:, None] & in_k[None, :],
                        )  # fmt: skip
                    if NEED_BIAS:
                        tl.store(PARTIALS + pid_m * N + offs_k, tl.sum(g.to(tl.float32), axis=0), mask=in_k)
            w = W_DESC.load([off_k, off_n])
            if DOT_FP32:
                acc = tl.dot(g.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(g, w, acc)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        tl.store(
            GX + offs_m[:, None] * stride_gxm + offs_n[None, :], acc.to(dtype),
            mask=in_m[:, None] & (offs_n < K)[None, :],
        )  # fmt: skip


_DGRAD = Launcher(_dgrad_kernel, tensors=3, descriptors=3)

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the interpreter's crosses tile edges at the tests' shapes
CONFIG = (128, 128, 64, 8, 3)
CONFIG_INTERPRETER = (32, 16, 16, 1, 1)
_override: dict = {}


def usable(grad_y: Tensor, z: Tensor, weight: Tensor) -> bool:
    """Whether TMA can read the three operands: 16-bit, contiguous rows, 16-byte aligned, sm_90."""
    if TensorDescriptor is None or grad_y.dtype not in (torch.float16, torch.bfloat16):
        return False
    if grad_y.device.type == "cuda" and matmul._capability(grad_y.device) < (9, 0):
        return False
    for t in (grad_y, z, weight):
        if t.dtype != grad_y.dtype or t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * 2) % 16:
            return False
    return True


def launch(
    grad_y: Tensor, z: Tensor, weight: Tensor, activation: str, write_g: bool, need_bias: bool
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(grad_x, grad_pre or None, float32 grad_b or None) for grad_y, z (M, N), W (N, K); ``usable``."""
    M, N = grad_y.shape
    K = weight.shape[1]
    interpreted = grad_y.device.type != "cuda"
    bm, bn, bk, warps, stages = _override.get("config") or (CONFIG_INTERPRETER if interpreted else CONFIG)
    grad_x = torch.empty((M, K), device=grad_y.device, dtype=grad_y.dtype)
    g = torch.empty((M, N), device=grad_y.device, dtype=grad_y.dtype) if write_g else None
    row_strips = matmul._cdiv(M, bm)
    partials = torch.empty((row_strips, N), device=grad_y.device, dtype=torch.float32) if need_bias else None
    programs = matmul._sm_count(grad_y.device)
    tiles = row_strips * matmul._cdiv(K, bn)
    descs = (
        TensorDescriptor.from_tensor(grad_y, [bm, bk]),
        TensorDescriptor.from_tensor(z, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bk, bn]),
    )
    index_64 = max(M * max(N, K), N * K) >= 2**31
    _DGRAD(
        (min(programs, tiles),),
        (*descs, grad_x, grad_x if g is None else g, grad_x if partials is None else partials,
         M, N, K, grad_x.stride(0), N),  # fmt: skip
        dict(
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=programs, ACTIVATION=activation,
            WRITE_G=write_g, NEED_BIAS=need_bias, INDEX_64=index_64,
            DOT_FP32=grad_y.dtype == torch.bfloat16 and interpreted,
        ),  # fmt: skip
        num_warps=warps,
        num_stages=stages,
    )
    grad_b = partials.sum(0) if need_bias else None
    return grad_x, g, grad_b
