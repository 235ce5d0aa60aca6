"""Triton bias_act_dropout: outputs and gradients against the float64 reference, bitwise-deterministic
gradients, strides, bad input, the paths that skip work, and the flat kernel (16-bit, no dropout).
Masks, counters and the rows kernel: test_triton_bias_act_dropout_masks.py.

On CPU the kernels run under Triton's interpreter, so shapes stay tiny but still cross the paths that
matter: N % 8 == 0 (one Philox call per 8 elements) and not, decode shapes (one tile holds every row:
grad_bias written directly) and longer ones (per-program partial bias gradients plus a reduction).
``gpu``-marked tests use real sizes.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from dispatch.ops import bias_act_dropout as bad_spec
from dispatch.backends.triton import bias_act_dropout as triton_op
from dispatch import ACTIVATION_NAMES, fused_bias_act_dropout
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.tolerances import check
from harness import DTYPES, bias_act_inputs, op_rng

triton_backend = pytest.importorskip("dispatch.backends.triton").BACKEND
if triton_backend.unavailable():
    pytest.skip(triton_backend.unavailable(), allow_module_level=True)

TINY = ((1, 8), (7, 3), (33, 40), (5, 6, 24))
LONG = ((600, 24), (300, 13))  # backward: several row-programs, partials + reduction (N % 8 == 0 and not)


def _leaves(x, bias, needs):
    return [None if t is None else t.detach().requires_grad_(need) for t, need in zip((x, bias), needs)]


def _grads(y, leaves, grad_y) -> list[Optional[torch.Tensor]]:
    inputs = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad(y, inputs, grad_y) if inputs else ())
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]


def _reference(x, bias, activation, p, seed, grad_y, needs, upcast):
    rng = dropout_rng.draw_for(x, torch.Generator(device=x.device).manual_seed(seed)) if p > 0 else None
    leaves = _leaves(x, bias, needs)
    y = bad_spec.reference(leaves[0], leaves[1], activation, p, rng, upcast=upcast)
    return y.detach(), _grads(y, leaves, grad_y.to(y.dtype))


def assert_matches(x, bias, activation, p, seed, grad_y, needs=(True, True)):
    """The public op on triton (generator seeded ``seed``) vs the float64 reference with the same mask,
    within the tolerance set by eager PyTorch in the same dtype; gradients only where needed."""
    leaves = _leaves(x, bias, needs)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    out = fused_bias_act_dropout(leaves[0], leaves[1], activation, p, generator=gen, backend="triton")
    y, grads = out.detach(), _grads(out, leaves, grad_y)
    ref, ref_grads = _reference(x, bias, activation, p, seed, grad_y, needs, upcast=True)
    base, base_grads = _reference(x, bias, activation, p, seed, grad_y, needs, upcast=False)
    assert y.dtype == x.dtype and y.shape == x.shape
    check("y", y, ref, base)
    for name, g, r, b, t, need in zip(
        ("grad_x", "grad_bias"), grads, ref_grads, base_grads, (x, bias), needs
    ):
        if need and t is not None:
            assert g is not None and g.dtype == t.dtype and g.shape == t.shape, name
            check(name, g, r, b)
        else:
            assert g is None, f"{name} computed but not needed"


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_matches_reference(activation, dtype, device):
    for shape in TINY if activation in ("gelu", "relu") else TINY[1::2]:
        x, bias, grad_y = bias_act_inputs(shape, dtype, device)
        assert_matches(x, bias, activation, 0.2, 7, grad_y)


@pytest.mark.parametrize("shape", LONG, ids=str)
def test_long_shapes_reduce_partials(shape, device):
    x, bias, grad_y = bias_act_inputs(shape, torch.float32, device)
    cfg = triton_op.config(shape[0], shape[1], 4, backward=True)
    per_program = triton_op._rows_per_program(shape[0], cfg, -(-shape[1] // cfg.block_n), x)
    assert per_program < shape[0], "this shape should need several row-programs"
    assert_matches(x, bias, "gelu", 0.3, 3, grad_y)


@pytest.mark.parametrize(
    "needs", [(True, True), (True, False), (False, True)], ids=["x-and-bias", "x-only", "bias-only"]
)
@pytest.mark.parametrize("shape", [(5, 24), (600, 24)], ids=str)
def test_gradient_subsets(needs, shape, device):
    x, bias, grad_y = bias_act_inputs(shape, torch.float32, device)
    assert_matches(x, bias, "silu", 0.1, 5, grad_y, needs)


def test_impl_computes_only_what_is_asked(device):
    x, bias, grad_y = bias_act_inputs((9, 16), torch.float32, device)
    rng = op_rng(device)
    assert triton_op.backward(grad_y, x, bias, "gelu", 0.1, rng, False, False) == (None, None)
    gx, gb = triton_op.backward(grad_y, x, bias, "gelu", 0.1, rng, True, False)
    assert gx is not None and gb is None
    gx, gb = triton_op.backward(grad_y, x, bias, "gelu", 0.1, rng, False, True)
    assert gx is None and gb is not None and gb.dtype == bias.dtype


@pytest.mark.parametrize("shape", [(7, 3), (33, 40)], ids=str)
def test_no_bias(shape, device):
    x, _, grad_y = bias_act_inputs(shape, torch.bfloat16, device, bias=False)
    assert_matches(x, None, "gelu_tanh", 0.25, 11, grad_y, (True, None))


@pytest.mark.parametrize("training", [True, False])
def test_without_dropout_matches_reference(training, device):
    x, bias, grad_y = bias_act_inputs((5, 6, 24), torch.float16, device)
    y = fused_bias_act_dropout(x, bias, "gelu", 0.0 if training else 0.5, training, backend="triton")
    check("y", y, bad_spec.reference(x, bias, "gelu", upcast=True), bad_spec.reference(x, bias, "gelu"))
    assert_matches(x, bias, "squared_relu", 0.0, 0, grad_y)


# ----------------------------------------------------------------------------- determinism, strides


@pytest.mark.parametrize("shape", [(33, 40), (600, 24)], ids=str)
def test_gradients_bitwise_deterministic(shape, device):
    x, bias, grad_y = bias_act_inputs(shape, torch.bfloat16, device)
    rng = op_rng(device)
    first = triton_op.backward(grad_y, x, bias, "gelu", 0.1, rng, True, True)
    second = triton_op.backward(grad_y, x, bias, "gelu", 0.1, rng, True, True)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_decode_backward_is_one_launch(device, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("decode shapes must not launch the partial-sum reduction")

    monkeypatch.setattr(triton_op, "_BIAS_GRAD", forbidden)
    x, bias, grad_y = bias_act_inputs((64, 40), torch.float32, device)
    gx, gb = triton_op.backward(grad_y, x, bias, "relu", 0.1, op_rng(device), True, True)
    assert gx is not None and gb is not None


STRIDED = {
    "transposed-x": lambda t: t.t().contiguous().t(),
    "every-other-column": lambda t: torch.stack([t, t + 1], dim=-1)[..., 0],
    "expanded-row": lambda t: t[:1].expand_as(t),
    "expanded-column": lambda t: t[:, :1].expand_as(t),
}


@pytest.mark.parametrize("layout", STRIDED)
@pytest.mark.parametrize("shape", [(9, 16), (7, 3)], ids=str)
def test_strided_inputs_and_grads(layout, shape, device):
    x, bias, grad_y = bias_act_inputs(shape, torch.float32, device)
    make = STRIDED[layout]
    xs, gs = make(x), make(grad_y)
    assert not xs.is_contiguous() and not gs.is_contiguous()
    assert_matches(xs, bias, "gelu", 0.3, 2, gs)
    rng = op_rng(device)
    y = triton_op.forward(xs, bias, "identity", 0.3, rng)
    assert y.is_contiguous() and torch.equal(
        y, triton_op.forward(xs.contiguous(), bias, "identity", 0.3, rng)
    )


def test_bad_input_is_named(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        triton_op.forward(x.double(), None, "relu", 0.0, None)
    with pytest.raises(ValueError, match="bias must be a"):
        triton_op.forward(x, torch.randn(7, device=device), "relu", 0.0, None)
    with pytest.raises(ValueError, match="grad_y must have x's shape"):
        triton_op.backward(x[:2], x, None, "relu", 0.0, None, True, False)


def test_dispatcher_calls_the_unchecked_kernels(device, monkeypatch):
    """The public op validates a call once: it runs ``triton_op.KERNELS`` (no second argument check),
    with the checked functions' results; those still check when called directly."""
    x = torch.randn(5, 16, device=device, requires_grad=True)
    bias = torch.randn(16, device=device, requires_grad=True)
    grad_y = torch.randn(5, 16, device=device)

    def run() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)  # the same (seed, offset) for every run
        y = fused_bias_act_dropout(x, bias, "gelu", 0.25, backend="triton")
        return y.detach(), *torch.autograd.grad(y, (x, bias), grad_y)

    def refuse(*args):
        raise AssertionError("the op's own check ran under the dispatcher")

    monkeypatch.setattr(triton_op, "_check", refuse)
    with pytest.raises(AssertionError, match="own check"):
        triton_op.forward(x.detach(), bias.detach(), "gelu", 0.0, None)
    got = run()
    monkeypatch.undo()
    torch.manual_seed(0)
    rng = dropout_rng.draw_for(x)  # the public op's draw after that seed
    args = (x.detach(), bias.detach(), "gelu", 0.25, rng)
    expected = triton_op.forward(*args), *triton_op.backward(grad_y, *args, True, True)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_empty(device):
    x = torch.randn(0, 8, device=device)
    bias = torch.randn(8, device=device)
    assert triton_op.forward(x, bias, "gelu", 0.1, op_rng(device)).shape == (0, 8)
    gx, gb = triton_op.backward(x, x, bias, "gelu", 0.1, op_rng(device), True, True)
    assert gx.shape == (0, 8) and torch.equal(gb, torch.zeros_like(bias))


