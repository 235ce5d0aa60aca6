"""The dropout RNG spec of ``dispatch.contracts.rng`` in Triton, bit for bit: Philox4x32-7, the
(seed, offset) of a call, and the keep decisions of a tile or of one row step.

Each Philox call serves a group of eight consecutive elements of the logical (M, N) row-major view:
group g = (row * N + col) // 8 takes counter offset + g, and its element j = col % 8 the 16-bit value
(r[j % 4] >> 16 * (j // 4)) & 0xFFFF, kept iff >= the threshold T.

Cost: 7 rounds x (2 mul.wide + 2 xor3) a call shared by 8 elements, ~9 sm_90 instructions an element
with the masks; the key schedule runs on the uniform datapath (seed and offset are scalars: host words
or one load).
"""

import triton
import triton.language as tl

from dispatch.contracts import rng as spec

N_ROUNDS = tl.constexpr(spec.N_ROUNDS)
ROUND_A = tl.constexpr(spec.ROUND_A)
ROUND_B = tl.constexpr(spec.ROUND_B)
KEY_A = tl.constexpr(spec.KEY_A)
KEY_B = tl.constexpr(spec.KEY_B)


@triton.jit
def philox(seed, c0, c1):
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
def seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE: tl.constexpr):
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
def keep_mask(
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
        r0, r1, r2, r3 = philox(seed, counter.to(tl.uint32), (counter >> 32).to(tl.uint32))
        r0 = r0[:, :, None]
        r1 = r1[:, :, None]
        r2 = r2[:, :, None]
        r3 = r3[:, :, None]
        j = lanes[None, None, :]  # compile-time per register: the selects below fold away
    else:
        # groups straddle rows: one call per element, on its own flat index (exact, 8x the work)
        e = rows.to(tl.int64)[:, None, None] * N + (groups[:, None] * 8 + lanes[None, :])[None, :, :]
        counter = offset + (e >> 3)  # (BM, BN8, 8)
        r0, r1, r2, r3 = philox(seed, counter.to(tl.uint32), (counter >> 32).to(tl.uint32))
        j = (e & 7).to(tl.int32)
    k = j % 4
    word = tl.where(k == 0, r0, tl.where(k == 1, r1, tl.where(k == 2, r2, r3)))
    # u_j = (r[j % 4] >> 16 * (j // 4)) & 0xFFFF, compared in the top half of the word:
    # u >= T <=> (u << 16) >= (T << 16), and a high half needs no shift (its low bits cannot flip >=)
    word = tl.where(j < 4, word << 16, word)
    return word >= (threshold << 16).to(tl.uint32, bitcast=True)


@triton.jit
def row_keep_mask(seed, row_base, t, threshold, BN8: tl.constexpr):
    """Keep decisions of one row step's groups, whose counters are row_base + t (row_base an int64
    scalar, t = arange(BN8) as uint32), as the (BN8, 4) pair for the even and the odd elements of
    each group (elements 2k and 2k + 1 share a 32-bit word of x). When no group of the step carries
    into the counter's high word (a uniform branch), the high word is one scalar, so Philox's first
    rounds run partly on the uniform datapath; otherwise the carry is added exactly."""
    s_lo = row_base.to(tl.uint32)
    s_hi = (row_base >> 32).to(tl.uint32)
    c_lo = tl.add(s_lo, t, sanitize_overflow=False)  # wraps as the 64-bit sum's low word does
    if s_lo <= 0xFFFFFFFF - (BN8 - 1):
        r0, r1, r2, r3 = philox(seed, c_lo, tl.zeros_like(c_lo) + s_hi)
    else:
        r0, r1, r2, r3 = philox(seed, c_lo, s_hi + (c_lo < s_lo).to(tl.uint32))
    k = tl.arange(0, 4)[None, :]
    # element j = 2k (even) takes r[j % 4] = r0 / r2, j = 2k + 1 (odd) r1 / r3; low halves for j < 4
    even = tl.where(k % 2 == 0, r0[:, None], r2[:, None])
    odd = tl.where(k % 2 == 0, r1[:, None], r3[:, None])
    even = tl.where(k < 2, even << 16, even)
    odd = tl.where(k < 2, odd << 16, odd)
    t16 = (threshold << 16).to(tl.uint32, bitcast=True)
    return even >= t16, odd >= t16
