"""Triton kernels of bias_act_dropout: y = dropout(act(x + bias)), forward and backward.

Tiles are 3-D, (BLOCK_M rows, BLOCK_N // 8 groups, 8 lanes): a group is the eight consecutive
elements that share one Philox call under ``dispatch.contracts.rng``'s spec, so each call's eight 16-bit values
meet their elements without any interleaving (for 16-bit dtypes a thread holds whole groups: one
16-byte vector; for float32 two neighbouring threads share a group and each runs its call).

Bytes per element (dtype size s): forward reads x and writes y (2s); backward reads grad_y and x and
writes grad_x (3s), plus float32 partial bias sums, 4 B per (row-program, column): 1/16 B an element
with 64-row programs, written once and read once by ``_bias_grad_kernel`` (2% of bf16 backward bytes).

Issue budget: the H200 copies at 4.14 TB/s; 132 SMs x 4 schedulers x 32 lanes x 1.98 GHz retire
3.3e13 lane-instructions/s, so a bf16 forward at copy speed affords ~32 instructions an element, a bf16
backward ~48. sm_90 SASS of these kernels (triton 3.6 and 3.9, bf16, forward 4 x 1024 tiles / backward
loop at 2 x 1024): forward gelu 21 (30 with dropout), relu 8 (17); backward gelu 28 (38), relu 11 (20).
Dropout costs ~9 an element: Philox is 7 rounds x (2 mul.wide + 2 xor3) a call shared by 8 elements,
the key schedule runs on the uniform datapath (seed and offset are scalars: host words or one load).
"""

import triton
import triton.language as tl

from dispatch.backends.triton.activations import apply, grad
from dispatch.contracts import rng as spec

N_ROUNDS = tl.constexpr(spec.N_ROUNDS)
ROUND_A = tl.constexpr(spec.ROUND_A)
ROUND_B = tl.constexpr(spec.ROUND_B)
KEY_A = tl.constexpr(spec.KEY_A)
KEY_B = tl.constexpr(spec.KEY_B)


