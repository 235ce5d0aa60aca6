"""The dropout RNG spec, shared bit for bit by every backend.

Spec (version 1):

* Generator: counter-based Philox4x32 with 7 rounds (Random123 reports 7 rounds passing BigCrush;
  FlashAttention's Triton dropout uses the same count). Round constants as in Random123 and
  ``triton.language.random``: multipliers 0xD2511F53 / 0xCD9E8D57, key bumps 0x9E3779B9 / 0xBB67AE85.
* Key: a 64-bit seed, low word in k0, high word in k1.
* Per call, ``(seed, offset)`` comes from torch's generator for x's device (or ``generator=``) without
  a host-device synchronization, in one of two forms (``draw_for``):
  - on CUDA outside graph capture, ``HostRng(seed, offset)``: host integers read from the CUDA
    generator, whose state lives on the host: seed = its 64-bit ``initial_seed()``, offset = its Philox
    offset, which the call then advances past the counters it uses (``advance``). No kernel runs for
    the draw, and ``torch.manual_seed`` replays the same masks;
  - otherwise (CPU, CUDA graph capture, ``torch.compile`` graphs) a 2-element int64 tensor
    ``[seed, offset]`` on x's device, drawn by ``torch.randint`` from the generator, both in
    [0, 2**62): under capture the draw is itself a captured kernel, so every replay gets fresh values.
  The two forms never mix within one call: backward reuses the forward's object.
* Counter: element ``e`` of the logical (M, N) row-major view (``e = row * N + col``, whatever the
  strides) belongs to group ``g = e // 8``; the group's Philox call uses the 64-bit counter
  ``c = offset + g``, low word in c0, high word in c1, c2 = c3 = 0. This is exactly
  ``tl.philox(seed, c_lo, c_hi, 0, 0, n_rounds=7)``, and ``tl.randint4x(seed, c, 7)`` whenever the
  counter fits in 32 bits. A 64-bit counter never wraps, whatever the size or number of calls.
* Bits: a call returns four 32-bit words (r0, r1, r2, r3). Element ``j = e % 8`` of the group takes the
  16-bit value ``u_j = (r[j % 4] >> (16 * (j // 4))) & 0xFFFF``: the low halves of r0..r3 serve
  elements 0..3, the high halves serve elements 4..7.
* Decision: with ``T = min(floor(p * 65536 + 0.5), 65535)``, an element is kept iff ``u_j >= T`` and
  kept values are multiplied by ``65536 / (65536 - T)`` (a float32 constant). The realized drop
  probability is ``T / 65536``, within 1/131072 of ``p``, and the expectation is preserved exactly.
* No mask is ever stored: backward regenerates it from ``rng``. ``training=False`` or ``p == 0`` draws
  nothing and masks nothing.

The implementation below uses plain torch int64 ops (products split in 16-bit halves so that nothing
overflows), so it runs on any device and inside traced graphs.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch
from torch import Tensor

N_ROUNDS = 7
ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
GROUP = 8  # elements served by one Philox call
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_SEED_RANGE = 2**62


def threshold(p: float) -> int:
    """The 16-bit drop threshold T for probability p: drop iff u < T."""
    return min(int(p * 65536.0 + 0.5), 65535)


def keep_scale(p: float) -> float:
    """The factor applied to kept elements: 65536 / (65536 - T)."""
    return 65536.0 / (65536 - threshold(p))


class HostRng(NamedTuple):
    """One call's Philox key and first counter as host integers (CUDA outside graph capture)."""

    seed: int  # [0, 2**64)
    offset: int  # [0, 2**63)


Rng = Union[Tensor, HostRng]


def draw(device: torch.device, generator: torch.Generator | None = None) -> Tensor:
    """One call's ``[seed, offset]`` pair as an int64 tensor on ``device``, drawn by a kernel from
    the generator (no host synchronization; captured like any kernel under CUDA graphs)."""
    return torch.randint(
        0, _SEED_RANGE, (2,), dtype=torch.int64, device=device, generator=generator
    )


