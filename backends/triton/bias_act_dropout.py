"""Triton bias_act_dropout: launch settings per shape class, then the launchers of the
``dispatch.registry.BiasActDropoutImpl`` contract. Kernels: ``bias_act_dropout_kernels.py``.

Launch settings come from a rule, not an autotuner, so a new token count never triggers tuning:
BLOCK_N a power of two <= 1024 that wastes at most 1/16 of a row on padding, BLOCK_M the rest of a
fixed tile; decode shapes (M <= 64) take every row in one tile: one launch forward, one backward.
Compiled variants are keyed by these buckets only (M is not specialized).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from dispatch.backends.triton.bias_act_dropout_kernels import _backward_kernel, _bias_grad_kernel, _forward_kernel
from dispatch.backends.triton.bias_act_dropout_rows import _forward_rows_kernel
from dispatch.backends.triton.launch import Launcher
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.rng import Rng

# Forward: 4 x 1024 bf16 tiles (32 elements a thread, 4 warps) ran bias+gelu at 1.03x a copy's time on
# H200 (issue 3 feasibility kernel). float32 takes 16 a thread, the same 64 bytes: at 32 the dropout
# kernel needed 120-136 registers (sm_90 SASS, triton 3.6 / 3.9) against 48. Backward keeps 8 a
# thread: with the bias-gradient accumulator and the bias in registers, 32 needed 96-223 registers.
FORWARD_BYTES_PER_THREAD, FORWARD_WARPS = 64, 4
BACKWARD_PER_THREAD, BACKWARD_WARPS = 8, 8
MAX_BLOCK_N = 1024
# 16-bit dtypes, measured by benchmarks/probes/sweep_bias_act_dropout.py (H200, 2026-11-30, bf16 gelu,
# 65536 x 4096 and 16384 x 14336, time / one copy): forward with dropout 64 B a thread, 4 warps and
# rows up to 2048 wide: 1.31x (1.38x at 1024 wide); without dropout 32 B a thread: 1.04-1.06x (1.17x);
# backward without dropout 16 elements a thread, 4 warps: 1.70-1.77x (1.78-1.82x). (bytes or elements
# a thread, warps, widest BLOCK_N) by (backward, dropout):
HALF_SETTINGS = {
    (False, True): (64, 4, 2048),
    (False, False): (32, 4, 2048),
    (True, True): (8, 8, MAX_BLOCK_N),
    (True, False): (16, 4, MAX_BLOCK_N),
}
# bf16 forward with dropout, rows kernel (benchmarks/probes/fwd_variants.py, H200 2026-11-30): 16
# elements a thread, rows up to 2048 wide, 8 rows a program: 1.12-1.14x a copy vs the tile's 1.31-1.33x
ROWS_KERNEL_ROWS, ROWS_KERNEL_MAX_N, ROWS_KERNEL_PER_THREAD = 8, 2048, 16
# float16 takes it too (each half widens with a conversion instead of a bit move): with gelu and p =
# 0.1, 1.147x / 1.172x a copy at 65536x4096 / 16384x14336 against the tile kernel's 1.264x / 1.287x,
# y bit for bit the tile's (benchmarks/probes/probe_fp16_rows.py, H200, session 8)
ROWS_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
DECODE_ROWS = 64  # M up to this: one tile holds every row (one launch forward, one backward)
DECODE_TILE = 4096
# Backward row-programs loop over rows summing the bias gradient: at most MAX_ROWS_PER_PROGRAM rows
# (float32 partials <= 1/16 byte an element, ~1% of bf16 backward traffic), fewer while the grid would
# fall under MIN_PROGRAMS_PER_SM programs an SM.
MAX_ROWS_PER_PROGRAM = 64
MIN_PROGRAMS_PER_SM = 4
_INT32_LIMIT = 2**31
_FORWARD = Launcher(_forward_kernel, tensors=4)
_FORWARD_ROWS = Launcher(_forward_rows_kernel, tensors=4)
_BACKWARD = Launcher(_backward_kernel, tensors=6)
_BIAS_GRAD = Launcher(_bias_grad_kernel, tensors=2)
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


def forward(x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]) -> Tensor:
    """y = dropout(act(x + bias)) in one pass; x (M, N) with any strides, y contiguous in x's dtype."""
    _check(x, bias)
    return _forward(x, bias, activation, p, rng)


