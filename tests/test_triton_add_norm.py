"""Triton fused add + RMSNorm / LayerNorm (``dispatch/backends/triton/add_norm.py``) through the public
ops with ``backend="triton"``: y, h and the gradients of x, residual, weight and bias against the op's
float64 reference (``dispatch.ops.add_norm.reference``), within flash-attention's rule against the
reference in the same dtype (``dispatch.contracts.tolerances``); h bit for bit PyTorch's x + residual.
Odd shapes, rows past MAX_BLOCK_N (the chunked kernels), strides, residual None, Gemma's offset,
upstream gradients on y, h or both, NaN / inf rows, determinism and bad input. The helpers, shared with
``test_add_norm.py``, are ``add_norm_checks.py``.

On CPU the kernels run under Triton's interpreter: few rows, but both kernels' paths (one backward
program writing dw itself, several writing partial rows) and the chunked ones.
"""

from __future__ import annotations

import pytest
import torch

from dispatch import fused_add_rms_norm
from dispatch.contracts.tolerances import check
from add_norm_checks import assert_matches, inputs, outputs_and_grads, public, references
from harness import DTYPES

triton_backend = pytest.importorskip("dispatch.backends.triton").BACKEND
if triton_backend.unavailable():
    pytest.skip(triton_backend.unavailable(), allow_module_level=True)

from dispatch.backends.triton import add_norm  # noqa: E402

WIDE_N = add_norm.MAX_BLOCK_N + 3  # the chunked kernels: two full chunks and three columns
SHAPES = ((1, 1), (7, 3), (9, 41, 341), (5, 781))
WIDE = ((2, 4097), (2, WIDE_N))  # the widest one-tile rows (BLOCK_N 8192) and the chunked kernels


def assert_triton(tensors, upstream, kind: str, offset: float = 0.0) -> None:
    """The triton op against the float64 reference (``add_norm_checks.assert_matches``); h is PyTorch's
    sum, and x and residual get one gradient."""
    x, r = tensors[:2]
    y, h, gx, gr, *_ = assert_matches("triton", kind, tensors, upstream, offset)
    assert_same_sum(h, x, r)
    if r is not None:
        assert torch.equal(gx, gr)


