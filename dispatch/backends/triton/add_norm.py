"""Triton fused residual add + RMSNorm / LayerNorm, forward and backward:
    h = x + residual (rounded to x's dtype, as PyTorch's add), y = norm(h) * (w + offset) (+ b)
h is the next residual stream: both outputs carry gradients. The kernels and their math are in
``add_norm_kernels.py``; here, in order: launch settings, launchers (check, allocate, launch:
``add_norm_forward`` / ``add_norm_backward``) and the op's ``KERNELS`` (``dispatch.ops.add_norm``; the
shared runner's autograd node calls them).

Bytes (s = itemsize, (M, N) rows): forward reads x and residual and writes y and h, 4MNs, where
PyTorch's add then a fused norm kernel move 5MNs (add: 3, norm: 2); backward reads dy, dh_out and h
and writes dh, 4MNs, against 6MNs for a norm backward (3) and the add of dh_out (3). Saved for
backward: h (x's dtype), float32 rstd and (LayerNorm) mean, 4-8 B a row; never the normalized output.
dw and db: each backward program sums its rows into one float32 partial row, reduced in a fixed order
by bias_act_dropout's ``sum_partials``: deterministic, no atomics.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from dispatch.backends.triton.add_norm_kernels import (
    _backward_kernel,
    _backward_wide_kernel,
    _forward_kernel,
    _forward_wide_kernel,
)
from dispatch.backends.triton.bias_act_dropout import sum_partials
from dispatch.backends.triton.launch import Launcher
from dispatch.contracts.backend import Kernels

KINDS = ("rms", "layer")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ----------------------------------------------------------------------------- launch settings
# A row up to MAX_BLOCK_N lives whole in registers; narrow rows share a program's TILE-element tile
# (N = 896: 4 rows); wider rows (12288, 16384) go in WIDE_BLOCK_N chunks, one row at a time. Elements
# a thread (sm_90 builds, triton 3.6 / 3.9, bf16, N = 896 to 8192): forward 16, 58-106 registers.
# RMSNorm's backward 16 (8 warps a 4 x 1024 tile, 148-188 registers): the fastest of eight settings
# or within 1% on every row (benchmarks/sweep_add_norm.py, H100), 1024 x 896 fwd+bwd 11.9 us against
# 18.4 at 8 (16 warps), for rows up to 4096. LayerNorm's backward (a db accumulator too) likewise:
# 16-45% faster than at 8 on all 15 rows swept (1024 x 896 18.2 us against 32.9). Rows past 4096
# (at 8, N = 8192 already spilled 8-24 B a thread) keep 8 until timed at 16.
MAX_BLOCK_N = 8192
WIDE_BLOCK_N = 4096
TILE = 4096
FORWARD_PER_THREAD, BACKWARD_PER_THREAD, MAX_WARPS = 16, 16, 16
UNTIMED_BACKWARD_PER_THREAD = 8
BACKWARD_TIMED_MAX_N = 4096  # the widest row BACKWARD_PER_THREAD was timed at
PROGRAMS_PER_SM = 2  # backward: programs looping over rows, each writing one partial dw row
CPU_PROGRAMS = 4  # the interpreter: a few programs, so tests cross the partial sums


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


class Config(NamedTuple):
    block_m: int  # rows a tile (1 for wide rows)
    block_n: int  # next_power_of_2(N), or the chunk of a wide row
    num_warps: int
    wide: bool  # N > MAX_BLOCK_N: the chunked kernels


@functools.lru_cache(maxsize=1024)
def config(m_bucket: int, n: int, backward: bool) -> Config:
    """Tile for rows of N, ``m_bucket`` = min(next_power_of_2(M), TILE) (so M is not a cache key)."""
    per_thread = FORWARD_PER_THREAD
    if backward:
        timed = n <= BACKWARD_TIMED_MAX_N
        per_thread = BACKWARD_PER_THREAD if timed else UNTIMED_BACKWARD_PER_THREAD
    if n > MAX_BLOCK_N:
        return Config(1, WIDE_BLOCK_N, min(MAX_WARPS, WIDE_BLOCK_N // (32 * per_thread)), True)
    block_n = _next_power_of_2(n)
    block_m = min(max(1, TILE // block_n), m_bucket)
    return Config(block_m, block_n, min(MAX_WARPS, max(1, block_m * block_n // (32 * per_thread))), False)


def _config(m: int, n: int, backward: bool) -> Config:
    return config(min(_next_power_of_2(m), TILE), n, backward)


@functools.cache
def _programs_cap(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_PROGRAMS
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _split(m: int, block_m: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows a program, a multiple of block_m) for the backward."""
    blocks = _cdiv(m, block_m)
    rows = _cdiv(blocks, min(blocks, _programs_cap(device))) * block_m
    return _cdiv(m, rows), rows


