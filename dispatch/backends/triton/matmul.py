"""C = act(A @ B + bias) in Triton: fused_linear's product for calls without autograd (``infer``),
the rule that picks each launch's tiles, and the persistent main loop (``tile_product``, one or two
accumulators) that mlp_gemm.py's epilogue kernels share.

A (M, K) and B (K, N) are views with any strides (x and W^T); C is a new row-major (M, N) tensor;
products accumulate in float32. The epilogue adds the bias (when given) and applies the activation,
so the product is written once, as C. (Training calls run their products on cuBLAS: see
``fused_linear.py``.)

Two main loops feed it ("variants"):

    "pointer"   one program per output tile, grouped tile order, strided tl.load (cp.async feeding
                wgmma on sm_90); any strides, every dtype, and Triton's CPU interpreter.
    "tma"       persistent: one program per SM slot walks tiles in the same order; operands come
                through host TensorDescriptors (TMA). 16-bit dtypes, one unit stride per operand,
                16-byte aligned; anything else falls back to "pointer". The default on sm_90.

Both store C with masked pointer stores. The kernels, tile configs, ``plan`` and ``launch`` live here;
fused_linear's ``launch_forward`` (``fused_linear.py``) calls ``launch``.

Tiles come from a fixed table and a wave-quantisation rule (``pick_config``), so a new token count
never triggers autotuning. float32 follows ``torch.backends.cuda.matmul.allow_tf32`` like F.linear:
"ieee" by default (exact to float32 rounding), "tf32" when the user allows it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from dispatch.backends.triton.activations import apply
from dispatch.backends.triton.launch import Launcher

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4: "tma" falls back to "pointer"
    TensorDescriptor = None


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # grouped order: GROUP_M row tiles sweep each B column strip together while it sits in L2
    per_group = GROUP_M * num_pid_n
    first_m = (tile_id // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % per_group) % rows
    pid_n = (tile_id % per_group) // rows
    return pid_m, pid_n


@triton.jit
def pointer_offsets(off_m, off_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, INDEX_64: tl.constexpr):  # fmt: skip
    """A pointer main loop's row, column and K offsets of the tile at (off_m, off_n) (64-bit with
    INDEX_64), and its (BLOCK_M, 1) row and (1, BLOCK_N) column masks."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    return offs_m, offs_n, offs_k, (offs_m < M)[:, None], (offs_n < N)[None, :]


