"""The dropout RNG spec (dispatch/contracts/rng.py): Philox bits, drop statistics, mask independence, seeding,
the backward mask, and no draw without dropout.

Statistical bounds are 5 sigma (a false alarm about once in 1.7 million runs per assertion).
"""

from __future__ import annotations

import math

import pytest
import torch

from dispatch import fused_bias_act_dropout
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATIONS

MASK32 = 0xFFFFFFFF


# These tests are of the spec's masks: the public op's calls never go to a backend whose masks are
# torch's (the pytorch backend; its own mask tests are in test_bias_act_dropout).
pytestmark = pytest.mark.usefixtures("spec_masks")


# ----------------------------------------------------------------------------- Philox bits


def _philox_python(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int) -> tuple[int, ...]:
    """Philox4x32 in exact Python integers, written from the Random123 paper: an oracle independent of
    dispatch.contracts.rng's 16-bit product splitting."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = dropout_rng.ROUND_A * c0, dropout_rng.ROUND_B * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + dropout_rng.KEY_A) & MASK32, (k1 + dropout_rng.KEY_B) & MASK32
    return c0, c1, c2, c3


@pytest.mark.parametrize(  # Random123's kat_vectors for philox4x32, 7 rounds: (counter, key, output)
    "counter, key, expected",
    [
        ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
        ((MASK32,) * 4, (MASK32,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A),
        ),
    ],
)
def test_python_oracle_matches_random123(counter, key, expected):
    assert _philox_python(counter, key, 7) == expected


SEEDS = (0, 1, MASK32, 2**32, 0x0123456789ABCDEF, 2**62 - 1)
COUNTERS = (0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 3, 2**62 + 11, 2**63 - 1)


def test_philox_matches_python_oracle():
    counters = torch.tensor(COUNTERS, dtype=torch.int64)
    for seed in SEEDS:
        words = dropout_rng.philox(torch.tensor(seed, dtype=torch.int64), counters)
        got = list(zip(*(w.tolist() for w in words)))
        want = [_philox_python((c & MASK32, c >> 32, 0, 0), (seed & MASK32, seed >> 32), 7) for c in COUNTERS]
        assert got == want, f"seed {seed:#x}"


def test_uniform16_bit_layout():
    """Element j of a group of eight takes bits [16 * (j // 4), +16) of word j % 4."""
    rng = torch.tensor([0x0123456789ABCDEF, 2**32 - 2], dtype=torch.int64)  # the groups straddle 2**32
    u = dropout_rng.uniform16(rng, 21).tolist()  # three groups, the last one partial
    for e, value in enumerate(u):
        c = rng[1].item() + e // 8
        words = _philox_python((c & MASK32, c >> 32, 0, 0), (rng[0].item() & MASK32, rng[0].item() >> 32), 7)
        j = e % 8
        assert value == (words[j % 4] >> (16 * (j // 4))) & 0xFFFF, f"element {e}"


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without a triton wheel
    triton = None

if triton is not None:

    @triton.jit
    def _words_kernel(
        RNG,  # [seed, unused], int64
        COUNTER,  # (N,) int64 Philox counters
        OUT,  # (N, 4) int64: the four 32-bit words
        N: tl.constexpr,
        WIDE: tl.constexpr,  # 64-bit counters through tl.philox, else tl.randint4x on 32-bit ones
    ):
        i = tl.arange(0, N)
        seed = tl.load(RNG)
        c = tl.load(COUNTER + i)
        if WIDE:
            lo = (c & 0xFFFFFFFF).to(tl.uint32)
            hi = ((c >> 32) & 0xFFFFFFFF).to(tl.uint32)
            r0, r1, r2, r3 = tl.philox(seed, lo, hi, 0, 0, 7)
        else:
            r0, r1, r2, r3 = tl.randint4x(seed, c.to(tl.uint32), 7)
        tl.store(OUT + 4 * i, r0.to(tl.int64) & 0xFFFFFFFF)
        tl.store(OUT + 4 * i + 1, r1.to(tl.int64) & 0xFFFFFFFF)
        tl.store(OUT + 4 * i + 2, r2.to(tl.int64) & 0xFFFFFFFF)
        tl.store(OUT + 4 * i + 3, r3.to(tl.int64) & 0xFFFFFFFF)


def _triton_words(seed: int, counters: tuple[int, ...], wide: bool, device: str) -> list[tuple[int, ...]]:
    if triton is None:
        pytest.skip("triton is not installed")
    n = 16  # a power of two for tl.arange; padded with the last counter
    padded = list(counters) + [counters[-1]] * (n - len(counters))
    rng = torch.tensor([seed, 0], dtype=torch.int64, device=device)
    counter = torch.tensor(padded, dtype=torch.int64, device=device)
    out = torch.empty(n, 4, dtype=torch.int64, device=device)
    _words_kernel[(1,)](rng, counter, out, N=n, WIDE=wide)
    return [tuple(row) for row in out[: len(counters)].tolist()]


def _spec_words(seed: int, counters: tuple[int, ...]) -> list[tuple[int, ...]]:
    words = dropout_rng.philox(
        torch.tensor(seed, dtype=torch.int64), torch.tensor(counters, dtype=torch.int64)
    )
    return list(zip(*(w.tolist() for w in words)))


@pytest.mark.parametrize("seed", SEEDS)
def test_triton_randint4x_bit_compatible(seed, device):
    counters = tuple(c for c in COUNTERS if c < 2**32)
    assert _triton_words(seed, counters, wide=False, device=device) == _spec_words(seed, counters)


@pytest.mark.parametrize("seed", SEEDS)
def test_triton_philox_64bit_counter_bit_compatible(seed, device):
    assert _triton_words(seed, COUNTERS, wide=True, device=device) == _spec_words(seed, COUNTERS)


# ----------------------------------------------------------------------------- statistics

ROWS, COLS = 1024, 1000  # 1,024,000 elements; rows not a multiple of 8, so groups straddle rows


def _five_sigma(n: int, q: float) -> float:
    return 5.0 * math.sqrt(q * (1.0 - q) / n)


@pytest.mark.parametrize("p", (0.01, 0.1, 0.5, 0.9))
def test_drop_fraction_and_mean(p, device):
    x = torch.rand(ROWS, COLS, device=device) + 0.5  # positive, never zero, so y == 0 iff dropped
    y = fused_bias_act_dropout(x, None, "identity", p)
    q = dropout_rng.threshold(p) / 65536
    assert abs(q - p) <= 1 / 131072
    dropped = y == 0
    assert abs(dropped.double().mean().item() - q) <= _five_sigma(x.numel(), q)
    # E[y] = x exactly; Var(y_e) = x_e^2 q / (1 - q)
    sigma_sum = math.sqrt((x.double() ** 2).sum().item() * q / (1 - q))
    assert abs(y.double().sum().item() - x.double().sum().item()) <= 5 * sigma_sum
    scale = torch.tensor(dropout_rng.keep_scale(p), dtype=torch.float32)
    assert torch.equal(y[~dropped], x[~dropped] * scale.to(device))


def _mask(shape: tuple[int, int], device: str) -> torch.Tensor:
    """The keep mask of one call at p = 0.5."""
    return fused_bias_act_dropout(torch.ones(shape, device=device), None, "identity", 0.5) != 0


def _assert_independent(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Two p = 0.5 masks of the same shape: no row of a equals the same row of b, and they agree on about
    half of the elements (a shifted or shared stream would agree far more often)."""
    assert not (a == b).all(dim=-1).any(), f"{what}: identical masks"
    agree = (a == b).double().mean().item()
    assert abs(agree - 0.5) <= _five_sigma(a.numel(), 0.5), f"{what}: masks agree on {agree:.4f}"


def test_no_repeated_masks_between_rows(device):
    keep = _mask((512, 1000), device)
    for k in range(1, 65):
        _assert_independent(keep[:-k], keep[k:], f"rows r and r+{k}")


def test_no_repeated_masks_between_column_blocks(device):
    for width in (64, 256, 1024):
        blocks = _mask((64, 4096), device).view(64, 4096 // width, width)  # (rows, blocks, width)
        for j in range(1, blocks.shape[1]):
            _assert_independent(blocks[:, 0], blocks[:, j], f"column blocks 0 and {j} of width {width}")


def test_no_repeated_masks_between_calls(device):
    first, second = _mask((256, 1000), device), _mask((256, 1000), device)
    _assert_independent(first, second, "successive calls")


@pytest.mark.parametrize("source", ("manual_seed", "generator"))
def test_same_seed_same_output(source, device):
    x = torch.randn(64, 100, device=device)
    bias = torch.randn(100, device=device)

    def once():
        if source == "manual_seed":
            torch.manual_seed(1234)
            return fused_bias_act_dropout(x, bias, "gelu", 0.3)
        gen = torch.Generator(device=device).manual_seed(1234)
        return fused_bias_act_dropout(x, bias, "gelu", 0.3, generator=gen)

    first, second = once(), once()
    assert torch.equal(first, second)
    assert (first == 0).any() and not torch.equal(first, fused_bias_act_dropout(x, bias, "gelu", 0.3))


@pytest.mark.parametrize("activation", ("identity", "gelu"))
def test_backward_uses_the_forward_mask(activation, device):
    x = (torch.rand(128, 100, device=device) + 0.5).requires_grad_()  # act(x) != 0: y == 0 iff dropped
    y = fused_bias_act_dropout(x, None, activation, 0.4)
    grad_y = torch.randn_like(y)
    (grad_x,) = torch.autograd.grad(y, x, grad_y)
    dropped = y == 0
    assert 0.3 < dropped.float().mean().item() < 0.5
    assert (grad_x[dropped] == 0).all()
    expected = grad_y * dropout_rng.keep_scale(0.4) * ACTIVATIONS[activation].derivative(x.detach())
    torch.testing.assert_close(grad_x[~dropped], expected[~dropped])


def _rng_state(device: str, generator) -> torch.Tensor:
    if generator is not None:
        return generator.get_state()
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("use_generator", (False, True))
def test_no_draw_without_dropout(use_generator, device):
    gen = torch.Generator(device=device).manual_seed(7) if use_generator else None
    x = torch.randn(8, 16, device=device, requires_grad=True)
    before = _rng_state(device, gen)
    y1 = fused_bias_act_dropout(x, None, "gelu", 0.5, training=False, generator=gen)
    y2 = fused_bias_act_dropout(x, None, "gelu", 0.0, generator=gen)
    (y1 + y2).sum().backward()
    assert torch.equal(_rng_state(device, gen), before)
    torch.testing.assert_close(y1, torch.nn.functional.gelu(x))
    torch.testing.assert_close(y2, torch.nn.functional.gelu(x))
    fused_bias_act_dropout(x, None, "gelu", 0.5, generator=gen)  # the check above can fail
    assert not torch.equal(_rng_state(device, gen), before)


# ----------------------------------------------------------------------------- the two forms of a draw


@pytest.mark.parametrize("seed", (0x0123456789ABCDEF, 2**64 - 1, 2**63, 3))
@pytest.mark.parametrize("offset", (0, 2**32 - 1, 2**40 + 5))
def test_host_rng_masks_equal_the_tensor_form(seed, offset):
    """HostRng's integers and as_tensor's int64 pair (a seed >= 2**63 wraps to negative) key the same
    Philox stream, counters crossing a 32-bit boundary included."""
    host = dropout_rng.HostRng(seed, offset)
    tensor = dropout_rng.as_tensor(host, torch.device("cpu"))
    assert tensor.dtype == torch.int64
    mask = dropout_rng.keep_mask(host, 9, 40, 0.5, torch.device("cpu"))
    assert torch.equal(mask, dropout_rng.keep_mask(tensor, 9, 40, 0.5))
    words = dropout_rng.philox(seed, torch.tensor([offset]))
    expected = _philox_python((offset & MASK32, offset >> 32, 0, 0), (seed & MASK32, seed >> 32), 7)
    assert [int(w) for w in words] == list(expected)


@pytest.mark.parametrize("numel", (1, 8, 9, 33, 10**6 + 1))
def test_advance_covers_the_counters_in_steps_of_4(numel):
    step = dropout_rng.advance(numel)
    assert step % 4 == 0 and -(-numel // 8) <= step < -(-numel // 8) + 4


def test_draw_for_forms_and_seeding(device):
    """CUDA outside capture: HostRng from the generator's (seed, offset), the offset moved past the call's
    counters; CPU: draw's tensor. Either way, re-seeding replays the same draws."""
    x = torch.empty(3, 1001, device=device)
    gen = torch.Generator(device=device).manual_seed(5)
    first, second = dropout_rng.draw_for(x, gen), dropout_rng.draw_for(x, gen)
    if x.is_cuda:
        assert first == dropout_rng.HostRng(5, 0)
        assert second == dropout_rng.HostRng(5, dropout_rng.advance(x.numel()))
    else:
        assert isinstance(first, torch.Tensor) and first.shape == (2,)
        assert not torch.equal(first, second)
    gen.manual_seed(5)
    again = dropout_rng.draw_for(x, gen)
    assert again == first if x.is_cuda else torch.equal(again, first)
    if x.is_cuda:  # the default generator: draw_for and the public op's draw_cuda take the same steps
        torch.cuda.manual_seed(11)
        index = x.get_device()
        draws = [dropout_rng.draw_for(x), dropout_rng.draw_cuda(index, x.numel()), dropout_rng.draw_for(x)]
        step = dropout_rng.advance(x.numel())
        assert draws == [dropout_rng.HostRng(11, i * step) for i in range(3)]