def test_gelu_and_its_derivative_are_float32_accurate(device):
    """The branch-free Phi of dispatch/backends/triton/activations.py, densely over [-12, 12] and near 0: within
    4e-7 * max(1, |z|) of float64 (libdevice's erff and torch: ~1.2e-7)."""
    z = torch.cat([torch.linspace(-12, 12, 6001), torch.linspace(-1e-3, 1e-3, 201)]).to(device).view(1, -1)
    z64 = z.double().requires_grad_()
    ref = bad_spec.reference(z64, None, "gelu", upcast=True)
    (dref,) = torch.autograd.grad(ref.sum(), z64)
    bound = 4e-7 * z.abs().clamp(min=1).double()
    y = triton_op.forward(z, None, "gelu", 0.0, None)
    gx, _ = triton_op.backward(torch.ones_like(z), z, None, "gelu", 0.0, None, True, False)
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max().item()
    assert ((gx.double() - dref).abs() <= bound).all(), (gx.double() - dref).abs().max().item()


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_flat_kernel_bit_identical_to_the_tile_kernel(activation, dtype, device, monkeypatch):
    """Contiguous 16-bit x without dropout past decode sizes takes the flat kernel (1-D, int32
    offsets, the bias gathered by column); its y equals the tile kernel's bit for bit, with and
    without bias, on a shape whose last program is partly masked, and matches the reference (real
    shapes take it past 2**24 elements)."""
    shape = (130, 48)  # 6240 elements: three full 2048-element programs and a masked one
    x, bias, _ = bias_act_inputs(shape, dtype, device)
    assert not triton_op._flat_kernel_fits(x, None, *shape)  # up to 2**24 elements the tile kernel wins
    monkeypatch.setattr(triton_op, "FLAT_MIN_ELEMENTS", 0)  # the flat kernel itself, on a small shape
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    for b in (bias, None):
        assert triton_op._flat_kernel_fits(x, None, *shape)
        y = triton_op.forward(x, b, activation, 0.0, None)
        with monkeypatch.context() as patched:
            patched.setattr(triton_op, "_flat_kernel_fits", lambda *args: False)
            tiled = triton_op.forward(x, b, activation, 0.0, None)
        assert torch.equal(y.view(torch.int16), tiled.view(torch.int16))
    assert_matches(x[1:], bias, activation, 0.0, 0, torch.randn_like(x[1:]))
    assert not triton_op._flat_kernel_fits(x, op_rng(device), *shape)  # dropout: the rows kernel
    assert not triton_op._flat_kernel_fits(x.t(), None, 48, 130)  # strided
    assert not triton_op._flat_kernel_fits(x.float(), None, *shape)  # 32-bit elements
    assert not triton_op._flat_kernel_fits(x[:64], None, 64, 48)  # decode: one tile
    assert not triton_op._flat_kernel_fits(x[:, :40].contiguous(), None, 130, 40)  # rows of 2.5 groups
    off = x.new_empty(130 * 48 + 4)[4:].view(130, 48)  # 8-byte aligned
    assert off.is_contiguous() and not triton_op._flat_kernel_fits(off, None, *shape)
    assert not triton_op._flat_kernel_fits(x, None, 2**26, 2**5)  # offsets past int32


# ----------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(3, 65536), (1000, 11008), (517, 5000), (333, 1001), (64, 4096), (65536, 768)], ids=str
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_gpu_shapes_match_reference(shape, dtype):
    x, bias, grad_y = bias_act_inputs(shape, dtype, "cuda")
    assert_matches(x, bias, "gelu", 0.1, 8, grad_y)
