"""fused_mlp's hidden-layer work in the epilogues of its products (``fused_mlp.py``'s "epilogues"
variant): the pointwise passes between the two GEMMs disappear into them.

    up     C = A @ W^T (+ b), W (N, K); for a gate a second accumulator C_up = A @ W_up^T (+ b_up)
           over the same A tiles (one read of x for both halves). Epilogue: pre = round(C + b) stored
           when asked ((M, N), or (M, 2N) [gate | up]), a = drop(act(pre)), or drop(act(gate) * up),
           stored (M, N). With identity and no pre it is the down projection's bias + output dropout.
    grad   grad_a = G @ W_out, W_out (K, N) = (H_out, F). Epilogue: reads pre, regenerates the hidden
           mask, writes grad_pre = drop'(grad_a) * act'(pre) (both halves for a gate), a as ``up`` made
           it (for grad_W_out) and float32 column sums of grad_pre over the tile's rows, one row of
           partials per row tile, added in a fixed order by bias_act_dropout's reduction.

Against cuBLAS plus one pass each way, at (M, F) = 8192 x 3072 bf16 this skips reading pre in the
forward (50 MB) and writing then reading grad_a in the backward (100 MB): ~37 us of traffic at 4 TB/s,
if the Triton products keep cuBLAS's pace (benchmarks/PERF.md).

pre is rounded to its dtype before the activation, as the product's output would be, so a here, the
pass's a and the backward's recomputed a are one value. Masks are the RNG spec's over the (M, N)
view, computed in bias_act_dropout's (BLOCK_M, BLOCK_N // 8, 8) layout (one Philox call per 8
elements) and reshaped onto the tile. Main loop: matmul.py's ``tile_product`` in either of its
variants ("tma": host TensorDescriptors; "pointer": strided loads, any dtype and layout), here both
persistent.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dispatch.backends.triton import bias_act_dropout, matmul
from dispatch.backends.triton.activations import apply
from dispatch.backends.triton.mlp_hidden import hidden_grads
from dispatch.backends.triton.launch import Launcher
from dispatch.backends.triton.matmul import _tile_coords, tile_product
from dispatch.backends.triton.philox import keep_mask, seed_offset
from dispatch.contracts.rng import Rng


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A (BLOCK_M, BLOCK_N) tile's left and right (BLOCK_M, BLOCK_N / 2) column halves."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _drop_scale(seed, offset, rows, off_n, N, threshold, scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPED: tl.constexpr):  # fmt: skip
    """(BLOCK_M, BLOCK_N) keep * scale of the spec's mask over the (M, N) view: scale or 0."""
    groups = off_n // 8 + tl.arange(0, BLOCK_N // 8)
    keep = keep_mask(seed, offset, rows, groups, tl.arange(0, 8), N, threshold, GROUPED)
    return tl.where(tl.reshape(keep, (BLOCK_M, BLOCK_N)), scale, 0.0)  # 1 B an element reshaped


