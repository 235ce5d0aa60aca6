"""Triton passes over fused_mlp's hidden layer: a = dropout_p(act(gate) * up) and its backward, the
pointwise work between the block's two products (``fused_mlp.py``). In order: the kernels, the
launchers (check, allocate, launch).

``pre`` is the first projection's output with unit column stride: (M, F) for a plain activation,
(M, 2F) [gate | up] for a gate (``GATES``). The hidden mask is the RNG spec's over a's logical (M, F)
view (element row * F + col) from ``philox.py``, in bias_act_dropout's tiles: (BLOCK_M rows,
BLOCK_N // 8 Philox groups, 8 lanes), so each call's eight 16-bit values meet their elements directly.
A plain activation's forward is bias_act_dropout's own pass (no bias), which this backward matches.

Bytes per element of a (dtype size s):
  forward    gate: reads gate and up, writes a: 3s (3.7 TB/s at 8192 x 3072 bf16 swiglu, p = 0.1)
  backward   reads grad_a and pre, writes grad_pre (plain 3s, gate 5s); + s to write a again for
             grad_W_out; + float32 partial bias sums, 4 B per (row program, column of pre)
Rewriting a in the backward pass, which already reads pre and draws the mask, saves a recompute pass
that would read pre and run Philox again.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dispatch.backends.triton import bias_act_dropout
from dispatch.backends.triton.activations import apply, grad
from dispatch.backends.triton.launch import Launcher
from dispatch.backends.triton.philox import keep_mask, seed_offset
from dispatch.contracts.activations import GATES
from dispatch.contracts.rng import Rng


@triton.jit
def _columns(BLOCK_N: tl.constexpr):
    """This program's columns of the (M, F) view: (groups (BN8,), lanes (8,), cols (BN8, 8)). Columns
    stay int32: unit column stride and F < 2**31 (row offsets are int64)."""
    groups = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    lanes = tl.arange(0, 8)
    return groups, lanes, groups[:, None] * 8 + lanes[None, :]


@triton.jit(do_not_specialize=["M", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _gate_forward_kernel(
    PRE,  # (M, 2F) [gate | up], row stride stride_pm, unit column stride
    A,  # a, (M, F) contiguous, pre's dtype
    RNG,  # int64 [seed, offset] with RNG_ON_DEVICE; unused without DROPOUT
    seed_lo,  # int32 words of a host (seed, offset), without RNG_ON_DEVICE
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows
    F,  # hidden features: a's columns; pre's gate columns, then as many up columns
    stride_pm,  # pre's row stride, elements
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    ACTIVATION: tl.constexpr,  # the gate's activation, a name in backends.triton.activations
    DROPOUT: tl.constexpr,  # False: no RNG work at all
    RNG_ON_DEVICE: tl.constexpr,  # (seed, offset) in the RNG tensor, else in the four int32 words
    GROUPED: tl.constexpr,  # F % 8 == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of 8
):
    groups, lanes, cols = _columns(BLOCK_N)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    rows64 = rows.to(tl.int64)
    mask = (rows < M)[:, None, None] & (cols < F)[None, :, :]
    gate_ptrs = PRE + (rows64 * stride_pm)[:, None, None] + cols[None, :, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BM, BN8, 8)
    up = tl.load(gate_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    a = apply(gate, ACTIVATION) * up  # act(gate) * up, as the reference's product
    if DROPOUT:  # a * keep * scale as F.dropout: a dropped NaN or inf gives NaN
        seed, offset = seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
        a = a * tl.where(keep_mask(seed, offset, rows, groups, lanes, F, threshold, GROUPED), scale, 0.0)
    tl.store(A + (rows64 * F)[:, None, None] + cols[None, :, :], a.to(A.dtype.element_ty), mask=mask)


@triton.jit
def hidden_grads(g, z, up, drop, ACTIVATION: tl.constexpr, GATED: tl.constexpr, DROPOUT: tl.constexpr,
                 NEED_A: tl.constexpr):  # fmt: skip
    """The hidden layer's backward at one tile, float32: (grad of pre, or of the gate half with GATED;
    grad of the up half with GATED; a as the forward made it with NEED_A). g is grad_a, z pre or the
    gate half, drop keep * scale (with DROPOUT); unused outputs are placeholders."""
    if DROPOUT:  # F.dropout's backward: grad * keep * scale
        g = g * drop
    if GATED:
        act = apply(z, ACTIVATION)
        gz = grad(g * up, z, ACTIVATION)
        gu = g * act
    else:
        gz = grad(g, z, ACTIVATION)
        gu = gz
    a = gz
    if NEED_A:  # the forward's product, in its order: act(gate) * up * (keep * scale)
        if GATED:
            a = act * up
        else:
            a = apply(z, ACTIVATION)
        if DROPOUT:
            a = a * drop
    return gz, gu, a


@triton.jit(
    do_not_specialize=["M", "rows_per_program", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"]
)
def _gate_backward_kernel(
    GA,  # grad_a, (M, F), row stride stride_gm, unit column stride
    PRE,  # pre, (M, F), or (M, 2F) [gate | up] with GATED; row stride stride_pm, unit column stride
    GP,  # grad_pre, pre's shape, contiguous, pre's dtype; unused without NEED_PRE
    A,  # a recomputed as the forward made it, (M, F) contiguous; unused without NEED_A
    GB,  # (row programs, P) float32 partial column sums of grad_pre, or (P,) their total for one
    RNG,  # int64 [seed, offset] with RNG_ON_DEVICE; unused without DROPOUT
    seed_lo,  # int32 words of a host (seed, offset), without RNG_ON_DEVICE
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows
    F,  # hidden features; P = 2F columns of pre with GATED, else F
    rows_per_program,  # a multiple of BLOCK_M
    stride_gm,  # grad_a's row stride, elements
    stride_pm,  # pre's row stride, elements
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    ACTIVATION: tl.constexpr,  # act, the gate's with GATED
    GATED: tl.constexpr,  # grad_gate = g * up * act'(gate), grad_up = g * act(gate)
    DROPOUT: tl.constexpr,
    RNG_ON_DEVICE: tl.constexpr,
    GROUPED: tl.constexpr,  # F % 8 == 0
    NEED_PRE: tl.constexpr,  # write grad_pre
    NEED_A: tl.constexpr,  # write a
    NEED_BIAS: tl.constexpr,  # write grad_pre's column sums over this program's rows
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of 8
):
    groups, lanes, cols = _columns(BLOCK_N)
    col_mask = cols < F
    if GATED:
        P = 2 * F
    else:
        P = F
    if DROPOUT:  # loaded once: inside the loop they could alias the stores and be reloaded
        seed, offset = seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
    acc = tl.zeros((BLOCK_M, BLOCK_N // 8, 8), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N // 8, 8), tl.float32)
    first_row = tl.program_id(0) * rows_per_program
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first_row + start + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        mask = (rows < M)[:, None, None] & col_mask[None, :, :]
        g_ptrs = GA + (rows64 * stride_gm)[:, None, None] + cols[None, :, :]
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BM, BN8, 8)
        pre_ptrs = PRE + (rows64 * stride_pm)[:, None, None] + cols[None, :, :]
        z = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
        drop = g  # keep * scale with DROPOUT (unused otherwise)
        if DROPOUT:
            drop = tl.where(keep_mask(seed, offset, rows, groups, lanes, F, threshold, GROUPED), scale, 0.0)
        up = z  # the up half with GATED (unused otherwise)
        if GATED:
            up = tl.load(pre_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        gz, gu, a = hidden_grads(g, z, up, drop, ACTIVATION, GATED, DROPOUT, NEED_A)
        out_offsets = (rows64 * F)[:, None, None] + cols[None, :, :]
        if NEED_A:
            tl.store(A + out_offsets, a.to(A.dtype.element_ty), mask=mask)
        if NEED_PRE:
            gp_ptrs = GP + (rows64 * P)[:, None, None] + cols[None, :, :]
            tl.store(gp_ptrs, gz.to(GP.dtype.element_ty), mask=mask)
            if GATED:
                tl.store(gp_ptrs + F, gu.to(GP.dtype.element_ty), mask=mask)
        if NEED_BIAS:  # selected, not trusted to be 0: squared_relu'(3e38) * 0 = inf * 0 = NaN
            acc += tl.where(mask, gz, 0.0)
            if GATED:
                acc_up += tl.where(mask, gu, 0.0)
    if NEED_BIAS:  # rows summed in a fixed order: deterministic
        gb_ptrs = GB + tl.program_id(0).to(tl.int64) * P + cols
        tl.store(gb_ptrs, tl.sum(acc, axis=0).to(GB.dtype.element_ty), mask=col_mask)
        if GATED:
            tl.store(gb_ptrs + F, tl.sum(acc_up, axis=0).to(GB.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------- launchers

# Tiles: bias_act_dropout's rule (``config``) over the (M, F) view, not tuned for these passes.
_GATE_FORWARD = Launcher(_gate_forward_kernel, tensors=3)
_BACKWARD = Launcher(_gate_backward_kernel, tensors=6)
_cdiv = bias_act_dropout._cdiv


def _check(pre: Tensor, activation: str) -> tuple[int, int]:
    """(M, F) of a well-formed pre for ``activation``; internal invariants, the spec checked the call."""
    m, width = pre.shape
    gated = activation in GATES
    assert pre.dtype in bias_act_dropout._DTYPES and (pre.stride(1) == 1 or width <= 1), "internal: pre"
    assert not gated or width % 2 == 0, "internal: a gate's pre is [gate | up]"
    return m, width // 2 if gated else width


def forward(pre: Tensor, activation: str, p: float, rng: Optional[Rng]) -> Tensor:
    """a = dropout_p(act(pre)), or dropout_p(act(gate) * up) for a gate: (M, F) in pre's dtype, one pass."""
    if activation not in GATES:
        return bias_act_dropout.KERNELS.forward(pre, None, activation, p, rng)
    m, f = _check(pre, activation)
    a = pre.new_empty((m, f))
    if m == 0 or f == 0:
        return a
    cfg = bias_act_dropout.config(m, f, pre.element_size(), dropout=rng is not None)
    (rng_t, s0, s1, o0, o1, threshold, scale), on_device = bias_act_dropout._dropout_args(pre, p, rng)
    _GATE_FORWARD(
        (_cdiv(m, cfg.block_m), _cdiv(f, cfg.block_n)),
        (pre, a, rng_t, s0, s1, o0, o1, m, f, pre.stride(0), threshold, scale),
        dict(
            ACTIVATION=GATES[activation],
            DROPOUT=rng is not None,
            RNG_ON_DEVICE=on_device,
            GROUPED=f % 8 == 0,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
        ),
        num_warps=cfg.num_warps,
    )
    return a


