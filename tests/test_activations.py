"""The activation table: PyTorch's own kernels, where the eager backends use them, do their math in
float32 for half inputs and round once, like the table's float32 formulas they replace."""

import pytest
import torch

from dispatch.contracts.activations import ACTIVATIONS

NATIVE = [name for name, act in ACTIVATIONS.items() if act.backward is not None]


def test_every_activation_but_squared_relu_has_native_kernels():
    assert set(NATIVE) == set(ACTIVATIONS) - {"squared_relu"}
    assert all(ACTIVATIONS[name].native for name in NATIVE)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("layout", ("contiguous", "stride-0 grad", "transposed"))
def test_native_kernels_round_once_from_float32(name, dtype, layout):
    """Forward and gradient within one unit in the last place of the table's formulas computed in
    float32 and rounded once (a kernel doing its math in the 16-bit dtype rounds at every step and
    lands several units away), and close to the float64 values."""
    act = ACTIVATIONS[name]
    z = (torch.randn(301, 67, dtype=torch.float64) * 3).to(dtype)
    g = torch.randn(301, 67, dtype=torch.float64).to(dtype)
    if layout == "stride-0 grad":
        g = g[:1].expand_as(z)
    elif layout == "transposed":
        z, g = z.t().contiguous().t(), g.t().contiguous().t()
    fz, fg = z.float(), g.float()
    info = torch.finfo(dtype)
    # float32 formulas differ from the kernels' by float32 rounding, which cancellation in the
    # gradient (gelu's near z = -0.75) makes ~1e-6 absolute; then the roundings to the dtype may fall
    # on either side of a boundary
    slack = 1e-5 if dtype == torch.float32 else 2 * info.eps
    # ... and the forward's own: gelu's 1 + erf(z / sqrt 2) cancels for z << 0 (Phi(-5) = 2.9e-7 from a
    # float32 erf near -1), ~1 float32 eps absolute times |z|: 2-5 units of float16's subnormal spacing
    # (6e-8) at z = -5, where the kernel and the formula each round their own way
    cancel = 2 * torch.finfo(torch.float32).eps * z.double().abs()
    for got, once, exact in (
        (act.forward(z), act.forward(fz).to(dtype), act.forward(z.double())),
        (act.backward(g, z), (fg * act.derivative(fz)).to(dtype), g.double() * act.derivative(z.double())),
    ):
        assert got.dtype == dtype and got.shape == z.shape
        err = (got.double() - once.double()).abs()
        bound = slack * once.double().abs() + 4e-6 * g.double().abs() + cancel + info.smallest_normal * info.eps
        assert (err <= bound).all(), (name, (err / bound).max().item())
        torch.testing.assert_close(got.double(), exact, rtol=2 * slack, atol=1e-5)