@triton.jit
def _philox(seed, c0, c1):
    """Philox4x32-7 of the counter (c0, c1, 0, 0) under the 64-bit seed: bit for bit
    ``tl.philox(seed, c0, c1, 0, 0, 7)``, with each round's products as one 32x32->64 multiply
    (mul.wide: hi and lo from one instruction, where tl.philox's umulhi + mul take two; 20% fewer
    instructions a call in sm_90 SASS). The key schedule stays scalar: the uniform datapath."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(N_ROUNDS):
        prod_a = c0.to(tl.uint64) * ROUND_A
        prod_b = c2.to(tl.uint64) * ROUND_B
        c0 = (prod_b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (prod_a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = prod_b.to(tl.uint32)
        c3 = prod_a.to(tl.uint32)
        k0 = tl.add(k0, KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, KEY_B, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _rng(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE: tl.constexpr):
    """(seed, offset) as 64-bit integers: loaded from the int64 [seed, offset] tensor RNG, or joined
    from the four 32-bit words of a ``HostRng`` passed as signed int32 scalars (one compiled variant
    whatever the values: no 32/64-bit or divisibility specialization)."""
    if RNG_ON_DEVICE:
        seed = tl.load(RNG).to(tl.uint64, bitcast=True)
        offset = tl.load(RNG + 1)
    else:
        seed = (seed_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | seed_lo.to(
            tl.uint32, bitcast=True
        ).to(tl.uint64)
        offset = (
            (offset_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
            | offset_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
        ).to(tl.int64, bitcast=True)
    return seed, offset


@triton.jit
def _keep(
    seed,  # 64-bit Philox key of this call
    offset,  # int64 first counter of this call
    rows,  # (BLOCK_M,) int32 row indices
    groups,  # (BLOCK_N // 8,) int32 group indices within a row: cols // 8
    lanes,  # (8,) int32: cols % 8
    N,  # row length of the logical (M, N) view
    threshold,  # T: drop iff the element's 16-bit value < T
    GROUPED: tl.constexpr,  # N % 8 == 0: each row starts a new group
):
    """(BLOCK_M, BLOCK_N // 8, 8) keep decisions, bit-identical to ``dispatch.contracts.rng.keep_mask``."""
    if GROUPED:
        # group of (row, col) = row * N / 8 + col / 8: one Philox call per (row, group)
        counter = (offset + rows.to(tl.int64) * (N // 8))[:, None] + groups[None, :]  # (BM, BN8)
        r0, r1, r2, r3 = _philox(seed, counter.to(tl.uint32), (counter >> 32).to(tl.uint32))
        r0 = r0[:, :, None]
        r1 = r1[:, :, None]
        r2 = r2[:, :, None]
        r3 = r3[:, :, None]
        j = lanes[None, None, :]  # compile-time per register: the selects below fold away
    else:
        # groups straddle rows: one call per element, on its own flat index (exact, 8x the work)
        e = rows.to(tl.int64)[:, None, None] * N + (groups[:, None] * 8 + lanes[None, :])[None, :, :]
        counter = offset + (e >> 3)  # (BM, BN8, 8)
        r0, r1, r2, r3 = _philox(seed, counter.to(tl.uint32), (counter >> 32).to(tl.uint32))
        j = (e & 7).to(tl.int32)
    k = j % 4
    word = tl.where(k == 0, r0, tl.where(k == 1, r1, tl.where(k == 2, r2, r3)))
    # u_j = (r[j % 4] >> 16 * (j // 4)) & 0xFFFF, compared in the top half of the word:
    # u >= T <=> (u << 16) >= (T << 16), and a high half needs no shift (its low bits cannot flip >=)
    word = tl.where(j < 4, word << 16, word)
    return word >= (threshold << 16).to(tl.uint32, bitcast=True)


@triton.jit(do_not_specialize=["M", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _forward_kernel(
    X,  # input, (M, N) with strides (stride_xm, stride_xn)
    B,  # bias, (N,); unused without HAS_BIAS
    Y,  # output, (M, N) contiguous, x's dtype
    RNG,  # int64 [seed, offset] with RNG_ON_DEVICE; unused without DROPOUT
    seed_lo,  # int32 words of a host (seed, offset), without RNG_ON_DEVICE
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows
    N,  # columns
    stride_xm,  # x's row stride, elements
    stride_xn,  # x's column stride, elements (0 for an expanded x)
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    ACTIVATION: tl.constexpr,  # name in backends.triton.activations
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,  # False: no RNG work at all
    RNG_ON_DEVICE: tl.constexpr,  # (seed, offset) in the RNG tensor, else in the four int32 words
    GROUPED: tl.constexpr,  # N % 8 == 0
    WIDE: tl.constexpr,  # column offsets need 64 bits
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of 8
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    groups = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # (BN8,)
    lanes = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lanes[None, :]  # (BN8, 8)
    if WIDE:
        cols = cols.to(tl.int64)
    col_mask = cols < N
    mask = (rows < M)[:, None, None] & col_mask[None, :, :]
    x_ptrs = X + (rows.to(tl.int64) * stride_xm)[:, None, None] + (cols * stride_xn)[None, :, :]
    z = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BM, BN8, 8)
    if HAS_BIAS:  # loaded in x's tile shape (rows share addresses): x's layout, no shared-memory shuffle
        b_ptrs = tl.broadcast_to(B + cols[None, :, :], (BLOCK_M, BLOCK_N // 8, 8))
        z += tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    y = apply(z, ACTIVATION)
    if DROPOUT:
        seed, offset = _rng(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
        keep = _keep(seed, offset, rows, groups, lanes, N, threshold, GROUPED)
        # y * keep * scale as F.dropout: a dropped NaN or inf gives NaN (a select of y would give 0);
        # the same select + multiply as selecting y, and the mask first, so a dropped 3e38 gives 0
        y = y * tl.where(keep, scale, 0.0)
    y_ptrs = Y + (rows.to(tl.int64) * N)[:, None, None] + cols[None, :, :]
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(
    do_not_specialize=["M", "rows_per_program", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"]
)
def _backward_kernel(
    GY,  # upstream gradient, (M, N) with strides (stride_gm, stride_gn), possibly 0
    X,  # forward input, (M, N) with strides (stride_xm, stride_xn)
    B,  # bias, (N,); unused without HAS_BIAS
    GX,  # grad_x, (M, N) contiguous, x's dtype; unused without NEED_X
    GB,  # (row programs, N) float32 partial bias gradients, or (N,) grad_bias when one row program
    RNG,  # int64 [seed, offset] with RNG_ON_DEVICE; unused without DROPOUT
    seed_lo,  # int32 words of a host (seed, offset), without RNG_ON_DEVICE
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows
    N,  # columns
    rows_per_program,  # a multiple of BLOCK_M
    stride_gm,
    stride_gn,
    stride_xm,
    stride_xn,
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    RNG_ON_DEVICE: tl.constexpr,
    GROUPED: tl.constexpr,
    WIDE: tl.constexpr,
    NEED_X: tl.constexpr,  # write grad_x
    NEED_BIAS: tl.constexpr,  # write the bias gradient (partial sums over this program's rows)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    groups = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    lanes = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lanes[None, :]  # (BN8, 8)
    if WIDE:
        cols = cols.to(tl.int64)
    col_mask = cols < N
    if HAS_BIAS:
        bias = tl.load(B + cols[None, :, :], mask=col_mask[None, :, :], other=0.0).to(tl.float32)
    if DROPOUT:  # loaded once: inside the loop they could alias the stores and be reloaded
        seed, offset = _rng(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
    acc = tl.zeros((BLOCK_M, BLOCK_N // 8, 8), tl.float32)
    first_row = tl.program_id(0) * rows_per_program
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first_row + start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None, None] & col_mask[None, :, :]
        rows64 = rows.to(tl.int64)
        gy = tl.load(
            GY + (rows64 * stride_gm)[:, None, None] + (cols * stride_gn)[None, :, :], mask=mask, other=0.0
        ).to(tl.float32)
        z = tl.load(
            X + (rows64 * stride_xm)[:, None, None] + (cols * stride_xn)[None, :, :], mask=mask, other=0.0
        ).to(tl.float32)
        if HAS_BIAS:
            z += bias
        if DROPOUT:
            keep = _keep(seed, offset, rows, groups, lanes, N, threshold, GROUPED)
            gy = gy * tl.where(keep, scale, 0.0)  # F.dropout's backward: grad * mask * scale
        gz = grad(gy, z, ACTIVATION)  # masked-out rows give 0: gy and z are 0 there
        if NEED_X:
            tl.store(
                GX + (rows64 * N)[:, None, None] + cols[None, :, :], gz.to(GX.dtype.element_ty), mask=mask
            )
        if NEED_BIAS:
            acc += gz
    if NEED_BIAS:
        partial = tl.sum(acc, axis=0)  # (BN8, 8), rows summed in a fixed order: deterministic
        row_offset = tl.program_id(0).to(tl.int64) * N
        tl.store(GB + row_offset + cols, partial.to(GB.dtype.element_ty), mask=col_mask)


@triton.jit(do_not_specialize=["R"])
def _bias_grad_kernel(
    P,  # (R, N) float32 partial bias gradients, contiguous
    GB,  # (N,) grad_bias, bias's dtype
    R,  # row programs that wrote partials
    N,  # columns
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & (cols < N)[None, :]
        acc += tl.load(P + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(GB + cols, tl.sum(acc, axis=0).to(GB.dtype.element_ty), mask=cols < N)

