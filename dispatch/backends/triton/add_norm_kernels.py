"""The jitted kernels of fused add + RMSNorm / LayerNorm (launchers and the autograd Function:
``add_norm.py``). With h = x + residual rounded to x's dtype, per row of N:
    rms     rstd = 1 / sqrt(mean(h^2) + eps)          hat = h * rstd
    layer   rstd = 1 / sqrt(mean((h - mu)^2) + eps)   hat = (h - mu) * rstd      (biased variance)
    y = hat * (w + offset) (+ b)                      float32 math, y in x's dtype
    dh = dh_out + rstd * (g - hat * mean(g * hat) [- mean(g)]),  g = dy * (w + offset)
    dw = sum over rows of dy * hat,  db = sum over rows of dy
Rows up to MAX_BLOCK_N wide live whole in one (BLOCK_M, BLOCK_N) tile; wider rows take the ``_wide``
kernels, which walk a row in chunks (three passes forward, two backward). Bytes are counted with
s = x's itemsize.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add(x_ptrs, r_ptrs, h_ptrs, mask, HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr):
    """h = x + residual as PyTorch forms it (float32 sum, rounded to x's dtype), stored with STORE_H;
    returned in float32. Masked-out elements are 0."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        if STORE_H:
            tl.store(h_ptrs, h, mask=mask)
        return h.to(tl.float32)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _forward_kernel(
    X,  # input, (M, N), row stride stride_x, unit column stride
    R,  # residual, (M, N), row stride stride_r; unused without HAS_RESIDUAL
    W,  # weight, (N,)
    B,  # bias, (N,); unused without HAS_BIAS
    Y,  # output, (M, N) contiguous, x's dtype
    H,  # h = x + residual, (M, N) contiguous, x's dtype; unused without HAS_RESIDUAL
    RSTD,  # (M,) float32
    MEAN,  # (M,) float32 row means of h; unused with RMS
    M,  # rows
    N,  # columns, <= BLOCK_N
    stride_x,  # x's row stride, elements
    stride_r,  # residual's row stride, elements (0: one row for all)
    eps,  # float32 added to the mean square / variance
    offset,  # float32 added to the weight (Gemma's 1 + w: 1.0)
    RMS: tl.constexpr,  # RMSNorm, else LayerNorm
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program
    BLOCK_N: tl.constexpr,  # next_power_of_2(N)
):
    # Bytes: reads x and residual, writes y and h: 4MNs (2MNs without a residual: h is x), plus 4-8 B a row
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    x_ptrs, r_ptrs, h_ptrs = X + rows64 * stride_x + cols, R + rows64 * stride_r + cols, H + rows64 * N + cols
    h = _add(x_ptrs, r_ptrs, h_ptrs, mask, HAS_RESIDUAL, True)  # (BM, BN)
    if RMS:
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)  # (BM,)
        hat = h * rstd[:, None]
    else:
        mean = tl.sum(h, axis=1) / N
        d = tl.where(mask, h - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(d * d, axis=1) / N + eps)
        hat = d * rstd[:, None]
        tl.store(MEAN + rows, mean, mask=rows < M)
    tl.store(RSTD + rows, rstd, mask=rows < M)
    y = hat * (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _backward_kernel(
    DY,  # gradient of y, (M, N), row stride stride_dy, unit column stride
    DH,  # gradient of h, (M, N), row stride stride_dh; unused without HAS_DH
    H,  # saved h, (M, N), row stride stride_h
    W,  # weight, (N,)
    RSTD,  # (M,) float32
    MEAN,  # (M,) float32; unused with RMS
    DX,  # dh, (M, N) contiguous, x's dtype: the gradient of x and of residual; unused without NEED_DX
    DW,  # (programs, N) float32 partial sums of dy * hat, or (N,) dw itself when one program
    DB,  # as DW, of dy; unused without NEED_DB
    M,  # rows
    N,  # columns, <= BLOCK_N
    rows_per_program,  # a multiple of BLOCK_M
    stride_dy,  # row strides, elements
    stride_dh,
    stride_h,
    offset,  # float32 added to the weight
    RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Bytes: reads dy, dh_out and h, writes dx: 4MNs (3MNs without dh_out), plus 4 B a partial sum
    # (programs x N, for dw and db) written here and read once by the reduction
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset  # (BN,)
    acc_w = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    first = tl.program_id(0) * rows_per_program
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)[:, None]
        mask = (rows < M)[:, None] & col_mask[None, :]
        h = tl.load(H + rows64 * stride_h + cols, mask=mask, other=0.0).to(tl.float32)  # (BM, BN)
        dy = tl.load(DY + rows64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)[:, None]
        if RMS:
            hat = h * rstd
        else:
            hat = tl.where(mask, h - tl.load(MEAN + rows, mask=rows < M, other=0.0)[:, None], 0.0) * rstd
        g = dy * w[None, :]
        c = g - hat * (tl.sum(g * hat, axis=1) / N)[:, None]
        if not RMS:
            c -= (tl.sum(g, axis=1) / N)[:, None]
        dh = c * rstd
        if HAS_DH:
            dh += tl.load(DH + rows64 * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        if NEED_DX:
            tl.store(DX + rows64 * N + cols, dh.to(DX.dtype.element_ty), mask=mask)
        if NEED_DW:  # selected: a padding column of a NaN row holds 0 * NaN
            acc_w += tl.where(mask, dy * hat, 0.0)
        if NEED_DB:
            acc_b += dy
    part = tl.program_id(0).to(tl.int64) * N + cols  # rows summed in a fixed order: deterministic
    if NEED_DW:
        tl.store(DW + part, tl.sum(acc_w, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if NEED_DB:
        tl.store(DB + part, tl.sum(acc_b, axis=0).to(DB.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------- rows past MAX_BLOCK_N


@triton.jit(do_not_specialize=["M"])
def _forward_wide_kernel(
    X,  # as _forward_kernel's, one row a program
    R,
    W,
    B,
    Y,
    H,
    RSTD,
    MEAN,
    M,  # rows
    N,  # columns, > BLOCK_N
    stride_x,
    stride_r,
    eps,
    offset,
    RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a chunk of the row
):
    # Bytes as _forward_kernel's: passes 2 (LayerNorm) and 3 read x and residual again, a program's row
    # (<= 2 x 4 x N B) still in L2
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    R += row * stride_r
    H += row * N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):  # pass 1: h stored; sum of h (layer) or of h^2 (rms)
        cols = start + tl.arange(0, BLOCK_N)
        h = _add(X + cols, R + cols, H + cols, cols < N, HAS_RESIDUAL, True)
        if RMS:
            acc += h * h
        else:
            acc += h
    if RMS:
        mean = 0.0
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    else:  # pass 2: the variance about the mean, from h formed again (not re-read: no barrier needed)
        mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            d = tl.where(cols < N, _add(X + cols, R + cols, H, cols < N, HAS_RESIDUAL, False) - mean, 0.0)
            acc += d * d
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    for start in range(0, N, BLOCK_N):  # pass 3: y
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        hat = (_add(X + cols, R + cols, H, mask, HAS_RESIDUAL, False) - mean) * rstd
        y = hat * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset)
        if HAS_BIAS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _backward_wide_kernel(
    DY,  # as _backward_kernel's, one row at a time
    DH,
    H,
    W,
    RSTD,
    MEAN,
    DX,
    DW,  # (programs, N) float32 partial sums, zeroed: each chunk is read, added to and stored
    DB,
    M,
    N,  # columns, > BLOCK_N
    rows_per_program,
    stride_dy,
    stride_dh,
    stride_h,
    offset,
    RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a chunk of the row
):
    # Bytes as _backward_kernel's: pass 2 reads dy and h again (a row's <= 2 x 4 x N B, in L2), and the
    # partial rows (program-owned: each element loaded and stored by the same thread) move through L2
    pid = tl.program_id(0)
    part = pid.to(tl.int64) * N
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, M - first)):
        row64 = first + i
        dy_row, dh_row, h_row = DY + row64 * stride_dy, DH + row64 * stride_dh, H + row64 * stride_h
        rstd = tl.load(RSTD + row64)
        if RMS:
            mean = 0.0
        else:
            mean = tl.load(MEAN + row64)
        acc_gh = tl.zeros((BLOCK_N,), tl.float32)
        acc_g = tl.zeros((BLOCK_N,), tl.float32)
        for start in range(0, N, BLOCK_N):  # pass 1: mean(g * hat), mean(g)
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
            hat = tl.where(mask, h - mean, 0.0) * rstd
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
            g = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32) * w
            acc_gh += g * hat
            acc_g += g
        c_gh = tl.sum(acc_gh, axis=0) / N
        if RMS:
            c_g = 0.0
        else:
            c_g = tl.sum(acc_g, axis=0) / N
        for start in range(0, N, BLOCK_N):  # pass 2: dh, and dw / db added to this program's partials
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            h = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
            hat = tl.where(mask, h - mean, 0.0) * rstd
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
            dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            dh = (dy * w - hat * c_gh - c_g) * rstd
            if HAS_DH:
                dh += tl.load(dh_row + cols, mask=mask, other=0.0).to(tl.float32)
            if NEED_DX:
                tl.store(DX + row64 * N + cols, dh.to(DX.dtype.element_ty), mask=mask)
            if NEED_DW:
                tl.store(DW + part + cols, tl.load(DW + part + cols, mask=mask) + dy * hat, mask=mask)
            if NEED_DB:
                tl.store(DB + part + cols, tl.load(DB + part + cols, mask=mask) + dy, mask=mask)
