"""Triton bias_act_dropout's masks: bit-identical to eager's (dispatch.contracts.rng's spec), 64-bit
counters and seeds, no repeated masks across rows, column blocks or calls, the host form of the rng,
the 16-bit rows kernel bit for bit the tile kernel's, and on the GPU a tensor of more than 2**31
elements. Outputs and gradients against the reference: test_triton_bias_act_dropout.py.
"""

from __future__ import annotations

import pytest
import torch

from dispatch.backends.eager import bias_act_dropout as eager_op
from dispatch.backends.triton import bias_act_dropout as triton_op
from dispatch import fused_bias_act_dropout
from dispatch.contracts import rng as dropout_rng
from harness import DTYPES, bias_act_inputs, op_rng

triton_backend = pytest.importorskip("dispatch.backends.triton").BACKEND
if triton_backend.unavailable():
    pytest.skip(triton_backend.unavailable(), allow_module_level=True)


def _mask(y: torch.Tensor) -> torch.Tensor:
    return y != 0


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("shape", [(1, 8), (7, 3), (33, 40), (9, 13), (4, 1)], ids=str)
def test_mask_bit_identical_to_eager(shape, p, device):
    """identity in float32: kept values are x * scale in both, so outputs must be bitwise equal."""
    x, bias, grad_y = bias_act_inputs(shape, torch.float32, device)
    rng = op_rng(device)
    y = triton_op.forward(x, bias, "identity", p, rng)
    assert torch.equal(y, eager_op.forward(x, bias, "identity", p, rng))
    gx, _ = triton_op.backward(grad_y, x, bias, "identity", p, rng, True, True)
    assert torch.equal(gx, eager_op.backward(grad_y, x, bias, "identity", p, rng, True, False)[0])


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=lambda d: str(d)[6:])
def test_half_zero_pattern_matches_eager(dtype, device):
    """z > 0, so every zero is a dropped element (gelu's far negative tail rounds to 0 differently)."""
    x = (torch.randn(17, 40, device=device).abs() + 0.1).to(dtype)
    bias = torch.rand(40, device=device).to(dtype)
    rng = op_rng(device, seed=99)
    y = triton_op.forward(x, bias, "gelu", 0.5, rng)
    assert torch.equal(_mask(y), _mask(eager_op.forward(x, bias, "gelu", 0.5, rng)))


@pytest.mark.parametrize(
    "seed, offset",
    [(3, 2**32 - 5), (2**40 + 17, 2**62 - 3), (2**61 + 2**33, 2**32 * 7 - 1)],
    ids=["carry-into-high-word", "offset-near-2**62", "high-seed-bits"],
)
@pytest.mark.parametrize("n", [40, 13])
def test_64_bit_counters_match_eager(seed, offset, n, device):
    """Counters whose low word wraps inside the tile, offsets near 2**62, seeds above 2**32."""
    x = torch.randn(6, n, device=device)
    rng = torch.tensor([seed, offset], dtype=torch.int64, device=device)
    assert torch.equal(
        triton_op.forward(x, None, "identity", 0.5, rng), eager_op.forward(x, None, "identity", 0.5, rng)
    )