@triton.jit
def _epilogue(
    acc,  # (BLOCK_M, BLOCK_N) float32 tile of A @ B
    off_m,  # its first row in C
    off_n,  # its first column in C
    M,  # rows of C
    N,  # columns of C
    C,  # (M, N) output
    BIAS,  # (N,) bias (read when HAS_BIAS)
    stride_cm,  # C row stride
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # this epilogue's columns: the tile's, or half of them (EPILOGUE_SPLIT)
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INDEX_64: tl.constexpr,  # some tensor has >= 2**31 elements: 64-bit offsets
):
    """C[tile] <- act(acc + b), rounded to C's dtype."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if INDEX_64:
        offs_m = offs_m.to(tl.int64)
    in_n = offs_n < N
    mask = (offs_m < M)[:, None] & in_n[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    out = apply(acc, ACTIVATION).to(C.dtype.element_ty)
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :], out, mask=mask)


@triton.jit
def _matmul_kernel(
    A,  # (M, K) operand, any strides
    B,  # (K, N) operand, any strides
    C,  # (M, N) output, row-major
    BIAS,  # (N,) bias, or any tensor when HAS_BIAS is False
    M,  # rows of A and C
    N,  # columns of B and C
    K,  # reduction length
    stride_am,  # A strides
    stride_ak,
    stride_bk,  # B strides
    stride_bn,
    stride_cm,  # C row stride
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask in the main loop
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # tl.dot's: "ieee" or "tf32" (float32 only; ignored for 16-bit)
    INDEX_64: tl.constexpr,
    DOT_FP32: tl.constexpr,  # CPU interpreter + bfloat16: its tl.dot multiplies the raw bits, upcast
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m, offs_n, offs_k, in_m, in_n = pointer_offsets(
        pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, BLOCK_M, BLOCK_N, BLOCK_K, INDEX_64
    )
    a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=in_m, other=0.0)
            b = tl.load(b_ptrs, mask=in_n, other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=in_m & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & in_n, other=0.0)
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    _epilogue(
        acc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, C, BIAS, stride_cm, BLOCK_M, BLOCK_N, ACTIVATION,
        HAS_BIAS, INDEX_64,
    )  # fmt: skip


@triton.jit
def tma_load_a(A_DESC, off_m, off_k, A_KMAJOR: tl.constexpr):
    """A's (BLOCK_M, BLOCK_K) tile at (off_m, off_k): from a descriptor over A when A_KMAJOR, else
    over A^T."""
    if A_KMAJOR:
        a = A_DESC.load([off_m, off_k])
    else:
        a = A_DESC.load([off_k, off_m]).T
    return a


@triton.jit
def tma_load_b(B_DESC, off_n, off_k, B_KMAJOR: tl.constexpr):
    """B's (BLOCK_K, BLOCK_N) tile at (off_k, off_n): from a descriptor over B^T when B_KMAJOR, else
    over B."""
    if B_KMAJOR:
        b = B_DESC.load([off_n, off_k]).T
    else:
        b = B_DESC.load([off_k, off_n])
    return b


@triton.jit
def tile_product(
    A, B, B_UP, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
    A_KMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr, GATED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    INDEX_64: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Tile (pid_m, pid_n) of A @ B in float32 and, with GATED, of A @ B_UP over the same A tiles (else
    the first again): the persistent kernels' main loop, here and in mlp_gemm.py. A, B and B_UP are TMA
    descriptors (``_descriptor``'s layouts) with USE_TMA, else pointers with the strides given."""
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for ki in range(tl.cdiv(K, BLOCK_K)):
            off_k = ki * BLOCK_K  # TMA zero-fills past the edges: no masks
            a = tma_load_a(A, off_m, off_k, A_KMAJOR)
            b = tma_load_b(B, off_n, off_k, B_KMAJOR)
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if GATED:
                b_up = tma_load_b(B_UP, off_n, off_k, B_KMAJOR)
                if DOT_FP32:
                    b_up = b_up.to(tl.float32)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=INPUT_PRECISION)
    else:
        offs_m, offs_n, offs_k, in_m, in_n = pointer_offsets(
            off_m, off_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K, INDEX_64
        )
        a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_offsets = offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        for ki in range(tl.cdiv(K, BLOCK_K)):
            k_left = K - ki * BLOCK_K
            in_k = offs_k < k_left
            a = tl.load(a_ptrs, mask=in_m & in_k[None, :], other=0.0)
            b = tl.load(B + b_offsets, mask=in_k[:, None] & in_n, other=0.0)
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if GATED:
                b_up = tl.load(B_UP + b_offsets, mask=in_k[:, None] & in_n, other=0.0)
                if DOT_FP32:
                    b_up = b_up.to(tl.float32)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_offsets += BLOCK_K * stride_bk
    if not GATED:
        acc_up = acc
    return acc, acc_up