def backward(
    grad_a: Tensor,
    pre: Tensor,
    activation: str,
    p: float,
    rng: Optional[Rng],
    need_pre: bool,
    need_a: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(grad_pre, a, grad_bias) in one pass over (M, F): grad_pre (pre's shape) = the activation's
    derivative of g = grad_a * keep * scale (both halves for a gate), a as ``forward`` makes it, and
    grad_bias (pre's columns) = grad_pre's column sums from float32 partials in a fixed order; each
    only if asked (None otherwise)."""
    m, f = _check(pre, activation)
    assert grad_a.shape == (m, f) and (grad_a.stride(1) == 1 or f <= 1), "internal: grad_a"
    gated, width = activation in GATES, pre.shape[1]
    grad_pre = pre.new_empty((m, width)) if need_pre else None
    a = pre.new_empty((m, f)) if need_a else None
    if m == 0 or f == 0 or not (need_pre or need_a or need_bias):
        return grad_pre, a, pre.new_zeros((width,)) if need_bias else None
    cfg = bias_act_dropout.config(m, f, pre.element_size(), backward=True, dropout=rng is not None)
    col_programs = _cdiv(f, cfg.block_n)
    rows = bias_act_dropout._rows_per_program(m, cfg, col_programs, pre) if need_bias else cfg.block_m
    row_programs = _cdiv(m, rows)
    grad_bias = partials = None
    if need_bias:
        grad_bias = pre.new_empty((width,))
        if row_programs > 1:
            partials = torch.empty((row_programs, width), dtype=torch.float32, device=pre.device)
    (rng_t, s0, s1, o0, o1, threshold, scale), on_device = bias_act_dropout._dropout_args(pre, p, rng)
    _BACKWARD(
        (row_programs, col_programs),
        (
            grad_a,
            pre,
            pre if grad_pre is None else grad_pre,
            pre if a is None else a,
            pre if grad_bias is None else (grad_bias if partials is None else partials),
            rng_t,
            s0,
            s1,
            o0,
            o1,
            m,
            f,
            rows,
            grad_a.stride(0),
            pre.stride(0),
            threshold,
            scale,
        ),  # fmt: skip
        dict(
            ACTIVATION=GATES.get(activation, activation),
            GATED=gated,
            DROPOUT=rng is not None,
            RNG_ON_DEVICE=on_device,
            GROUPED=f % 8 == 0,
            NEED_PRE=need_pre,
            NEED_A=need_a,
            NEED_BIAS=need_bias,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
        ),
        num_warps=cfg.num_warps,
    )
    if partials is not None:
        bias_act_dropout.sum_partials(partials, grad_bias)
    return grad_pre, a, grad_bias