def advance(numel: int) -> int:
    """How far one call over ``numel`` elements moves the generator's offset: its Philox counters,
    rounded up to a multiple of 4 (torch's own CUDA ops move it in steps of 4)."""
    return (-(-numel // GROUP) + 3) & ~3


def draw_for(x: Tensor, generator: torch.Generator | None = None, numel: int | None = None) -> Rng:
    """The rng of one call on ``x`` (a mask of ``numel`` elements, x's by default): ``HostRng`` read
    from the CUDA generator (advanced past the call's counters) on CUDA outside graph capture, else
    ``draw``'s tensor."""
    if x.is_cuda:
        n = x.numel() if numel is None else numel
        if generator is None:
            return draw_cuda(x.get_device(), n)
        if generator.device.type != "cuda":
            return draw(x.device, generator)  # torch's own error for a generator of another device
        return _from_host(generator, n) or draw(x.device, generator)
    return draw(x.device, generator)


_default_cuda: dict[int, torch.Generator] = {}  # device index -> torch.cuda.default_generators[index]


def draw_cuda(index: int, numel: int) -> Rng:
    """``draw_for`` of a CUDA tensor of ``numel`` elements on device ``index`` with the default
    generator: the public op's hot path, which has x's device index and size in hand (this skips
    four tensor and module lookups, ~0.4 us of host time hot and more right after other work)."""
    gen = _default_cuda.get(index)
    if gen is None:  # the default generators exist once CUDA is initialized, which x on it implies
        gen = _default_cuda[index] = torch.cuda.default_generators[index]
    return _from_host(gen, numel) or draw(torch.device("cuda", index))


def _from_host(gen: torch.Generator, numel: int) -> HostRng | None:
    """The ``HostRng`` of a call over ``numel`` elements, ``gen`` advanced past its counters; None
    while a CUDA graph is being captured (the draw must then be a kernel of the graph)."""
    try:
        # raises during capture. Not torch.cuda.is_current_stream_capturing(): with kernels queued it
        # costs ~14 us of host time a call (0.5 us idle)
        offset = gen.get_offset()
    except RuntimeError:
        return None
    gen.set_offset(offset + advance(numel))
    return HostRng(gen.initial_seed(), offset)


def as_tensor(rng: Rng, device: torch.device) -> Tensor:
    """``rng`` as the int64 ``[seed, offset]`` tensor (a seed >= 2**63 wraps to its signed value:
    the spec only reads its two 32-bit words)."""
    if isinstance(rng, Tensor):
        return rng
    seed = rng.seed - 2**64 if rng.seed >= 2**63 else rng.seed
    return torch.tensor([seed, rng.offset], dtype=torch.int64, device=device)


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * b for a constant a and b in [0, 2**32), in int64."""
    p_lo = b * (a & _U16)  # < 2**48
    p_hi = b * (a >> 16)  # < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (p_lo + ((p_hi & _U16) << 16)) & _U32
    return hi, lo


def philox(seed: Tensor | int, counter: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-7 of the 64-bit ``counter`` (int64 tensor) under the 64-bit ``seed`` (0-d int64
    tensor or int)."""
    k0 = seed & _U32
    k1 = (seed >> 32) & _U32
    c0 = counter & _U32
    c1 = (counter >> 32) & _U32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(N_ROUNDS):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + KEY_A) & _U32
        k1 = (k1 + KEY_B) & _U32
    return c0, c1, c2, c3


def uniform16(rng: Rng, numel: int, device: torch.device | None = None) -> Tensor:
    """The 16-bit values u_e (int64) for flat indices 0..numel-1 of one call (on rng's device, or
    ``device`` for a ``HostRng``)."""
    groups = -(-numel // GROUP)
    if isinstance(rng, HostRng):
        seed, offset = rng.seed, rng.offset
    else:
        seed, offset, device = rng[0], rng[1], rng.device
    counter = offset + torch.arange(groups, dtype=torch.int64, device=device)
    r = philox(seed, counter)
    u = torch.stack([w & _U16 for w in r] + [(w >> 16) & _U16 for w in r], dim=1)  # (groups, 8)
    return u.reshape(-1)[:numel]


def keep_mask(rng: Rng, m: int, n: int, p: float, device: torch.device | None = None) -> Tensor:
    """The (m, n) boolean keep mask of one call with drop probability p (``device`` as in uniform16)."""
    return (uniform16(rng, m * n, device) >= threshold(p)).view(m, n)