def _masks_do_not_repeat(keep: torch.Tensor, block: int) -> None:
    m, n = keep.shape
    for k in range(1, 65):
        same = (keep[:-k] == keep[k:]).all(dim=1)
        assert not same.any(), f"row r and r+{k} share a mask (rows {same.nonzero().flatten().tolist()[:5]})"
    if n < 2 * block:
        return  # a single column block: nothing to compare across blocks
    chunks = keep[:, : n - n % block].reshape(m, -1, block).transpose(0, 1).reshape(n // block, -1)
    for i in range(1, chunks.shape[0]):
        assert not (chunks[i:] == chunks[:-i]).all(dim=1).any(), f"column blocks {i} apart share a mask"


def test_masks_do_not_repeat_across_rows_blocks_or_calls(device):
    """Rows r vs r+k (k = 1..64) and column blocks of the kernel's width differ; two calls differ."""
    shape = (80, 2048)  # > 64 rows, two column blocks of the forward tile
    x = torch.ones(shape, device=device)
    assert triton_op.config(*shape, 4).block_n < shape[1]
    first = fused_bias_act_dropout(x, None, "identity", 0.5, backend="triton")
    second = fused_bias_act_dropout(x, None, "identity", 0.5, backend="triton")
    keep = _mask(first)
    _masks_do_not_repeat(keep, triton_op.config(*shape, 4).block_n)
    _masks_do_not_repeat(keep, 64)
    assert not torch.equal(keep, _mask(second)), "two calls drew the same mask"
    assert abs(keep.float().mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("shape", [(33, 40), (600, 13)], ids=str)
@pytest.mark.parametrize("seed, offset", [(0x0123456789ABCDEF, 5), (2**64 - 3, 2**32 + 7), (7, 2**62 + 3)])
def test_host_rng_equals_its_tensor_form(shape, seed, offset, device):
    """A HostRng (CUDA's form outside graph capture) reaches the kernels as four int32 words: masks and
    gradients equal those of the same (seed, offset) as a tensor, and eager's, with high bits set."""
    x, bias, grad_y = bias_act_inputs(shape, torch.float32, device)
    host = dropout_rng.HostRng(seed, offset)
    tensor = dropout_rng.as_tensor(host, x.device)
    y = triton_op.forward(x, bias, "identity", 0.3, host)
    assert torch.equal(y, triton_op.forward(x, bias, "identity", 0.3, tensor))
    assert torch.equal(y, eager_op.forward(x, bias, "identity", 0.3, host))
    for a, b in zip(
        triton_op.backward(grad_y, x, bias, "gelu", 0.3, host, True, True),
        triton_op.backward(grad_y, x, bias, "gelu", 0.3, tensor, True, True),
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("shape, activation, host", [((72, 16), "gelu", True), ((66, 40), "relu", False)], ids=str)
def test_rows_kernel_bit_identical_to_the_tile_kernel(shape, activation, host, dtype, device, monkeypatch):
    """16-bit with dropout past decode sizes takes the rows kernel (32-bit word loads, scalar
    counters); its y equals the tile kernel's bit for bit, with and without bias, across a counter
    carry."""
    x, bias, _ = bias_act_inputs(shape, dtype, device)
    rng = dropout_rng.HostRng(2**64 - 5, 2**32 - 100) if host else op_rng(device)
    for b in (bias, None):
        assert triton_op._rows_kernel_fits(x, b, rng, *shape)
        y = triton_op.forward(x, b, activation, 0.3, rng)
        with monkeypatch.context() as patched:
            patched.setattr(triton_op, "_rows_kernel_fits", lambda *args: False)
            tiled = triton_op.forward(x, b, activation, 0.3, rng)
        assert torch.equal(y.view(torch.int16), tiled.view(torch.int16))
    assert not triton_op._rows_kernel_fits(x[:, 1:9], bias[1:9], rng, shape[0], 8)  # 2-byte aligned
    assert not triton_op._rows_kernel_fits(x.float(), bias.float(), rng, *shape)  # 32-bit elements
    monkeypatch.setattr(triton_op, "ROWS_KERNEL_DTYPES", (torch.bfloat16,))  # a dtype can be left out
    assert triton_op._rows_kernel_fits(x, bias, rng, *shape) == (dtype == torch.bfloat16)


# ----------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (4097, 4096), (300, 65536), (1025, 1001)], ids=str)
def test_gpu_masks_and_determinism(shape):
    x, bias, grad_y = bias_act_inputs(shape, torch.float32, "cuda")
    rng = op_rng("cuda")
    assert torch.equal(
        triton_op.forward(x, bias, "identity", 0.1, rng), eager_op.forward(x, bias, "identity", 0.1, rng)
    )
    first = triton_op.backward(grad_y, x, bias, "gelu", 0.1, rng, True, True)
    second = triton_op.backward(grad_y, x, bias, "gelu", 0.1, rng, True, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    eager_gx = eager_op.backward(grad_y, x, bias, "identity", 0.1, rng, True, False)[0]
    assert torch.equal(triton_op.backward(grad_y, x, bias, "identity", 0.1, rng, True, False)[0], eager_gx)
    _masks_do_not_repeat(triton_op.forward(torch.ones_like(x[:200]), None, "identity", 0.5, rng) != 0, 1024)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    """(2**31 / 4096 + 8) x 4096 bf16: rows around and past element 2**31 equal eager's on slices (the
    slice's rng offset advanced by row * N / 8 groups); grad_bias matches the kept counts."""
    n = 4096
    m = 2**31 // n + 8
    p = 0.1
    x = torch.empty(m, n, dtype=torch.bfloat16, device="cuda").normal_()
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    rng = op_rng("cuda")
    y = triton_op.forward(x, bias, "identity", p, rng)
    for row in (0, 2**31 // n - 1, 2**31 // n, m - 3):
        rows = slice(row, row + 3)
        rng_at = rng.clone()
        rng_at[1] += row * n // 8
        assert torch.equal(y[rows], eager_op.forward(x[rows], bias, "identity", p, rng_at)), f"rows {row}.."
    del y
    ones = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda").expand(m, n)  # stride-0 grad_y
    gx, gb = triton_op.backward(ones, x, bias, "identity", p, rng, True, True)
    kept = (gx != 0).sum(0, dtype=torch.float64)
    expected = kept * torch.tensor(dropout_rng.keep_scale(p), dtype=torch.float32).item()
    # grad_bias is rounded once to bf16 (8 significant bits): that rounding is the tolerance
    torch.testing.assert_close(gb.double(), expected, rtol=2**-8, atol=0)
    gx2, gb2 = triton_op.backward(ones, x, bias, "identity", p, rng, False, True)
    assert gx2 is None and torch.equal(gb, gb2)
