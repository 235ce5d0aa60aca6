"""Triton bias_act_dropout: y = dropout(act(x + bias)), forward and backward, the
kernels of ``dispatch.ops.bias_act_dropout``. In order: the kernels, their launch settings, the
launchers (check, allocate, launch). The dropout mask is the RNG spec's, from ``philox.py``.

Tiles are 3-D, (BLOCK_M rows, BLOCK_N // 8 groups, 8 lanes): a group is the eight consecutive
elements that share one Philox call under ``dispatch.contracts.rng``'s spec, so each call's eight
16-bit values meet their elements without any interleaving (for 16-bit dtypes a thread holds whole
groups: one 16-byte vector; for float32 two neighbouring threads share a group and each runs its call).

Bytes per element (dtype size s): forward reads x and writes y (2s); backward reads grad_y and x and
writes grad_x (3s), plus float32 partial bias sums, 4 B per (row-program, column): 1/16 B an element
with 64-row programs, written once and read once by ``_bias_grad_kernel`` (2% of bf16 backward bytes).

Issue budget: at copy speed a bf16 forward affords ~32 sm_90 instructions an element, a backward ~48
(4.14 TB/s against 3.3e13 lane-instructions/s); these kernels take forward gelu 21 (30 with dropout),
backward gelu 28 (38): dropout costs ~9 an element (``philox.py``).

Launch settings come from a rule, not an autotuner, so a new token count never triggers tuning:
BLOCK_N a power of two <= 1024 that wastes at most 1/16 of a row on padding, BLOCK_M the rest of a
fixed tile; decode shapes (M <= 64) take every row in one tile: one launch forward, one backward.
Compiled variants are keyed by these buckets only (M is not specialized). 16-bit inputs with dropout
past decode sizes take ``_forward_rows_kernel``, bit for bit the tile kernel's y in fewer instructions;
contiguous 16-bit inputs without dropout ``_forward_flat_kernel``, bit for bit too.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dispatch.backends.triton.activations import apply, grad
from dispatch.backends.triton.launch import Launcher
from dispatch.backends.triton.philox import keep_mask, row_keep_mask, seed_offset
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.backend import Kernels
from dispatch.contracts.rng import Rng


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
        seed, offset = seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
        keep = keep_mask(seed, offset, rows, groups, lanes, N, threshold, GROUPED)
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
        seed, offset = seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
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
            keep = keep_mask(seed, offset, rows, groups, lanes, N, threshold, GROUPED)
            gy = gy * tl.where(keep, scale, 0.0)  # F.dropout's backward: grad * mask * scale
        gz = grad(gy, z, ACTIVATION)  # (BM, BN8, 8); masked-out rows hold z = bias, gy = 0
        if NEED_X:
            tl.store(
                GX + (rows64 * N)[:, None, None] + cols[None, :, :], gz.to(GX.dtype.element_ty), mask=mask
            )
        if NEED_BIAS:  # selected, not trusted to be 0: squared_relu'(3e38) * 0 = inf * 0 = NaN
            acc += tl.where(mask, gz, 0.0)
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


# ----------------------------------------------------------------------------- the 16-bit rows kernel
# The forward with dropout past decode sizes: one row per loop step, x and the bias read as 32-bit
# words (two elements each). Same math and mask as _forward_kernel, bit for bit.


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
    scalars: 1.12x a copy's time against the tiled kernel's 1.31x; y is bit-identical."""
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
    seed, offset = seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
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
        row_base = offset + row.to(tl.int64) * (N // 8) + g0  # the row step's first counter
        keep_even, keep_odd = row_keep_mask(seed, row_base, t, threshold, BLOCK_N // 8)
        # y * keep * scale as F.dropout (a dropped NaN or inf gives NaN), as in _forward_kernel
        y_even = apply(z_even, ACTIVATION) * tl.where(keep_even, scale, 0.0)
        y_odd = apply(z_odd, ACTIVATION) * tl.where(keep_odd, scale, 0.0)
        y = tl.reshape(tl.join(y_even, y_odd), (BLOCK_N // 8, 8))
        y_ptrs = Y + row.to(tl.int64) * N + out_cols
        if EVEN:
            tl.store(y_ptrs, y.to(Y.dtype.element_ty))
        else:
            tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=(out_cols < N) & ((out_cols * 0 + row) < M))


@triton.jit
def _forward_flat_kernel(
    X,  # input, (M, N) contiguous, 16-bit, 16-byte aligned
    B,  # bias, (N,); unused without HAS_BIAS
    Y,  # output, (M, N) contiguous
    # M * N < 2**31 - BLOCK: int32 offsets. Specialized (% 16 == 0, as N is): the mask is then uniform
    # over 8-element vectors; unspecialized, the loads went scalar, 3.5x slower
    numel,
    N,  # columns, a multiple of 16
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,  # elements a program
):
    """The 16-bit forward without dropout over the flat (M * N,) view, the bias gathered by column:
    32-bit offsets and 1-D loads, as inductor generates it; the same float32 math as _forward_kernel."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # N values, read by every row: kept in L2
        z += tl.load(B + offs % N, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(Y + offs, apply(z, ACTIVATION).to(Y.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch settings

# Forward: 64 bytes a thread, 4 warps (bf16 bias+gelu at 1.03x a copy's time); float32 at 32 elements
# a thread needed 120-136 registers against 48. Backward keeps 8 a thread: with the bias-gradient
# accumulator and the bias in registers, 32 needed 96-223 registers.
FORWARD_BYTES_PER_THREAD, FORWARD_WARPS = 64, 4
BACKWARD_PER_THREAD, BACKWARD_WARPS = 8, 8
MAX_BLOCK_N = 1024
# 16-bit dtypes, the fastest of a sweep (time / one copy; benchmarks/PERF.md): forward with dropout
# 1.31x a copy at rows up to 2048 wide (1.38x at 1024). (bytes or elements a thread, warps, widest
# BLOCK_N) by (backward, dropout):
HALF_SETTINGS = {
    (False, True): (64, 4, 2048),
    (False, False): (32, 4, 2048),
    (True, True): (8, 8, MAX_BLOCK_N),
    (True, False): (16, 4, MAX_BLOCK_N),
}
# 16-bit forward with dropout, rows kernel: 16 elements a thread, rows up to 2048 wide, 8 rows a
# program: 1.12-1.14x a copy vs the tile's 1.31-1.33x
ROWS_KERNEL_ROWS, ROWS_KERNEL_MAX_N, ROWS_KERNEL_PER_THREAD = 8, 2048, 16
# float16 too (each half widens with a conversion instead of a bit move): 1.15x a copy against the
# tile's 1.26x, y bit for bit the tile's
ROWS_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
DECODE_ROWS = 64  # M up to this: one tile holds every row (one launch forward, one backward)
# 16-bit forward without dropout, contiguous x past 2**24 elements: the flat kernel, 2048 elements and
# 4 warps a program (relu 1.007x a copy's time against the tile's 1.064x); up to 2**24 elements the
# tile kernel is as fast or faster.
FLAT_BLOCK, FLAT_WARPS = 2048, 4
FLAT_MIN_ELEMENTS = 2**24  # M * N above this
FLAT_DTYPES = (torch.bfloat16, torch.float16)
DECODE_TILE = 4096
# Backward row-programs loop over rows summing the bias gradient: at most MAX_ROWS_PER_PROGRAM rows
# (float32 partials <= 1/16 byte an element, ~1% of bf16 backward traffic), fewer while the grid would
# fall under MIN_PROGRAMS_PER_SM programs an SM.
MAX_ROWS_PER_PROGRAM = 64
MIN_PROGRAMS_PER_SM = 4
_INT32_LIMIT = 2**31
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr_function in triton 3.6: ~1-2 us a host call


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1  # triton.next_power_of_2 costs as triton.cdiv


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int


@functools.lru_cache(maxsize=4096)
def _block_n(n: int, top: int) -> int:
    """The widest of top, top/2, top/4 (>= 8) whose padding wastes <= 1/16 of a row, else the least
    wasteful (N = 768 -> 256, 11008 -> 1024, 4096 -> 1024). Cached: the rows kernel asks every call."""
    top = max(8, min(top, _next_power_of_2(n)))
    options = [b for b in (top, top // 2, top // 4) if b >= 8]
    waste = {b: _cdiv(n, b) * b - n for b in options}
    fitting = [b for b in options if 16 * waste[b] <= n]
    return fitting[0] if fitting else min(options, key=lambda b: (waste[b], -b))


@functools.lru_cache(maxsize=4096)
def config(m: int, n: int, itemsize: int, backward: bool = False, dropout: bool = True) -> Config:
    """Tile of the (M, N) view: decode shapes get every row in one tile, others a fixed tile size."""
    max_block_n = MAX_BLOCK_N
    if itemsize == 2:
        per_thread, warps, max_block_n = HALF_SETTINGS[(backward, dropout)]
        if not backward:
            per_thread //= itemsize
    elif backward:
        per_thread, warps = BACKWARD_PER_THREAD, BACKWARD_WARPS
    else:
        per_thread, warps = FORWARD_BYTES_PER_THREAD // itemsize, FORWARD_WARPS
    if m <= DECODE_ROWS:
        block_m = _next_power_of_2(max(m, 1))
        block_n = _block_n(n, min(MAX_BLOCK_N, max(8, DECODE_TILE // block_m)))
        per_thread = 8  # latency-bound: spread the few elements over more threads
    else:
        block_n = _block_n(n, max_block_n)
        block_m = min(max(1, per_thread * warps * 32 // block_n), _next_power_of_2(m))
    num_warps = min(8, max(1, block_m * block_n // (32 * per_thread)))
    return Config(block_m, block_n, num_warps)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the CPU interpreter: few programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows_per_program(m: int, cfg: Config, col_programs: int, x: Tensor) -> int:
    """Rows one backward program sums for the bias gradient: a multiple of BLOCK_M, all of them for
    decode shapes (then grad_bias is written directly, no second kernel)."""
    if m <= DECODE_ROWS:
        return cfg.block_m
    row_blocks = _cdiv(m, cfg.block_m)
    spare = row_blocks * col_programs // (MIN_PROGRAMS_PER_SM * _sm_count(x.device))
    return cfg.block_m * min(max(1, spare), max(1, MAX_ROWS_PER_PROGRAM // cfg.block_m))


def _wide(n: int, *col_strides: int) -> bool:
    return (n - 1) * max(col_strides) >= _INT32_LIMIT


# ----------------------------------------------------------------------------- launchers

_FORWARD = Launcher(_forward_kernel, tensors=4)
_FORWARD_ROWS = Launcher(_forward_rows_kernel, tensors=4)
_FORWARD_FLAT = Launcher(_forward_flat_kernel, tensors=3)
_BACKWARD = Launcher(_backward_kernel, tensors=6)
_BIAS_GRAD = Launcher(_bias_grad_kernel, tensors=2)


def _check(x: Tensor, bias: Optional[Tensor]) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be a 2-D (M, N) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32 for triton, got {x.dtype}")
    if bias is not None and (
        bias.shape != (x.shape[1],)
        or bias.dtype != x.dtype
        or bias.is_cuda != x.is_cuda
        or bias.get_device() != x.get_device()  # ints: x.device would build a torch.device, ~1 us
    ):
        raise ValueError(
            f"bias must be a ({x.shape[1]},) {x.dtype} tensor on {x.device}, got "
            f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )


def _word(v: int) -> int:
    """The low 32 bits of v as a signed int32 (Triton then types the argument i32 whatever v is)."""
    return ((v & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def _dropout_args(x: Tensor, p: float, rng: Optional[Rng]) -> tuple[tuple, bool]:
    """(RNG, seed_lo, seed_hi, offset_lo, offset_hi, threshold, scale) and RNG_ON_DEVICE."""
    if rng is None:
        return (x, 0, 0, 0, 0, 0, 1.0), False
    threshold, scale = dropout_rng.threshold(p), dropout_rng.keep_scale(p)
    if isinstance(rng, Tensor):
        return (rng, 0, 0, 0, 0, threshold, scale), True
    seed, offset = rng
    return (x, _word(seed), _word(seed >> 32), _word(offset), _word(offset >> 32), threshold, scale), False


def _rows_kernel_fits(x: Tensor, bias: Optional[Tensor], rng: Optional[Rng], m: int, n: int) -> bool:
    """16-bit (``ROWS_KERNEL_DTYPES``) with dropout past decode sizes, rows of whole 8-element groups
    readable as aligned 32-bit words."""
    return (
        rng is not None
        and x.dtype in ROWS_KERNEL_DTYPES
        and m > DECODE_ROWS
        and n % 8 == 0
        and x.stride(1) == 1
        and x.stride(0) % 2 == 0
        and x.data_ptr() % 4 == 0
        and (bias is None or bias.data_ptr() % 4 == 0)
    )


def _flat_kernel_fits(x: Tensor, rng: Optional[Rng], m: int, n: int) -> bool:
    """16-bit without dropout, more than FLAT_MIN_ELEMENTS (past decode sizes), x contiguous and
    16-byte aligned with rows of whole 16-element groups (so 8-element vectors never straddle the
    mask), every offset (up to M * N rounded up to FLAT_BLOCK) an int32."""
    return (
        rng is None
        and x.dtype in FLAT_DTYPES
        and m > DECODE_ROWS
        and n % 16 == 0
        and FLAT_MIN_ELEMENTS < m * n <= _INT32_LIMIT - FLAT_BLOCK
        and x.data_ptr() % 16 == 0
        and x.is_contiguous()
    )


def forward(x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]) -> Tensor:
    """y = dropout(act(x + bias)) in one pass; x (M, N) with any strides, y contiguous in x's dtype."""
    _check(x, bias)
    return _forward(x, bias, activation, p, rng)


def _forward(x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]) -> Tensor:
    """``forward`` on arguments the caller validated (``KERNELS``)."""
    m, n = x.shape
    y = x.new_empty((m, n))  # contiguous; new_empty builds no torch.device
    if m == 0 or n == 0:
        return y
    if _flat_kernel_fits(x, rng, m, n):
        _FORWARD_FLAT(
            (_cdiv(m * n, FLAT_BLOCK),),
            (x, x if bias is None else bias, y, m * n, n),
            dict(ACTIVATION=activation, HAS_BIAS=bias is not None, BLOCK=FLAT_BLOCK),
            num_warps=FLAT_WARPS,
        )
        return y
    (rng_t, s0, s1, o0, o1, threshold, scale), on_device = _dropout_args(x, p, rng)
    if _rows_kernel_fits(x, bias, rng, m, n):
        block_n = _block_n(n, ROWS_KERNEL_MAX_N)
        _FORWARD_ROWS(
            (_cdiv(m, ROWS_KERNEL_ROWS), _cdiv(n, block_n)),
            (x, x if bias is None else bias, y, rng_t, s0, s1, o0, o1, m, n, x.stride(0), threshold, scale),
            dict(
                ACTIVATION=activation,
                HAS_BIAS=bias is not None,
                RNG_ON_DEVICE=on_device,
                EVEN=m % ROWS_KERNEL_ROWS == 0 and n % block_n == 0,
                BLOCK_N=block_n,
                ROWS=ROWS_KERNEL_ROWS,
            ),
            num_warps=max(1, min(4, block_n // (32 * ROWS_KERNEL_PER_THREAD))),
        )
        return y
    cfg = config(m, n, x.element_size(), dropout=rng is not None)
    _FORWARD(
        (_cdiv(m, cfg.block_m), _cdiv(n, cfg.block_n)),
        (
            x, x if bias is None else bias, y, rng_t, s0, s1, o0, o1,
            m, n, x.stride(0), x.stride(1), threshold, scale,
        ),  # fmt: skip
        dict(
            ACTIVATION=activation,
            HAS_BIAS=bias is not None,
            DROPOUT=rng is not None,
            RNG_ON_DEVICE=on_device,
            GROUPED=n % 8 == 0,
            WIDE=_wide(n, x.stride(1)),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
        ),
        num_warps=cfg.num_warps,
    )
    return y


def backward(grad_y: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng],
        need_x: bool, need_bias: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """grad_x = grad_y * keep * scale * act'(x + bias) and grad_bias = its column sums, in one pass
    over (M, N) plus, when several row-programs share a column, a small deterministic reduction."""
    _check(x, bias)
    if grad_y.shape != x.shape:
        raise ValueError(f"grad_y must have x's shape {tuple(x.shape)}, got {tuple(grad_y.shape)}")
    return backward_pass(grad_y, x, bias, activation, p, rng, need_x, need_bias and bias is not None)


def backward_pass(
    grad_y: Tensor,
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Rng],
    need_x: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The backward kernel: grad_x and, if ``need_bias``, the column sums of grad_x in x's dtype, with
    or without a bias (fused_linear's backward sums grad_pre for its grad_b with the bias already in
    the saved pre-activation)."""
    m, n = x.shape
    grad_x = x.new_empty((m, n)) if need_x else None
    if not need_bias:
        if not need_x or m == 0 or n == 0:
            return grad_x, None
    elif m == 0 or n == 0:
        return grad_x, x.new_zeros((n,))
    cfg = config(m, n, x.element_size(), backward=True, dropout=rng is not None)
    col_programs = _cdiv(n, cfg.block_n)
    rows_per_program = _rows_per_program(m, cfg, col_programs, x) if need_bias else cfg.block_m
    row_programs = _cdiv(m, rows_per_program)
    grad_bias = partials = None
    if need_bias:
        grad_bias = x.new_empty((n,))
        if row_programs > 1:
            partials = torch.empty((row_programs, n), dtype=torch.float32, device=x.device)
    (rng_t, s0, s1, o0, o1, threshold, scale), on_device = _dropout_args(x, p, rng)
    sgy, sx = grad_y.stride(), x.stride()
    _BACKWARD(
        (row_programs, col_programs),
        (
            grad_y,
            x,
            x if bias is None else bias,
            x if grad_x is None else grad_x,
            x if grad_bias is None else (grad_bias if partials is None else partials),
            rng_t, s0, s1, o0, o1,
            m, n, rows_per_program, sgy[0], sgy[1], sx[0], sx[1], threshold, scale,
        ),  # fmt: skip
        dict(
            ACTIVATION=activation,
            HAS_BIAS=bias is not None,
            DROPOUT=rng is not None,
            RNG_ON_DEVICE=on_device,
            GROUPED=n % 8 == 0,
            WIDE=_wide(n, sx[1], sgy[1]),
            NEED_X=need_x,
            NEED_BIAS=need_bias,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
        ),
        num_warps=cfg.num_warps,
    )
    if partials is not None:
        sum_partials(partials, grad_bias)
    return grad_x, grad_bias


def sum_partials(partials: Tensor, out: Tensor) -> None:
    """out (N,) <- the column sums of float32 partials (R, N), rows added in a fixed order (the passes'
    and the MLP epilogues' bias gradients): 32 columns (128 B rows) a program, N / 32 programs."""
    rows, n = partials.shape
    _BIAS_GRAD((_cdiv(n, 32),), (partials, out, rows, n), dict(BLOCK_R=64, BLOCK_N=32), num_warps=4)


# The dispatcher's kernels skip this module's own argument checks: the spec validated the call, and
# the checks cost ~1.2-1.7 us of host time a call.
KERNELS = Kernels(forward=_forward, backward=backward_pass, inference=_forward)
