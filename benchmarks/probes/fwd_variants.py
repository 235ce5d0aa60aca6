"""Issue 3 probe: variants of the bf16 bias_act_dropout forward (gelu, p = 0.1) that issue fewer sm_90
instructions an element, each checked bit for bit against the shipped ``forward`` and timed next to a
device copy of the same tensor (do_bench medians, same run).

The shipped kernel (BLOCK_M 2 x BLOCK_N 2048, 4 warps: 32 elements a thread) is issue-bound with
dropout: 29.4 SASS instructions an element (20.6 without), ~3% of copy time each. The variants keep
its math (so y is bit-identical) and change only bookkeeping:

* rows: a program loops over ROWS rows: the bias is loaded and widened once, the key schedule and
  column addresses computed once (the shipped tile loads and widens the bias once per row).
* row: one row of BLOCK_N per loop step (16 elements a thread): the row, its first counter and the
  no-carry test are scalars. At 32 elements a thread in a loop ptxas spills keep predicates (P2R).
* uhi: when no group of the row step can carry into the counter's high word (the low word of its
  first counter <= 2**32 - BLOCK_N / 8, a uniform branch), the high word is one scalar: Philox's
  first two rounds run partly on the uniform datapath, and the low word is a 32-bit add. The shipped
  64-bit add, truncated later, hides the operand width from LLVM: its first two rounds multiply in 64
  bits (4 extra IADD3 a call). Otherwise the carry is c_lo < s_lo (exact: offsets < 2**31).
* words: x and the bias are read as 32-bit words (two bf16 each): the even element widens with one
  shift, the odd one with one AND (cvt.f32.bf16 of a high half costs PRMT + SHF); results are joined
  back into bf16 pairs (one F2FP pack each, as shipped).
* EVEN (M % ROWS == 0 and N % BLOCK_N == 0): no masks (masked loads also zero their registers first).

Instruction counts an element: sm_90 SASS from triton 3.9's ptxas, compiled offline (SASS_PER_ELEMENT).

GPU: ``PYTHONPATH=. python3 benchmarks/probes/fwd_variants.py`` (~60 s).
CPU: ``TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/probes/fwd_variants.py --check``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from tabulate import tabulate

from backends.triton import bias_act_dropout as op
from backends.triton.activations import apply
from backends.triton.bias_act_dropout_kernels import _philox, _rng
from dispatch import rng as dropout_rng

SHAPES = [(65536, 4096), (16384, 14336)]
BLOCK_M, BLOCK_N, WARPS = 2, 2048, 4  # the shipped large-shape bf16 dropout tile
# name: (kernel, ROWS, flag, WORDS); "tile": _variant_kernel (BLOCK_M x BLOCK_N tiles, flag = CTR32),
# "row": _rows_kernel (one row of BLOCK_N a step, 16 elements a thread, flag = UNIFORM_HI)
VARIANTS = {
    "tile rows16": ("tile", 16, False, False),
    "row r8 uhi": ("row", 8, True, False),
    "row r8 uhi words": ("row", 8, True, True),
    "row r16 uhi words": ("row", 16, True, True),
}
# sm_90 SASS instructions an element on the no-carry path (triton 3.9 ptxas, offline, bf16 gelu with
# bias, 65536 x 4096): loop body + prologue / rows. Also measured offline: tile ctr32 29.3, row r8
# (64-bit counter) 28.9, one-row steps at 32 elements a thread 28.1-28.6 (P2R predicate spills, 118 regs).
SASS_PER_ELEMENT = {
    "shipped p=0": 20.6,
    "shipped": 29.4,
    "tile rows16": 28.3,
    "row r8 uhi": 27.9,
    "row r8 uhi words": 27.6,
    "row r16 uhi words": 27.2,
}


@triton.jit
def _keep_words(seed, offset, rows, groups, N, threshold, CTR32: tl.constexpr, W: tl.constexpr):
    """Keep decisions of dispatch.rng's spec for N % 8 == 0 as (BM, BN8, 8) (W = 8), or as the even and
    odd elements' (BM, BN8, 4) pair (W = 4)."""
    base = offset + rows.to(tl.int64) * (N // 8)  # (BM,) first counter of each row
    if CTR32:  # c = base + g exactly: low word wraps in 32 bits, carry = (c_lo < base_lo)
        base_lo = base.to(tl.uint32)[:, None]
        c_lo = tl.add(base_lo, groups.to(tl.uint32)[None, :], sanitize_overflow=False)  # (BM, BN8)
        c_hi = (base >> 32).to(tl.uint32)[:, None] + (c_lo < base_lo).to(tl.uint32)
    else:
        counter = base[:, None] + groups[None, :]
        c_lo = counter.to(tl.uint32)
        c_hi = (counter >> 32).to(tl.uint32)
    r0, r1, r2, r3 = _philox(seed, c_lo, c_hi)
    r0 = r0[:, :, None]
    r1 = r1[:, :, None]
    r2 = r2[:, :, None]
    r3 = r3[:, :, None]
    t16 = (threshold << 16).to(tl.uint32, bitcast=True)
    k = tl.arange(0, W)[None, None, :]  # compile-time per register: the selects fold away
    if W == 8:
        m = k % 4
        word = tl.where(m == 0, r0, tl.where(m == 1, r1, tl.where(m == 2, r2, r3)))
        word = tl.where(k < 4, word << 16, word)
        return word >= t16, word >= t16
    else:  # even element 2k: r0, r2 (low halves k = 0, 1; high k = 2, 3); odd 2k + 1: r1, r3
        even = tl.where(k % 2 == 0, r0, r2)
        odd = tl.where(k % 2 == 0, r1, r3)
        even = tl.where(k < 2, even << 16, even)
        odd = tl.where(k < 2, odd << 16, odd)
        return even >= t16, odd >= t16


@triton.jit(do_not_specialize=["M", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _variant_kernel(
    X,  # input, (M, N), unit column stride
    B,  # bias, (N,)
    Y,  # output, (M, N) contiguous
    seed_lo,  # int32 words of a HostRng
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows
    N,  # columns, a multiple of 8
    stride_xm,  # x's row stride, elements (even with WORDS)
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    ACTIVATION: tl.constexpr,
    EVEN: tl.constexpr,  # M % ROWS == 0 and N % BLOCK_N == 0: no masks
    CTR32: tl.constexpr,  # 32-bit counter low word (see the module docstring)
    WORDS: tl.constexpr,  # 32-bit word loads: even / odd elements apart
    W: tl.constexpr,  # 4 with WORDS (words of a group), else 8 (elements of a group)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program, a multiple of BLOCK_M
):
    groups = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # (BN8,)
    lanes = tl.arange(0, W)
    cols = groups[:, None] * W + lanes[None, :]  # (BN8, W): element columns, or word columns
    col_mask = cols < (N // (8 // W))
    tile_mask = tl.broadcast_to(col_mask[None, :, :], (BLOCK_M, BLOCK_N // 8, W))
    if WORDS:
        Xw = X.to(tl.pointer_type(tl.uint32))
        Yw = Y
        Bw = B.to(tl.pointer_type(tl.uint32))
    else:
        Xw = X
        Yw = Y
        Bw = B
    b_ptrs = tl.broadcast_to(Bw + cols[None, :, :], (BLOCK_M, BLOCK_N // 8, W))  # x's layout
    if EVEN:
        bias = tl.load(b_ptrs)
    else:
        bias = tl.load(b_ptrs, mask=tile_mask, other=0)
    if WORDS:
        b_even = (bias << 16).to(tl.float32, bitcast=True)
        b_odd = (bias & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        b_even = bias.to(tl.float32)
        b_odd = b_even
    seed, offset = _rng(X, seed_lo, seed_hi, offset_lo, offset_hi, False)
    first = tl.program_id(0) * ROWS
    for start in range(0, ROWS, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)  # (BM,)
        rows64 = rows.to(tl.int64)
        x_ptrs = Xw + (rows64 * (stride_xm // (8 // W)))[:, None, None] + cols[None, :, :]
        if EVEN:
            x = tl.load(x_ptrs)
        else:
            mask = (rows < M)[:, None, None] & tile_mask
            x = tl.load(x_ptrs, mask=mask, other=0)
        keep_even, keep_odd = _keep_words(seed, offset, rows, groups, N, threshold, CTR32, W)
        if WORDS:
            z_even = (x << 16).to(tl.float32, bitcast=True) + b_even
            z_odd = (x & 0xFFFF0000).to(tl.float32, bitcast=True) + b_odd
            y_even = tl.where(keep_even, apply(z_even, ACTIVATION), 0.0) * scale
            y_odd = tl.where(keep_odd, apply(z_odd, ACTIVATION), 0.0) * scale
            y = tl.reshape(tl.join(y_even, y_odd), (BLOCK_M, BLOCK_N // 8, 8))
            out_cols = groups[:, None] * 8 + tl.arange(0, 8)[None, :]
        else:
            z = x.to(tl.float32) + b_even
            y = tl.where(keep_even, apply(z, ACTIVATION), 0.0) * scale
            out_cols = cols
        y_ptrs = Yw + (rows64 * N)[:, None, None] + out_cols[None, :, :]
        if EVEN:
            tl.store(y_ptrs, y.to(Y.dtype.element_ty))
        else:
            out_mask = (rows < M)[:, None, None] & (out_cols < N)[None, :, :]
            tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _row_keep(seed, row_base, t, threshold, BN8: tl.constexpr, UNIFORM_HI: tl.constexpr, W: tl.constexpr):
    """Keep decisions of one row's groups (BN8,) whose counters are row_base + t (row_base: int64
    scalar, t = arange(BN8) as uint32), as (BN8, 8) (W = 8) or the even / odd (BN8, 4) pair.
    UNIFORM_HI: the high counter word is one scalar when the row's low words cannot wrap (a uniform
    branch), so Philox's first two rounds run half on the uniform datapath."""
    s_lo = row_base.to(tl.uint32)
    s_hi = (row_base >> 32).to(tl.uint32)
    c_lo = tl.add(s_lo, t, sanitize_overflow=False)  # wraps exactly as the 64-bit sum's low word
    if UNIFORM_HI:
        if s_lo <= 0xFFFFFFFF - (BN8 - 1):  # no group of the row carries into the high word
            r0, r1, r2, r3 = _philox(seed, c_lo, tl.zeros_like(c_lo) + s_hi)
        else:
            r0, r1, r2, r3 = _philox(seed, c_lo, s_hi + (c_lo < s_lo).to(tl.uint32))
    else:
        r0, r1, r2, r3 = _philox(seed, c_lo, s_hi + (c_lo < s_lo).to(tl.uint32))
    r0 = r0[:, None]
    r1 = r1[:, None]
    r2 = r2[:, None]
    r3 = r3[:, None]
    t16 = (threshold << 16).to(tl.uint32, bitcast=True)
    k = tl.arange(0, W)[None, :]
    if W == 8:
        m = k % 4
        word = tl.where(m == 0, r0, tl.where(m == 1, r1, tl.where(m == 2, r2, r3)))
        word = tl.where(k < 4, word << 16, word)
        return word >= t16, word >= t16
    else:
        even = tl.where(k % 2 == 0, r0, r2)
        odd = tl.where(k % 2 == 0, r1, r3)
        even = tl.where(k < 2, even << 16, even)
        odd = tl.where(k < 2, odd << 16, odd)
        return even >= t16, odd >= t16


@triton.jit(do_not_specialize=["M", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _rows_kernel(
    X,  # input, (M, N), unit column stride
    B,  # bias, (N,)
    Y,  # output, (M, N) contiguous
    seed_lo,  # int32 words of a HostRng
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows
    N,  # columns, a multiple of 8
    stride_xm,  # x's row stride, elements (even with WORDS)
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    ACTIVATION: tl.constexpr,
    EVEN: tl.constexpr,  # M % ROWS == 0 and N % BLOCK_N == 0: no masks
    UNIFORM_HI: tl.constexpr,  # scalar high counter word when no carry is possible
    WORDS: tl.constexpr,  # 32-bit word loads: even / odd elements apart
    W: tl.constexpr,  # 4 with WORDS (words of a group), else 8 (elements of a group)
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program, one (BLOCK_N // 8, 8) tile at a time
):
    """One row at a time: row index, counter base and the no-carry test are scalars."""
    g0 = tl.program_id(1) * (BLOCK_N // 8)
    groups = g0 + tl.arange(0, BLOCK_N // 8)  # (BLOCK_N // 8,)
    cols = groups[:, None] * W + tl.arange(0, W)[None, :]  # (BN8, W): element or word columns
    col_mask = cols < (N // (8 // W))
    if WORDS:
        Xw = X.to(tl.pointer_type(tl.uint32))
        Bw = B.to(tl.pointer_type(tl.uint32))
    else:
        Xw = X
        Bw = B
    if EVEN:
        bias = tl.load(Bw + cols)
    else:
        bias = tl.load(Bw + cols, mask=col_mask, other=0)
    if WORDS:
        b_even = (bias << 16).to(tl.float32, bitcast=True)
        b_odd = (bias & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        b_even = bias.to(tl.float32)
        b_odd = b_even
    seed, offset = _rng(X, seed_lo, seed_hi, offset_lo, offset_hi, False)
    t = tl.arange(0, BLOCK_N // 8).to(tl.uint32)
    out_cols = groups[:, None] * 8 + tl.arange(0, 8)[None, :]  # (BN8, 8)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        x_ptrs = Xw + row.to(tl.int64) * (stride_xm // (8 // W)) + cols
        if EVEN:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=col_mask & ((cols * 0 + row) < M), other=0)
        row_base = offset + row.to(tl.int64) * (N // 8) + g0
        keep_even, keep_odd = _row_keep(seed, row_base, t, threshold, BLOCK_N // 8, UNIFORM_HI, W)
        if WORDS:
            z_even = (x << 16).to(tl.float32, bitcast=True) + b_even
            z_odd = (x & 0xFFFF0000).to(tl.float32, bitcast=True) + b_odd
            y_even = tl.where(keep_even, apply(z_even, ACTIVATION), 0.0) * scale
            y_odd = tl.where(keep_odd, apply(z_odd, ACTIVATION), 0.0) * scale
            y = tl.reshape(tl.join(y_even, y_odd), (BLOCK_N // 8, 8))
        else:
            y = tl.where(keep_even, apply(x.to(tl.float32) + b_even, ACTIVATION), 0.0) * scale
        y_ptrs = Y + row.to(tl.int64) * N + out_cols
        if EVEN:
            tl.store(y_ptrs, y.to(Y.dtype.element_ty))
        else:
            tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=(out_cols < N) & ((out_cols * 0 + row) < M))


def rows_forward(x, b, activation, p, rng, rows, uniform_hi, words, block_n=BLOCK_N, warps=WARPS):
    """_rows_kernel's y (same contract as variant_forward)."""
    m, n = x.shape
    assert n % 8 == 0 and x.stride(1) == 1 and (x.stride(0) % 2 == 0 or not words)
    y = torch.empty_like(x)
    (_, s0, s1, o0, o1, threshold, scale), on_device = op._dropout_args(x, p, rng)
    assert not on_device
    even = m % rows == 0 and n % block_n == 0
    grid = (triton.cdiv(m, rows), triton.cdiv(n, block_n))
    _rows_kernel[grid](
        x, b, y, s0, s1, o0, o1, m, n, x.stride(0), threshold, scale,
        activation, even, uniform_hi, words, 4 if words else 8, block_n, rows, num_warps=warps,
    )  # fmt: skip
    return y


def variant_forward(x, b, activation, p, rng, rows, ctr32, words, block_m=BLOCK_M, block_n=BLOCK_N, warps=WARPS):
    """The variant's y for contiguous bf16/fp16 x (N % 8 == 0), bias and a HostRng (the shipped call's)."""
    m, n = x.shape
    assert n % 8 == 0 and x.stride(1) == 1 and rows % block_m == 0 and (x.stride(0) % 2 == 0 or not words)
    y = torch.empty_like(x)
    (_, s0, s1, o0, o1, threshold, scale), on_device = op._dropout_args(x, p, rng)
    assert not on_device
    even = m % rows == 0 and n % block_n == 0
    grid = (triton.cdiv(m, rows), triton.cdiv(n, block_n))
    _variant_kernel[grid](
        x, b, y, s0, s1, o0, o1, m, n, x.stride(0), threshold, scale,
        activation, even, ctr32, words, 4 if words else 8, block_m, block_n, rows, num_warps=warps,
    )  # fmt: skip
    return y


def run_variant(name, x, b, activation, p, rng, rows_cap=None, block_n=BLOCK_N, warps=WARPS):
    kind, rows, flag, words = VARIANTS[name]
    rows = rows if rows_cap is None else min(rows, rows_cap)
    if kind == "tile":
        return variant_forward(x, b, activation, p, rng, rows, flag, words, block_n=block_n, warps=warps)
    return rows_forward(x, b, activation, p, rng, rows, flag, words, block_n=block_n, warps=warps)


def _bits_equal(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_cpu():
    """Interpreter check on tiny shapes: every variant bit-identical to the shipped forward and to
    the eager reference mask."""
    torch.manual_seed(0)
    failures = 0
    for m, n, block_n, seed, offset in [(2, 64, 64, 123, 5), (6, 48, 32, 2**40 + 7, 2**32 - 3), (3, 16, 16, 9, 2**33 - 2)]:
        x = torch.randn(m, n, dtype=torch.bfloat16) * 3
        b = torch.randn(n, dtype=torch.bfloat16)
        rng = dropout_rng.HostRng(seed, offset)
        ref = op.forward(x, b, "gelu", 0.1, rng)
        for name in VARIANTS:  # at most 4 rows a program: a ragged last program when m % 4 != 0
            y = run_variant(name, x, b, "gelu", 0.1, rng, rows_cap=4, block_n=block_n, warps=1)
            ok = _bits_equal(y, ref)
            failures += not ok
            print(f"{m}x{n} offset {offset:#x} {name}: bitwise {'equal' if ok else 'DIFFERENT'}")
    sys.exit(1 if failures else 0)


def bench():
    def ms(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    table = []
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        rng = dropout_rng.draw_for(x)
        ref = op.forward(x, b, "gelu", 0.1, rng)
        copy = ms(lambda: dst.copy_(x))
        shape = f"{m}x{n}"
        t = ms(lambda: op.forward(x, b, "gelu", 0.0, None))
        table.append(["shipped p=0", shape, "-", t, t / copy, SASS_PER_ELEMENT.get("shipped p=0")])
        t = ms(lambda: op.forward(x, b, "gelu", 0.1, rng))
        table.append(["shipped", shape, True, t, t / copy, SASS_PER_ELEMENT.get("shipped")])
        for name in VARIANTS:
            try:
                y = run_variant(name, x, b, "gelu", 0.1, rng)
                ok = torch.equal(y, ref) and _bits_equal(y, ref)
                t = ms(lambda: run_variant(name, x, b, "gelu", 0.1, rng))
                table.append([name, shape, ok, t, t / copy, SASS_PER_ELEMENT.get(name)])
            except Exception as e:  # a variant the compiler rejects: recorded, not fatal
                table.append([name, shape, repr(e)[:60], None, None, SASS_PER_ELEMENT.get(name)])
        table.append(["copy", shape, "-", copy, 1.0, None])
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(tabulate(table, headers=["variant", "shape", "bitwise-equal", "ms", "x copy", "SASS/elem"], floatfmt=".3f"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="CPU interpreter bit-equality check on tiny shapes")
    args = parser.parse_args()
    if args.check or not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--check needs TRITON_INTERPRET=1 (set it before python starts)")
        check_cpu()
    else:
        bench()