# ----------------------------------------------------------------------------- launchers

_FORWARD = Launcher(_forward_kernel, tensors=8)
_FORWARD_WIDE = Launcher(_forward_wide_kernel, tensors=8)
_BACKWARD = Launcher(_backward_kernel, tensors=9)
_BACKWARD_WIDE = Launcher(_backward_wide_kernel, tensors=9)


def _unit_columns(t: Tensor) -> Tensor:
    """t (M, N) with unit column stride: a copy only where it has another one."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _check(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be a 2-D (M, N) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32 for triton, got {x.dtype}")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device
    ):
        raise ValueError(
            f"residual must be a {tuple(x.shape)} {x.dtype} tensor on {x.device} like x, got "
            f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )
    n = x.shape[1]
    if weight is None or weight.shape != (n,) or weight.dtype not in _DTYPES or weight.device != x.device:
        got = None if weight is None else f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
        raise ValueError(
            f"weight must be a ({n},) float16, bfloat16 or float32 tensor on {x.device}, got {got}"
        )
    if bias is not None and kind == "rms":
        raise ValueError("bias must be None for kind='rms' (RMSNorm has no bias)")
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype or bias.device != x.device):
        raise ValueError(
            f"bias must be a ({n},) {weight.dtype} tensor on {x.device} like weight, got "
            f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )


def add_norm_forward(
    x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float, kind: str,
    offset: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:  # fmt: skip
    """(y, h, rstd, mean) for x and residual (M, N) (any row strides; residual None: h is x itself):
    y and h contiguous in x's dtype, rstd and mean (None for rms) (M,) float32."""
    _check(x, residual, weight, bias, kind)
    x, weight = _unit_columns(x), weight.contiguous()
    residual = None if residual is None else _unit_columns(residual)
    bias = None if bias is None else bias.contiguous()
    m, n = x.shape
    y = x.new_empty((m, n))
    h = x if residual is None else x.new_empty((m, n))
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    mean = None if kind == "rms" else torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y, h, rstd, mean
    cfg = _config(m, n, False)
    args = (
        x, x if residual is None else residual, weight, weight if bias is None else bias, y, h, rstd,
        rstd if mean is None else mean, m, n, x.stride(0), 0 if residual is None else residual.stride(0),
        float(eps), float(offset),
    )  # fmt: skip
    flags = dict(RMS=kind == "rms", HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None)
    if cfg.wide:
        _FORWARD_WIDE((m,), args, dict(flags, BLOCK_N=cfg.block_n), num_warps=cfg.num_warps)
    else:
        grid = (_cdiv(m, cfg.block_m),)
        _FORWARD(grid, args, dict(flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n), num_warps=cfg.num_warps)
    return y, h, rstd, mean