def assert_same_sum(h, x, r) -> None:
    """h is PyTorch's x + residual bit for bit. Triton's interpreter (CPU) rounds float32 to bfloat16
    toward zero, where GPUs (cvt.rn.bf16.f32) and PyTorch round to nearest even: there either will do."""
    expected = x if r is None else x + r
    if torch.equal(h, expected):
        return
    assert h.device.type == "cpu" and h.dtype == torch.bfloat16, "h is not PyTorch's x + residual"
    toward_zero = ((x.float() + r.float()).view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert ((h == expected) | (h == toward_zero)).all(), "h is neither rounding of x + residual"


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", add_norm.KINDS)
def test_matches_reference(kind, dtype, device):
    for shape in SHAPES:
        assert_triton(*inputs(shape, dtype, device, kind), kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", add_norm.KINDS)
def test_wide_rows(kind, dtype, device):
    for shape in WIDE:
        assert_triton(*inputs(shape, dtype, device, kind), kind)
    assert_triton(*inputs(WIDE[-1], dtype, device, kind, residual=False), kind)


@pytest.mark.parametrize("upstream", ["y", "h"])
@pytest.mark.parametrize("kind", add_norm.KINDS)
def test_one_output_used(kind, upstream, device):
    """dh_out None (only y feeds on) or dy None (only h does: dx = dh_out, dw = 0)."""
    for shape, dtype in (((9, 41, 341), torch.float32), ((5, 781), torch.bfloat16)):
        tensors, (gy, gh) = inputs(shape, dtype, device, kind)
        assert_triton(tensors, (gy if upstream == "y" else None, gh if upstream == "h" else None), kind)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", add_norm.KINDS)
def test_residual_none(kind, dtype, device):
    """Plain RMSNorm / LayerNorm: h is x itself, its upstream gradient added to grad_x."""
    for shape in ((7, 3), (9, 41, 341)):
        tensors, upstream = inputs(shape, dtype, device, kind, residual=False)
        assert_triton(tensors, upstream, kind)
    y, h = public(kind, "triton")(*tensors)
    assert h.data_ptr() == tensors[0].data_ptr()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kind", add_norm.KINDS)
def test_offset(kind, dtype, device):
    """Gemma's RMSNorm multiplies by (1 + w): offset=1.0, weight around 0."""
    for shape in ((7, 3), (9, 41, 341), (2, WIDE_N)):
        assert_triton(*inputs(shape, dtype, device, kind, offset=1.0), kind, offset=1.0)


@pytest.mark.parametrize("kind", add_norm.KINDS)
def test_strides(kind, device):
    """Row strides pass through (0 for an expanded residual); other column strides are copied."""
    m, n = 41, 341
    x = torch.randn(m, n + 5, device=device)[:, :n]  # row stride n + 5
    r = torch.randn(1, n, device=device).expand(m, n)  # row stride 0
    w = torch.randn(2 * n, device=device)[::2]
    b = torch.randn(n, device=device) if kind == "layer" else None
    gy = torch.randn(n, m, device=device).t()  # column stride m
    gh = torch.randn(n, device=device).expand(m, n)
    assert_triton((x, r, w, b), (gy, gh), kind)
    assert_triton((torch.randn(n, m, device=device).t(), torch.randn(m, 2 * n, device=device)[:, ::2], w, b),
                  (gy.contiguous(), gh.contiguous()), kind)  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("kind", add_norm.KINDS)
def test_nonfinite_rows_stay_in_their_rows(kind, device):
    """NaN in x and inf in residual spoil y and grad_x in their own rows only (dw and db sum over every
    row: non-finite, as PyTorch's)."""
    for shape in ((6, 37), (3, WIDE_N)):
        (x, r, w, b), (gy, gh) = inputs(shape, torch.float32, device, kind)
        x[1, 3] = float("nan")
        r[2, 0] = float("inf")
        got = outputs_and_grads(public(kind, "triton"), (x, r, w, b), (gy, gh))
        bad, good = [1, 2], [0] + list(range(3, shape[0]))
        ref, base = references(kind, (x[good], r[good], w, b), (gy[good], gh[good]))
        for name, i in (("y", 0), ("grad_x", 2)):
            assert not got[i][bad].isfinite().all(dim=1).any(), name
            check(name, got[i][good], ref[i], base[i])


# ----------------------------------------------------------------------------- paths, determinism, bad input


def test_deterministic(device):
    """dw and db from several programs' partial rows, reduced in a fixed order: bit for bit."""
    tensors, upstream = inputs((9, 41, 341), torch.float32, device, "layer")
    assert add_norm._split(9 * 41, add_norm._config(9 * 41, 341, True).block_m, torch.device(device))[0] > 1
    first, second = (outputs_and_grads(public("layer", "triton"), tensors, upstream)[2:] for _ in range(2))
    assert all(torch.equal(a, c) for a, c in zip(first, second))


def test_no_rows(device):
    x = torch.randn(0, 8, device=device)
    w = torch.randn(8, device=device)
    y, h, rstd, mean = add_norm.add_norm_forward(x, x, w, None, 1e-6, "rms")
    assert y.shape == h.shape == (0, 8) and mean is None
    dx, dw, db = add_norm.add_norm_backward(y, None, h, w, False, rstd, None, "rms", 0.0, (True, True, True))
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8, device=device)) and db is None


def test_bad_input(device):
    x, w = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    cases = [
        (dict(x=x.double(), weight=w.double()), "float16, bfloat16 or float32"),
        (dict(residual=torch.randn(4, 7, device=device)), "residual must"),
        (dict(residual=x.half()), "residual must"),
        (dict(weight=torch.randn(7, device=device)), r"weight must be a \(8,\)"),
        (dict(bias=w), "bias must be None for kind='rms'"),
        (dict(kind="layer", bias=w.half()), "bias must be a"),
        (dict(kind="group"), "kind must be one of"),
    ]
    for change, message in cases:
        args = dict(x=x, residual=x, weight=w, bias=None, eps=1e-6, kind="rms")
        args.update(change)
        with pytest.raises(ValueError, match=message):
            add_norm.add_norm_forward(**args)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        fused_add_rms_norm(x, x[:1], w, backend="triton")