def _forward(x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Rng]) -> Tensor:
    """``forward`` on arguments the caller validated (``trusted``)."""
    m, n = x.shape
    y = x.new_empty((m, n))  # contiguous; new_empty builds no torch.device
    if m == 0 or n == 0:
        return y
    (rng_t, s0, s1, o0, o1, threshold, scale), on_device = _dropout_args(x, p, rng)
    if _rows_kernel_fits(x, bias, rng, m, n):
        block_n = _block_n(n, ROWS_KERNEL_MAX_N)
        _FORWARD_ROWS(
            (_cdiv(m, ROWS_KERNEL_ROWS), _cdiv(n, block_n)),
            (x, x if bias is None else bias, y, rng_t, s0, s1, o0, o1, m, n, x.stride(0), threshold, scale),
            (
                activation,  # ACTIVATION
                bias is not None,  # HAS_BIAS
                on_device,  # RNG_ON_DEVICE
                m % ROWS_KERNEL_ROWS == 0 and n % block_n == 0,  # EVEN
                block_n,
                ROWS_KERNEL_ROWS,
            ),
            max(1, min(4, block_n // (32 * ROWS_KERNEL_PER_THREAD))),
        )
        return y
    cfg = config(m, n, x.element_size(), dropout=rng is not None)
    _FORWARD(
        (_cdiv(m, cfg.block_m), _cdiv(n, cfg.block_n)),
        (
            x, x if bias is None else bias, y, rng_t, s0, s1, o0, o1,
            m, n, x.stride(0), x.stride(1), threshold, scale,
        ),  # fmt: skip
        (
            activation,  # ACTIVATION
            bias is not None,  # HAS_BIAS
            rng is not None,  # DROPOUT
            on_device,  # RNG_ON_DEVICE
            n % 8 == 0,  # GROUPED
            _wide(n, x.stride(1)),  # WIDE
            cfg.block_m,
            cfg.block_n,
        ),
        cfg.num_warps,
    )
    return y


def backward(
    grad_y: Tensor,
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Rng],
    need_x: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """grad_x = grad_y * keep * scale * act'(x + bias) and grad_bias = its column sums, in one pass
    over (M, N) plus, when several row-programs share a column, a small deterministic reduction."""
    _check(x, bias)
    if grad_y.shape != x.shape:
        raise ValueError(f"grad_y must have x's shape {tuple(x.shape)}, got {tuple(grad_y.shape)}")
    return _backward(grad_y, x, bias, activation, p, rng, need_x, need_bias)


def _backward(
    grad_y: Tensor,
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Rng],
    need_x: bool,
    need_bias: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``backward`` on arguments the caller validated (``trusted``)."""
    need_bias = need_bias and bias is not None
    m, n = x.shape
    grad_x = x.new_empty((m, n)) if need_x else None
    if not need_bias:
        if not need_x or m == 0 or n == 0:
            return grad_x, None
    elif m == 0 or n == 0:
        return grad_x, torch.zeros_like(bias)
    cfg = config(m, n, x.element_size(), backward=True, dropout=rng is not None)
    col_programs = _cdiv(n, cfg.block_n)
    rows_per_program = _rows_per_program(m, cfg, col_programs, x) if need_bias else cfg.block_m
    row_programs = _cdiv(m, rows_per_program)
    grad_bias = partials = None
    if need_bias:
        grad_bias = torch.empty_like(bias)
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
        (
            activation,  # ACTIVATION
            bias is not None,  # HAS_BIAS
            rng is not None,  # DROPOUT
            on_device,  # RNG_ON_DEVICE
            n % 8 == 0,  # GROUPED
            _wide(n, sx[1], sgy[1]),  # WIDE
            need_x,  # NEED_X
            need_bias,  # NEED_BIAS
            cfg.block_m,
            cfg.block_n,
        ),
        cfg.num_warps,
    )
    if partials is not None:  # 32 columns (128 B rows) a program: N / 32 programs stream the partials
        _BIAS_GRAD((_cdiv(n, 32),), (partials, grad_bias, row_programs, n), (64, 32), 4)
    return grad_x, grad_bias


# The contract's functions without this module's own argument checks, for the dispatcher, which has
# validated the call already (dispatch.registry.trusted). The checks cost ~1.2-1.7 us of host time a
# call hot and over twice that right after other torch work, the same as the dispatcher's own
# (benchmarks/NOTES.md, session 11).
trusted = SimpleNamespace(forward=_forward, backward=_backward)
