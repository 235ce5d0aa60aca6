"""The 16-bit forward of bias_act_dropout with dropout past decode sizes: one row per loop step, x
and the bias read as 32-bit words (two elements each). Same math and mask as ``_forward_kernel`` in
``bias_act_dropout_kernels.py``, bit for bit; fewer instructions an element (see the kernel's docstring).
"""

import triton
import triton.language as tl

from dispatch.backends.triton.activations import apply
from dispatch.backends.triton.bias_act_dropout_kernels import _philox, _rng


@triton.jit
def _row_keep(seed, row_base, t, threshold, BN8: tl.constexpr):
    """Keep decisions of one row step's groups, whose counters are row_base + t (row_base an int64
    scalar, t = arange(BN8) as uint32), as the (BN8, 4) pair for the even and the odd elements of
    each group (elements 2k and 2k + 1 share a 32-bit word of x). When no group of the step carries
    into the counter's high word (a uniform branch), the high word is one scalar, so Philox's first
    rounds run partly on the uniform datapath; otherwise the carry is added exactly."""
    s_lo = row_base.to(tl.uint32)
    s_hi = (row_base >> 32).to(tl.uint32)
    c_lo = tl.add(s_lo, t, sanitize_overflow=False)  # wraps as the 64-bit sum's low word does
    if s_lo <= 0xFFFFFFFF - (BN8 - 1):
        r0, r1, r2, r3 = _philox(seed, c_lo, tl.zeros_like(c_lo) + s_hi)
    else:
        r0, r1, r2, r3 = _philox(seed, c_lo, s_hi + (c_lo < s_lo).to(tl.uint32))
    k = tl.arange(0, 4)[None, :]
    # element j = 2k (even) takes r[j % 4] = r0 / r2, j = 2k + 1 (odd) r1 / r3; low halves for j < 4
    even = tl.where(k % 2 == 0, r0[:, None], r2[:, None])
    odd = tl.where(k % 2 == 0, r1[:, None], r3[:, None])
    even = tl.where(k < 2, even << 16, even)
    odd = tl.where(k < 2, odd << 16, odd)
    t16 = (threshold << 16).to(tl.uint32, bitcast=True)
    return even >= t16, odd >= t16


@triton.jit
def _widen(words, DTYPE: tl.constexpr):
    """(even, odd) float32 elements of 32-bit words holding two 16-bit ones (little-endian: the even
    element is the low half). bfloat16 widens by bit moves alone (one shift, one AND); float16
    needs a conversion each."""
    if DTYPE == tl.bfloat16:
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        tl.static_assert(DTYPE == tl.float16, "the rows kernel reads bfloat16 or float16")
        even = (words & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (words >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit(do_not_specialize=["M", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _forward_rows_kernel(
    X,  # input, (M, N) 16-bit, unit column stride, even row stride, 4-byte aligned
    B,  # bias, (N,), 4-byte aligned; unused without HAS_BIAS
    Y,  # output, (M, N) contiguous
    RNG,  # int64 [seed, offset] with RNG_ON_DEVICE
    seed_lo,  # int32 words of a host (seed, offset), without RNG_ON_DEVICE
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows
    N,  # columns, a multiple of 8
    stride_xm,  # x's row stride, elements, even
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RNG_ON_DEVICE: tl.constexpr,
    EVEN: tl.constexpr,  # M % ROWS == 0 and N % BLOCK_N == 0: no masks
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program, one (BLOCK_N // 8, 8) step at a time
):
    """The 16-bit forward with dropout, one row per loop step: x and the bias are read as 32-bit
    words (two elements each: the even one widens with one shift, the odd one with one AND), the
    bias is widened once per program, and the row, its first counter and the no-carry test are
    scalars. 27.6 sm_90 instructions an element against the tiled kernel's 29.4 (triton 3.9 ptxas),
    1.12x a copy's time against 1.31x (H200, 65536 x 4096 bf16 gelu p = 0.1); y is bit-identical."""
    g0 = tl.program_id(1) * (BLOCK_N // 8)
    groups = g0 + tl.arange(0, BLOCK_N // 8)  # (BN8,)
    words = groups[:, None] * 4 + tl.arange(0, 4)[None, :]  # (BN8, 4) word columns
    word_mask = words < N // 2
    if HAS_BIAS:
        Bw = B.to(tl.pointer_type(tl.uint32))
        if EVEN:
            bias = tl.load(Bw + words)
        else:
            bias = tl.load(Bw + words, mask=word_mask, other=0)
        b_even, b_odd = _widen(bias, X.dtype.element_ty)
    Xw = X.to(tl.pointer_type(tl.uint32))
    seed, offset = _rng(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
    t = tl.arange(0, BLOCK_N // 8).to(tl.uint32)
    out_cols = groups[:, None] * 8 + tl.arange(0, 8)[None, :]  # (BN8, 8)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        x_ptrs = Xw + row.to(tl.int64) * (stride_xm // 2) + words
        if EVEN:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=word_mask & ((words * 0 + row) < M), other=0)
        z_even, z_odd = _widen(x, X.dtype.element_ty)
        if HAS_BIAS:
            z_even += b_even
            z_odd += b_odd
        keep_even, keep_odd = _row_keep(seed, offset + row.to(tl.int64) * (N // 8) + g0, t, threshold, BLOCK_N // 8)
        # y * keep * scale as F.dropout (a dropped NaN or inf gives NaN), as in _forward_kernel
        y_even = apply(z_even, ACTIVATION) * tl.where(keep_even, scale, 0.0)
        y_odd = apply(z_odd, ACTIVATION) * tl.where(keep_odd, scale, 0.0)
        y = tl.reshape(tl.join(y_even, y_odd), (BLOCK_N // 8, 8))
        y_ptrs = Y + row.to(tl.int64) * N + out_cols
        if EVEN:
            tl.store(y_ptrs, y.to(Y.dtype.element_ty))
        else:
            tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=(out_cols < N) & ((out_cols * 0 + row) < M))