@triton.jit
def _up_epilogue(
    acc,  # (BLOCK_M, BLOCK_N) float32 product x @ W^T of the tile (the gate's with GATED)
    acc_up,  # the up projection's, with GATED
    pid_m,  # the tile's row block
    off_n,  # its first column
    M,
    N,
    PRE,
    OUT,
    BIAS,
    BIAS_UP,
    stride_pm,
    stride_om,
    seed,  # the mask's Philox key and first counter, with DROPOUT
    offset,
    threshold,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # this epilogue's columns: the tile's, or half of them
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,
    DROPOUT: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """``_up_kernel``'s epilogue on (BLOCK_M, BLOCK_N) columns from ``off_n``: pre stored, a written."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    in_n = cols < N
    mask = (rows < M)[:, None] & in_n[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
    z = acc.to(OUT.dtype.element_ty)  # pre, rounded once as the product's output
    pre_ptrs = PRE + (rows64 * stride_pm)[:, None] + cols[None, :]
    if STORE_PRE:
        tl.store(pre_ptrs, z, mask=mask)
    if GATED:
        if HAS_BIAS:
            acc_up += tl.load(BIAS_UP + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
        up = acc_up.to(OUT.dtype.element_ty)
        if STORE_PRE:
            tl.store(pre_ptrs + N, up, mask=mask)
        a = apply(z.to(tl.float32), ACTIVATION) * up.to(tl.float32)
    else:
        a = apply(z.to(tl.float32), ACTIVATION)
    if DROPOUT:  # a * keep * scale as F.dropout: a dropped NaN or inf gives NaN
        a = a * _drop_scale(seed, offset, rows, off_n, N, threshold, scale, BLOCK_M, BLOCK_N, GROUPED)
    out_ptrs = OUT + (rows64 * stride_om)[:, None] + cols[None, :]
    tl.store(out_ptrs, a.to(OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _up_kernel(
    A,  # (M, K) x: descriptor with USE_TMA, else pointer
    B,  # (K, N) W^T (the gate's for GATED), likewise
    B_UP,  # (K, N) W_up^T with GATED (else B again)
    PRE,  # (M, N), or (M, 2N) [gate | up] with GATED, unit column stride: written with STORE_PRE
    OUT,  # (M, N) a, unit column stride
    BIAS,  # (N,) b, read with HAS_BIAS
    BIAS_UP,  # (N,) b_up, read with GATED and HAS_BIAS
    RNG,  # int64 [seed, offset] with RNG_ON_DEVICE; unused without DROPOUT
    seed_lo,  # int32 words of a host (seed, offset), without RNG_ON_DEVICE
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows of x and a
    N,  # columns of a: hidden features
    K,  # x's columns: the reduction
    stride_am,  # x's strides (pointer loads; 0 with USE_TMA)
    stride_ak,
    stride_bk,  # W^T's strides, W_up^T's too (pointer loads; 0 with USE_TMA)
    stride_bn,
    stride_pm,  # PRE's row stride
    stride_om,  # OUT's row stride
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,  # persistent programs: SMs x CTAs per SM
    USE_TMA: tl.constexpr,  # A, B, B_UP are TMA descriptors
    A_KMAJOR: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    ACTIVATION: tl.constexpr,  # the activation, the gate's with GATED
    GATED: tl.constexpr,  # a = act(gate) * up from two accumulators
    HAS_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,  # write the rounded products for backward
    DROPOUT: tl.constexpr,
    RNG_ON_DEVICE: tl.constexpr,
    GROUPED: tl.constexpr,  # N % 8 == 0: one Philox call per 8 elements of a row
    INPUT_PRECISION: tl.constexpr,  # tl.dot's: "ieee" or "tf32" (float32 only)
    INDEX_64: tl.constexpr,  # some tensor has >= 2**31 elements: 64-bit offsets
    DOT_FP32: tl.constexpr,  # CPU interpreter + bfloat16: upcast before tl.dot
    WARP_SPECIALIZE: tl.constexpr,  # tl.range's warp specialization of the tile loop (Config)
    EPILOGUE_SPLIT: tl.constexpr,  # 1, or 2: the epilogue runs on each half of the tile's columns
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    seed, offset = 0, 0  # the mask's (seed, offset) with DROPOUT
    if DROPOUT:
        seed, offset = seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
    tile_c = tl.program_id(0) - NUM_PROGRAMS  # the epilogue's own counter, as matmul.py's
    for tile_id in tl.range(
        tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc, acc_up = tile_product(
            A, B, B_UP, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M,
            BLOCK_N, BLOCK_K, USE_TMA, A_KMAJOR, B_KMAJOR, GATED, INPUT_PRECISION, INDEX_64, DOT_FP32,
        )  # fmt: skip
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        if EPILOGUE_SPLIT == 2:  # two (BLOCK_M, BLOCK_N / 2) epilogues: half the live registers
            acc_lo, acc_hi = _halves(acc, BLOCK_M, BLOCK_N)
            up_lo, up_hi = _halves(acc_up, BLOCK_M, BLOCK_N)
            _up_epilogue(
                acc_lo, up_lo, pid_m, pid_n * BLOCK_N, M, N, PRE, OUT, BIAS, BIAS_UP, stride_pm, stride_om,
                seed, offset, threshold, scale, BLOCK_M, BLOCK_N // 2, ACTIVATION, GATED, HAS_BIAS,
                STORE_PRE, DROPOUT, GROUPED,
            )  # fmt: skip
            _up_epilogue(
                acc_hi, up_hi, pid_m, pid_n * BLOCK_N + BLOCK_N // 2, M, N, PRE, OUT, BIAS, BIAS_UP,
                stride_pm, stride_om, seed, offset, threshold, scale, BLOCK_M, BLOCK_N // 2, ACTIVATION,
                GATED, HAS_BIAS, STORE_PRE, DROPOUT, GROUPED,
            )  # fmt: skip
        else:
            _up_epilogue(
                acc, acc_up, pid_m, pid_n * BLOCK_N, M, N, PRE, OUT, BIAS, BIAS_UP, stride_pm, stride_om,
                seed, offset, threshold, scale, BLOCK_M, BLOCK_N, ACTIVATION, GATED, HAS_BIAS, STORE_PRE,
                DROPOUT, GROUPED,
            )  # fmt: skip


@triton.jit
def _grad_epilogue(
    g,  # (BLOCK_M, BLOCK_N) float32 grad_a = G @ W_out of the tile
    pid_m,  # the tile's row block
    off_n,  # its first column
    M,
    N,
    PRE,
    GP,
    A_OUT,
    PARTIALS,
    stride_pm,
    seed,  # the mask's Philox key and first counter, with DROPOUT
    offset,
    threshold,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # this epilogue's columns: the tile's, or half of them
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    NEED_PRE: tl.constexpr,
    NEED_A: tl.constexpr,
    NEED_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """``_grad_kernel``'s epilogue on (BLOCK_M, BLOCK_N) columns from ``off_n``."""
    if GATED:
        P = 2 * N
    else:
        P = N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    in_n = cols < N
    mask = (rows < M)[:, None] & in_n[None, :]
    pre_ptrs = PRE + (rows64 * stride_pm)[:, None] + cols[None, :]
    z = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
    drop = g  # keep * scale with DROPOUT (unused otherwise)
    if DROPOUT:
        drop = _drop_scale(seed, offset, rows, off_n, N, threshold, scale, BLOCK_M, BLOCK_N, GROUPED)
    up = z  # the up half with GATED (unused otherwise)
    if GATED:
        up = tl.load(pre_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    gz, gu, a = hidden_grads(g, z, up, drop, ACTIVATION, GATED, DROPOUT, NEED_A)
    if NEED_A:
        a_ptrs = A_OUT + (rows64 * N)[:, None] + cols[None, :]
        tl.store(a_ptrs, a.to(A_OUT.dtype.element_ty), mask=mask)
    if NEED_PRE:
        gp_ptrs = GP + (rows64 * P)[:, None] + cols[None, :]
        tl.store(gp_ptrs, gz.to(GP.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(gp_ptrs + N, gu.to(GP.dtype.element_ty), mask=mask)
    if NEED_BIAS:  # selected, not trusted to be 0: squared_relu'(3e38) * 0 = inf * 0 = NaN
        sums_ptrs = PARTIALS + pid_m.to(tl.int64) * P + cols
        tl.store(sums_ptrs, tl.sum(tl.where(mask, gz, 0.0), axis=0), mask=in_n)
        if GATED:
            tl.store(sums_ptrs + N, tl.sum(tl.where(mask, gu, 0.0), axis=0), mask=in_n)


@triton.jit(do_not_specialize=["M", "threshold", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _grad_kernel(
    A,  # (M, K) G, the gradient of the down projection's output: descriptor with USE_TMA, else pointer
    B,  # (K, N) W_out, likewise
    PRE,  # (M, N), or (M, 2N) [gate | up] with GATED; row stride stride_pm, unit column stride
    GP,  # grad_pre, PRE's shape, contiguous: written with NEED_PRE
    A_OUT,  # (M, N) a as ``_up_kernel`` made it, contiguous: written with NEED_A
    PARTIALS,  # (row tiles, P) float32 column sums of grad_pre: written with NEED_BIAS
    RNG,  # int64 [seed, offset] with RNG_ON_DEVICE; unused without DROPOUT
    seed_lo,  # int32 words of a host (seed, offset), without RNG_ON_DEVICE
    seed_hi,
    offset_lo,
    offset_hi,
    M,  # rows of G, pre, grad_pre and a
    N,  # hidden features F; P = 2N columns of PRE with GATED, else N
    K,  # G's columns: the reduction (H_out)
    stride_am,  # G's strides (pointer loads; 0 with USE_TMA)
    stride_ak,
    stride_bk,  # W_out's strides (pointer loads; 0 with USE_TMA)
    stride_bn,
    stride_pm,  # PRE's row stride
    threshold,  # 16-bit drop threshold T
    scale,  # float32 65536 / (65536 - T)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,  # persistent programs: SMs x CTAs per SM
    USE_TMA: tl.constexpr,  # A, B are TMA descriptors
    A_KMAJOR: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    ACTIVATION: tl.constexpr,  # the activation, the gate's with GATED
    GATED: tl.constexpr,  # grad_gate = g * up * act'(gate), grad_up = g * act(gate)
    NEED_PRE: tl.constexpr,  # write grad_pre
    NEED_A: tl.constexpr,  # write a
    NEED_BIAS: tl.constexpr,  # write grad_pre's column sums over each row tile
    DROPOUT: tl.constexpr,
    RNG_ON_DEVICE: tl.constexpr,
    GROUPED: tl.constexpr,  # N % 8 == 0: one Philox call per 8 elements of a row
    INPUT_PRECISION: tl.constexpr,  # tl.dot's: "ieee" or "tf32" (float32 only)
    INDEX_64: tl.constexpr,  # some tensor has >= 2**31 elements: 64-bit offsets
    DOT_FP32: tl.constexpr,  # CPU interpreter + bfloat16: upcast before tl.dot
    WARP_SPECIALIZE: tl.constexpr,  # tl.range's warp specialization of the tile loop (Config)
    EPILOGUE_SPLIT: tl.constexpr,  # 1, or 2: the epilogue runs on each half of the tile's columns
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    seed, offset = 0, 0  # the mask's (seed, offset) with DROPOUT
    if DROPOUT:
        seed, offset = seed_offset(RNG, seed_lo, seed_hi, offset_lo, offset_hi, RNG_ON_DEVICE)
    tile_c = tl.program_id(0) - NUM_PROGRAMS  # the epilogue's own counter, as matmul.py's
    for tile_id in tl.range(
        tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        g, _unused = tile_product(
            A, B, B, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M,
            BLOCK_N, BLOCK_K, USE_TMA, A_KMAJOR, B_KMAJOR, False, INPUT_PRECISION, INDEX_64, DOT_FP32,
        )  # fmt: skip
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        if EPILOGUE_SPLIT == 2:  # two (BLOCK_M, BLOCK_N / 2) epilogues: half the live registers
            g_lo, g_hi = _halves(g, BLOCK_M, BLOCK_N)
            _grad_epilogue(
                g_lo, pid_m, pid_n * BLOCK_N, M, N, PRE, GP, A_OUT, PARTIALS, stride_pm, seed, offset,
                threshold, scale, BLOCK_M, BLOCK_N // 2, ACTIVATION, GATED, NEED_PRE, NEED_A, NEED_BIAS,
                DROPOUT, GROUPED,
            )  # fmt: skip
            _grad_epilogue(
                g_hi, pid_m, pid_n * BLOCK_N + BLOCK_N // 2, M, N, PRE, GP, A_OUT, PARTIALS, stride_pm, seed,
                offset, threshold, scale, BLOCK_M, BLOCK_N // 2, ACTIVATION, GATED, NEED_PRE, NEED_A,
                NEED_BIAS, DROPOUT, GROUPED,
            )  # fmt: skip
        else:
            _grad_epilogue(
                g, pid_m, pid_n * BLOCK_N, M, N, PRE, GP, A_OUT, PARTIALS, stride_pm, seed, offset, threshold,
                scale, BLOCK_M, BLOCK_N, ACTIVATION, GATED, NEED_PRE, NEED_A, NEED_BIAS, DROPOUT, GROUPED,
            )  # fmt: skip


# ----------------------------------------------------------------------------- launchers

# One kernel, two launchers each: A, B, B_UP as TMA descriptors or as tensors.
_UP_TMA = Launcher(_up_kernel, descriptors=3, tensors=5)
_UP_POINTER = Launcher(_up_kernel, tensors=8)
_GRAD_TMA = Launcher(_grad_kernel, descriptors=2, tensors=5)
_GRAD_POINTER = Launcher(_grad_kernel, tensors=7)
# Tiles by epilogue (sm_90 builds, triton 3.9's ptxas, bf16, TMA; benchmarks/aot_sm90.py; registers a
# thread at most 255):
#   "heavy"  a gate's two accumulators, a dropout mask, or grad's loads of pre: 128 x 128 x 8 warps
#            spilled 392-2640 B a thread, 128 x 64 and 64 x 128 x 8 warps (32 accumulator elements a
#            thread) 0-256 B: the only tiles here.
#   "light"  an activation, pre stored or not: matmul.py's table without its 128 x 256 entry (920 B
#            spilled even without pre; 128 x 128 x 8 warps: 138 registers, 187 storing pre).
HEAVY_CONFIGS_16 = (
    matmul.Config(128, 64, 64, num_warps=8, num_stages=4),
    matmul.Config(64, 128, 64, num_warps=8, num_stages=4),
)
HEAVY_CONFIGS_32 = (
    matmul.Config(128, 64, 32, num_warps=8, num_stages=3),
    matmul.Config(64, 128, 32, num_warps=8, num_stages=3),
)
LIGHT_BLOCK_N = 128


def _config(m: int, n: int, k: int, a: Tensor, heavy: bool) -> matmul.Config:
    """The tile for a heavy or light epilogue (above) on the GPU; the interpreter's, or the one
    matmul.options forces, elsewhere."""
    if a.device.type != "cuda" or matmul._override.config is not None:
        return matmul.pick_config(m, n, k, a.dtype, a.device)
    fp32 = a.dtype == torch.float32
    if heavy:
        table = HEAVY_CONFIGS_32 if fp32 else HEAVY_CONFIGS_16
    else:  # every table has entries of at most 128 columns
        table = tuple(
            c for c in (matmul.CONFIGS_32 if fp32 else matmul.CONFIGS_16) if c.block_n <= LIGHT_BLOCK_N
        )
    return matmul.best_config(m, n, table, matmul._sm_count(a.device))


def _operands(a: Tensor, bs: tuple[Tensor, ...], cfg: matmul.Config) -> tuple[tuple, dict, bool]:
    """(A, B[, B_UP]) as descriptors or tensors, their constexprs, and whether TMA runs. ``bs`` are
    (K, N) views sharing one layout; TMA only when every operand allows it (matmul.plan's rule)."""
    _, variant, (a_kmajor, b_kmajor) = matmul.plan(a, bs[0])
    tma = variant == "tma" and all(matmul._tma_layout(b, 0) == b_kmajor for b in bs[1:])
    if not tma:
        return (a, *bs), dict(USE_TMA=False, A_KMAJOR=False, B_KMAJOR=False), False
    descs = (
        matmul._descriptor(a, a_kmajor, 1, cfg.block_m, cfg.block_k),
        *(matmul._descriptor(b, b_kmajor, 0, cfg.block_n, cfg.block_k) for b in bs),
    )
    return descs, dict(USE_TMA=True, A_KMAJOR=a_kmajor, B_KMAJOR=b_kmajor), True


def _strides(tma: bool, a: Tensor, b: Tensor) -> tuple[int, int, int, int]:
    """The pointer loads' strides of A and B; zeros under TMA, which reads none (no specialization on
    strides it never uses, no extra compiled variants)."""
    return (0, 0, 0, 0) if tma else (a.stride(0), a.stride(1), b.stride(0), b.stride(1))


def _shared(a: Tensor, bs: tuple[Tensor, ...], outs: tuple[Tensor, ...], cfg: matmul.Config, m: int,
            n: int) -> tuple[dict, int]:  # fmt: skip
    """Both kernels' common constexprs, and the persistent grid's size."""
    extents = [matmul._extent(t.shape, t.stride()) for t in (a, *bs, *outs)]
    programs = matmul._sm_count(a.device) * cfg.ctas_per_sm
    tiles = matmul._cdiv(m, cfg.block_m) * matmul._cdiv(n, cfg.block_n)
    constexprs = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs,
        GROUPED=n % 8 == 0,
        INPUT_PRECISION=matmul._input_precision(a.dtype, a.device),
        INDEX_64=max(extents) >= 2**31,
        DOT_FP32=a.dtype == torch.bfloat16 and a.device.type != "cuda",
        WARP_SPECIALIZE=cfg.warp_specialize,
        EPILOGUE_SPLIT=cfg.epilogue_split,
    )
    return constexprs, min(programs, tiles)


def up(
    x: Tensor,
    w: Tensor,
    w_up: Optional[Tensor],
    b: Optional[Tensor],
    b_up: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Rng],
    out: Tensor,
    pre: Optional[Tensor] = None,
) -> None:
    """out <- drop_p(act(x @ w^T + b)), or drop_p(act(x @ w^T + b) * (x @ w_up^T + b_up)) with w_up
    (``activation`` is then the gate's); pre <- the rounded products ((M, N), or (M, 2N) [gate | up])
    when given. x (M, K) any strides, w / w_up (N, K) of one layout, out (M, N) and pre unit column
    stride; M, N > 0."""
    (m, k), n = x.shape, w.shape[0]
    gated = w_up is not None
    bs = (w.t(), (w if w_up is None else w_up).t())  # B_UP is B again without a gate
    assert not gated or (b is None) == (b_up is None), "internal: a gate's biases come in pairs"
    cfg = _config(m, n, k, x, heavy=gated or rng is not None)
    operands, layout, tma = _operands(x, bs, cfg)
    constexprs, grid = _shared(x, bs, (out,) if pre is None else (out, pre), cfg, m, n)
    (rng_t, s0, s1, o0, o1, threshold, scale), on_device = bias_act_dropout._dropout_args(x, p, rng)
    b_t = bs[0]
    args = (
        *operands, out if pre is None else pre, out,
        out if b is None else b, out if b_up is None else b_up, rng_t, s0, s1, o0, o1, m, n, k,
        *_strides(tma, x, b_t), out.stride(0) if pre is None else pre.stride(0), out.stride(0),
        threshold, scale,
    )  # fmt: skip
    (_UP_TMA if tma else _UP_POINTER)(
        (grid,),
        args,
        dict(
            constexprs,
            **layout,
            ACTIVATION=activation,
            GATED=gated,
            HAS_BIAS=b is not None,
            STORE_PRE=pre is not None,
            DROPOUT=rng is not None,
            RNG_ON_DEVICE=on_device,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def grad_hidden(
    g: Tensor,
    w_out: Tensor,
    pre: Tensor,
    activation: str,
    gated: bool,
    p: float,
    rng: Optional[Rng],
    need_pre: bool,
    need_a: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(grad_pre, a, grad_bias) from one product g @ w_out (g (M, H_out), w_out (H_out, F)) and its
    epilogue: mlp_hidden.backward's three results (``activation`` the gate's with ``gated``), each only if
    asked. pre (M, F) or (M, 2F) with unit column stride; M, F > 0."""
    (m, k), n = g.shape, w_out.shape[1]
    width = pre.shape[1]
    grad_pre = pre.new_empty((m, width)) if need_pre else None
    a = pre.new_empty((m, n)) if need_a else None
    cfg = _config(m, n, k, g, heavy=True)
    operands, layout, tma = _operands(g, (w_out,), cfg)
    partials = None
    if need_bias:
        partials = torch.empty((matmul._cdiv(m, cfg.block_m), width), dtype=torch.float32, device=g.device)
    outs = tuple(t for t in (pre, grad_pre, a) if t is not None)
    constexprs, grid = _shared(g, (w_out,), outs, cfg, m, n)
    (rng_t, s0, s1, o0, o1, threshold, scale), on_device = bias_act_dropout._dropout_args(pre, p, rng)
    args = (
        *operands, pre, pre if grad_pre is None else grad_pre, pre if a is None else a,
        pre if partials is None else partials, rng_t, s0, s1, o0, o1, m, n, k,
        *_strides(tma, g, w_out), pre.stride(0), threshold, scale,
    )  # fmt: skip
    (_GRAD_TMA if tma else _GRAD_POINTER)(
        (grid,),
        args,
        dict(
            constexprs,
            **layout,
            ACTIVATION=activation,
            GATED=gated,
            NEED_PRE=need_pre,
            NEED_A=need_a,
            NEED_BIAS=need_bias,
            DROPOUT=rng is not None,
            RNG_ON_DEVICE=on_device,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grad_bias = None
    if partials is not None:
        grad_bias = pre.new_empty((width,))
        bias_act_dropout.sum_partials(partials, grad_bias)
    return grad_pre, a, grad_bias