@triton.jit
def _matmul_tma_kernel(
    A_DESC,  # descriptor over A (M, K) when A_KMAJOR, else over A^T (K, M)
    B_DESC,  # descriptor over B^T (N, K) when B_KMAJOR, else over B (K, N)
    C,  # (M, N) output, row-major
    BIAS,  # (N,) bias, or any tensor when HAS_BIAS is False
    M,  # rows of C
    N,  # columns of C
    K,  # reduction length
    stride_cm,  # C row stride
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,  # persistent programs: SMs x CTAs per SM (fixed per device)
    A_KMAJOR: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INDEX_64: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,  # tl.range's warp specialization of the tile loop (Config)
    EPILOGUE_SPLIT: tl.constexpr,  # 1, or 2: the epilogue runs on each half of the tile's columns
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    start = tl.program_id(0)
    # the epilogue keeps its own tile counter so that it does not depend on the loop's (tutorial 09)
    tile_c = start - NUM_PROGRAMS
    for tile_id in tl.range(start, num_pid_m * num_pid_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc, _ = tile_product(
            A_DESC, B_DESC, B_DESC, pid_m, pid_n, M, N, K, 0, 0, 0, 0, BLOCK_M, BLOCK_N, BLOCK_K, True,
            A_KMAJOR, B_KMAJOR, False, INPUT_PRECISION, INDEX_64, DOT_FP32,
        )  # fmt: skip
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        if EPILOGUE_SPLIT == 2:
            # two (BLOCK_M, BLOCK_N / 2) epilogues: half the live registers for the activation's math
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc_lo, acc_hi = tl.split(halves)
            _epilogue(
                acc_lo, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, C, BIAS, stride_cm, BLOCK_M, BLOCK_N // 2,
                ACTIVATION, HAS_BIAS, INDEX_64,
            )  # fmt: skip
            _epilogue(
                acc_hi, pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2, M, N, C, BIAS, stride_cm, BLOCK_M,
                BLOCK_N // 2, ACTIVATION, HAS_BIAS, INDEX_64,
            )  # fmt: skip
        else:
            tl.static_assert(EPILOGUE_SPLIT == 1, "EPILOGUE_SPLIT is 1 or 2")
            _epilogue(
                acc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, C, BIAS, stride_cm, BLOCK_M, BLOCK_N,
                ACTIVATION, HAS_BIAS, INDEX_64,
            )  # fmt: skip


# ----------------------------------------------------------------------------- tile configs


@dataclass(frozen=True)
class Config:
    """One launch configuration and what the picking rule assumes about it."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1  # resident programs per SM (shared memory allows)
    efficiency: float = 1.0  # throughput of a full SM relative to the largest tile (a guess until benched)
    group_m: int = 8
    warp_specialize: bool = False  # "tma": tl.range(warp_specialize=True) over the tiles
    epilogue_split: int = 1  # "tma": 2 runs the epilogue on each half of the tile's columns

    def __str__(self) -> str:
        extra = f"/c{self.ctas_per_sm}" if self.ctas_per_sm > 1 else ""
        extra += "/ws" if self.warp_specialize else ""
        extra += f"/e{self.epilogue_split}" if self.epilogue_split > 1 else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}{extra}"


# 16-bit, sm_80/sm_90. Shared memory = stages * (BM + BN) * BK * 2 bytes: 144 KiB, 128 KiB, 96 KiB.
# 128x256x64/8 warps/3 stages is the Triton tutorials' Hopper config (two warpgroups of 64x256 wgmma).
# Every entry pipelines cp.async into async wgmma on sm_90, no spills in the main loop.
CONFIGS_16 = (
    Config(128, 256, 64, num_warps=8, num_stages=3, efficiency=1.0),
    Config(128, 128, 64, num_warps=8, num_stages=4, efficiency=0.93),
    Config(64, 128, 64, num_warps=4, num_stages=4, ctas_per_sm=2, efficiency=0.8),
)
# float32 ("ieee" runs on FMA units, "tf32" on tensor cores): half the K depth for the same bytes.
CONFIGS_32 = (
    Config(128, 128, 32, num_warps=8, num_stages=3, efficiency=1.0),
    Config(64, 64, 32, num_warps=4, num_stages=3, ctas_per_sm=2, efficiency=0.8),
)
# CPU interpreter: tiny tiles so the tests' odd shapes cross tile, group and K-block edges.
CONFIG_INTERPRETER = Config(32, 16, 16, num_warps=1, num_stages=1, group_m=2)
INTERPRETER_SMS = 3  # persistent programs under the interpreter: each walks several tiles


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pick_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> Config:
    """The config for C (M, N) = A (M, K) @ B: forced by ``options``, the interpreter's, or the rule's."""
    if _override.config is not None:
        return _override.config
    if device.type != "cuda":
        return CONFIG_INTERPRETER
    return _cached_config(M, N, dtype == torch.float32, _sm_count(device))


@functools.lru_cache(maxsize=4096)
def _cached_config(M: int, N: int, fp32: bool, sms: int) -> Config:
    return best_config(M, N, CONFIGS_32 if fp32 else CONFIGS_16, sms)


def best_config(M: int, N: int, table: tuple[Config, ...], sms: int) -> Config:
    """The table entry with the least estimated time: waves x work of the busiest SM / efficiency.

    A wave is one tile per resident program on every SM; a last, partly filled wave costs a full one
    (e.g. 2048 x 3072: 128x256 tiles give 192 tiles = 1.45 waves on 132 SMs, 128x128 give 384 = 2.9).
    Depends on the shape only through tile counts: no autotuning, no recompilation for a new M.
    """

    def cost(c: Config) -> float:
        tiles = _cdiv(M, c.block_m) * _cdiv(N, c.block_n)
        slots = sms * c.ctas_per_sm
        per_sm = _cdiv(min(tiles, slots), sms)  # programs sharing the busiest SM
        return _cdiv(tiles, slots) * per_sm * c.block_m * c.block_n / c.efficiency

    return min(table, key=cost)  # ties keep the larger tile (listed first)


# ----------------------------------------------------------------------------- variants

VARIANTS = ("pointer", "tma")
# tma: 1.09 ms against pointer's 1.57 and torch.mm's 1.04 (llama-2-7b up, bf16 gelu_tanh, M=8192).
# Flattened tile and K loops and TMA stores in the epilogue lost or were mixed: neither is built.
DEFAULT_VARIANT = "tma"


@dataclass
class _Override:
    variant: Optional[str] = None
    config: Optional[Config] = None


_override = _Override()


@contextlib.contextmanager
def options(variant: Optional[str] = None, config: Optional[Config] = None) -> Iterator[None]:
    """Forces a main-loop variant and/or a tile config inside the block (benchmarks, tests)."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    saved = _Override(_override.variant, _override.config)
    _override.variant, _override.config = variant, config
    try:
        yield
    finally:
        _override.variant, _override.config = saved.variant, saved.config


def _tma_layout(t: Tensor, inner: int) -> Optional[bool]:
    """For a 2-D operand whose reduction axis is ``inner``: True if that axis has the unit stride
    (K-major), False if the other one has, None when TMA cannot read it (alignment, no unit stride)."""
    size = t.element_size()
    if t.data_ptr() % 16:
        return None
    outer = 1 - inner
    for unit, other in ((inner, outer), (outer, inner)):
        if t.stride(unit) == 1 and (t.stride(other) * size) % 16 == 0 and t.stride(other) > 0:
            return unit == inner
    return None


def _descriptor(t: Tensor, kmajor: bool, inner: int, block_mn: int, block_k: int):
    """Descriptor whose last (unit-stride) axis is the reduction axis when ``kmajor``."""
    view = t if inner == 1 else t.t()  # (rows, K) with K last
    if not kmajor:
        view = view.t()  # (K, rows)
    block = [block_mn, block_k] if kmajor else [block_k, block_mn]
    return TensorDescriptor(view, list(view.shape), list(view.stride()), block)


def _extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """The largest element offset a 2-D view reaches (64-bit offsets from 2**31 on)."""
    return (shape[0] - 1) * abs(strides[0]) + (shape[1] - 1) * abs(strides[1])


def _input_precision(dtype: torch.dtype, device: torch.device) -> str:
    if device.type != "cuda" or (dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


# ----------------------------------------------------------------------------- launchers

# compiled kernels reused without kernel[grid]'s ~15-25 us (triton 3.6) of binding per call; a TMA
# matmul paid that plus two descriptors' specialization: one launch 124.6 -> 47.3 us of host time
_POINTER = Launcher(_matmul_kernel, tensors=4)
_TMA = Launcher(_matmul_tma_kernel, tensors=2, descriptors=2)


_PLANS: dict = {}  # plan()'s results by what they depend on: a new token count costs one miss
_PLANS_LIMIT = 4096


def plan(a: Tensor, b: Tensor) -> tuple[Config, str, tuple[Optional[bool], Optional[bool]]]:
    """(config, variant that will run, (A K-major?, B K-major?)) for C = a @ b: the chosen variant
    unless the operands rule TMA out (dtype, device, K == 0, no aligned unit stride). Cached by the
    operands' shapes, strides, dtype, device and 16-byte alignment (uncached 6-18 us of host time a
    launch), unless ``options`` forces something."""
    if _override.variant is not None or _override.config is not None:
        return _plan(a, b)
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device, a.data_ptr() % 16, b.data_ptr() % 16)
    found = _PLANS.get(key)
    if found is None:
        if len(_PLANS) >= _PLANS_LIMIT:
            _PLANS.clear()
        found = _PLANS[key] = _plan(a, b)
    return found


def _plan(a: Tensor, b: Tensor) -> tuple[Config, str, tuple[Optional[bool], Optional[bool]]]:
    (M, K), N = a.shape, b.shape[1]
    cfg = pick_config(M, N, K, a.dtype, a.device)
    variant = _override.variant or DEFAULT_VARIANT
    if variant == "pointer":
        return cfg, variant, (None, None)
    layouts = (_tma_layout(a, 1), _tma_layout(b, 0))
    tma_ok = (
        TensorDescriptor is not None
        and a.dtype in (torch.float16, torch.bfloat16)
        and K > 0
        and None not in layouts
        and (a.device.type != "cuda" or _capability(a.device) >= (9, 0))
    )
    return (cfg, variant, layouts) if tma_ok else (cfg, "pointer", (None, None))


def launch(
    a: Tensor, b: Tensor, c: Tensor, *, activation: str = "identity", bias: Optional[Tensor] = None
) -> None:
    """c <- act(a @ b + bias): picks the config and variant, launches. a (M, K), b (K, N) any strides;
    c new row-major (M, N), M, N > 0; bias (N,) contiguous or None."""
    (M, K), (K_b, N) = a.shape, b.shape
    sa, sb, sc = a.stride(), b.stride(), c.stride()
    assert K_b == K and c.shape == (M, N) and sc[1] == 1, "internal: matmul operand shapes"
    cfg, variant, layouts = plan(a, b)
    index_64 = max(_extent(a.shape, sa), _extent(b.shape, sb), _extent(c.shape, sc)) >= 2**31
    shared = dict(  # both kernels' constexprs; each adds its own
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        INPUT_PRECISION=_input_precision(a.dtype, a.device),
        INDEX_64=index_64,
        DOT_FP32=a.dtype == torch.bfloat16 and a.device.type != "cuda",
    )
    bias_or_c = bias if bias is not None else c
    if variant != "pointer":
        a_kmajor, b_kmajor = layouts
        programs = _sm_count(a.device) * cfg.ctas_per_sm
        tiles = _cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n)
        descs = (
            _descriptor(a, a_kmajor, 1, cfg.block_m, cfg.block_k),
            _descriptor(b, b_kmajor, 0, cfg.block_n, cfg.block_k),
        )
        _TMA(
            (min(programs, tiles),),
            (*descs, c, bias_or_c, M, N, K, sc[0]),
            dict(
                shared,
                NUM_PROGRAMS=programs,
                A_KMAJOR=a_kmajor,
                B_KMAJOR=b_kmajor,
                WARP_SPECIALIZE=cfg.warp_specialize,
                EPILOGUE_SPLIT=cfg.epilogue_split,
            ),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    else:
        grid = (_cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n),)
        a_ptr, b_ptr = (a, b) if K else (c, c)  # K == 0: nothing is read; an empty a may have no address
        _POINTER(
            grid,
            (a_ptr, b_ptr, c, bias_or_c, M, N, K, sa[0], sa[1], sb[0], sb[1], sc[0]),
            dict(shared, EVEN_K=K % cfg.block_k == 0),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