def add_norm_backward(
    dy: Tensor, dh_out: Optional[Tensor], h: Tensor, weight: Tensor, bias_present: bool, rstd: Tensor,
    mean: Optional[Tensor], kind: str, offset: float, needs: tuple[bool, bool, bool],
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """(dx, dw, db), each where ``needs`` (dx, dw, db) asks: dx = dh_out + d norm(h)/dh . dy, (M, N)
    contiguous in h's dtype, the gradient of x and of residual both; dw, db in weight's dtype."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    for name, t in (("dy", dy), ("dh_out", dh_out)):
        if t is not None and (t.shape != h.shape or t.dtype != h.dtype):
            raise ValueError(
                f"{name} must be a {tuple(h.shape)} {h.dtype} tensor like h, got {tuple(t.shape)} {t.dtype}"
            )
    need_dx, need_dw, need_db = needs[0], needs[1], needs[2] and bias_present
    m, n = h.shape
    dx = h.new_empty((m, n)) if need_dx else None
    alloc = weight.new_zeros if m == 0 else weight.new_empty  # no rows: dw = db = 0
    dw = alloc(n) if need_dw else None
    db = alloc(n) if need_db else None
    if m == 0 or n == 0 or not (need_dx or need_dw or need_db):
        return dx, dw, db
    dy, h, weight = _unit_columns(dy), _unit_columns(h), weight.contiguous()
    dh_out = None if dh_out is None else _unit_columns(dh_out)
    cfg = _config(m, n, True)
    programs, rows = _split(m, cfg.block_m, h.device)
    direct = programs == 1 and not cfg.wide  # one program writes dw and db themselves
    new = torch.zeros if cfg.wide else torch.empty  # the wide kernel adds into its partial rows
    part_w = dw if direct or not need_dw else new((programs, n), dtype=torch.float32, device=h.device)
    part_b = db if direct or not need_db else new((programs, n), dtype=torch.float32, device=h.device)
    args = (
        dy, dy if dh_out is None else dh_out, h, weight, rstd, rstd if mean is None else mean,
        h if dx is None else dx, rstd if part_w is None else part_w, rstd if part_b is None else part_b,
        m, n, rows, dy.stride(0), 0 if dh_out is None else dh_out.stride(0), h.stride(0), float(offset),
    )  # fmt: skip
    flags = dict(
        RMS=kind == "rms", HAS_DH=dh_out is not None, NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db
    )
    if cfg.wide:
        _BACKWARD_WIDE((programs,), args, dict(flags, BLOCK_N=cfg.block_n), num_warps=cfg.num_warps)
    else:
        constexprs = dict(flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        _BACKWARD((programs,), args, constexprs, num_warps=cfg.num_warps)
    if need_dw and not direct:
        _sum_rows(part_w, dw)
    if need_db and not direct:
        _sum_rows(part_b, db)
    return dx, dw, db


def _sum_rows(partials: Tensor, out: Tensor) -> None:
    """out (N,) <- the column sums of partials (programs, N), rows in a fixed order. On CPU tensors (the
    interpreter, which runs sum_partials' N / 32 programs one at a time: 2 s at N = 8195) torch's sum."""
    if partials.is_cuda:
        sum_partials(partials, out)
    else:
        out.copy_(partials.sum(0))


# ----------------------------------------------------------------------------- the op's kernels


def _statistics(h: Tensor, eps: float, kind: str) -> tuple[Tensor, Optional[Tensor]]:
    """rstd and mean (None for rms) of h's rows (M,), float32, for a backward whose forward kept h alone
    (a compiled graph's custom op): one more pass over h."""
    hf = h.float()
    mean = hf.mean(1) if kind == "layer" else None
    centered = hf if mean is None else hf - mean[:, None]
    return torch.rsqrt(centered.pow(2).mean(1) + eps), mean


def _inference(x, residual, weight, bias, eps, norm, offset):
    y, h, _, _ = add_norm_forward(x, residual, weight, bias, eps, norm, offset)
    return y, h


def _backward(dy, dh, h, rstd, mean, weight, bias, eps, norm, offset, needs):
    if dy is None:  # only h was used: its gradient passes to x and residual
        return (dh if needs[0] else None), None, None
    if rstd is None:
        rstd, mean = _statistics(h, eps, norm)
    return add_norm_backward(dy, dh, h, weight, bias is not None, rstd, mean, norm, offset, needs)


# dispatch.ops.add_norm's kernels (their signatures: dispatch/ops/add_norm_math.py)
KERNELS = Kernels(forward=add_norm_forward, backward=_backward, inference=_inference)
