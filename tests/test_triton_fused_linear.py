"""Triton fused_linear against the float64 reference: outputs and every gradient.

On CPU the kernels run under Triton's interpreter with 32x16x16 tiles, so the tiny shapes here
still cross tile, group and K-block edges; ``gpu``-marked tests use real sizes and the H200 tiles.

Calls with autograd (``run_api``) run torch.mm and bias_act_dropout's kernels; only calls without it
(``infer``) run the Triton matmul (``matmul.py``), so tests of the matmul check y without autograd
(``assert_infer_matches``), and each asserts through ``launches`` that the matmul ran.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from dispatch.ops.fused_linear import reference
from dispatch.backends.triton import fused_linear as triton_op
from dispatch.backends.triton import matmul
from dispatch import ACTIVATION_NAMES, fused_linear
from dispatch.contracts.tolerances import check

triton_backend = pytest.importorskip("dispatch.backends.triton").BACKEND
if triton_backend.unavailable():
    pytest.skip(triton_backend.unavailable(), allow_module_level=True)

NAMES = ("grad_x", "grad_weight", "grad_bias")
ODD = ((1, 1, 1), (7, 5, 3), (33, 17, 40))  # (M, N, K)


def _inputs(x_shape, n, dtype, device, bias=True):
    k = x_shape[-1]
    x = torch.randn(x_shape, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, weight, b


def _grads(y, leaves, grad_y) -> list[Optional[torch.Tensor]]:
    inputs = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad(y, inputs, grad_y) if inputs else ())
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]


def _reference(x, weight, bias, activation, grad_y, needs, upcast):
    leaves = [
        None if t is None else t.detach().requires_grad_(need) for t, need in zip((x, weight, bias), needs)
    ]
    y = reference(*leaves, activation, upcast=upcast)
    return y.detach(), _grads(y, leaves, grad_y.to(y.dtype))


def assert_matches(y, grads, x, weight, bias, activation, grad_y, needs=(True, True, True)):
    """y and grads (x, weight, bias order; None where not needed) vs the float64 reference, with the
    tolerance set by eager PyTorch in the same dtype."""
    ref, ref_grads = _reference(x, weight, bias, activation, grad_y, needs, upcast=True)
    base, base_grads = _reference(x, weight, bias, activation, grad_y, needs, upcast=False)
    assert y.dtype == x.dtype and y.shape == ref.shape
    check("y", y, ref, base)
    for name, g, r, b, t, need in zip(NAMES, grads, ref_grads, base_grads, (x, weight, bias), needs):
        if need and t is not None:
            assert g is not None and g.dtype == t.dtype, f"{name}: {None if g is None else g.dtype}"
            check(name, g, r, b)
        else:
            assert g is None, f"{name} was not needed but was computed"


def run_api(x, weight, bias, activation, grad_y):
    leaves = [None if t is None else t.detach().requires_grad_() for t in (x, weight, bias)]
    y = fused_linear(*leaves, activation, backend="triton")
    return y.detach(), _grads(y, leaves, grad_y)


@pytest.fixture
def launches(monkeypatch):
    """The Triton matmul's launches during the test: (config, variant) that ran, output c, keywords."""
    calls = []
    launch = matmul.launch

    def counted(a, b, c, **kwargs):
        calls.append(SimpleNamespace(plan=matmul.plan(a, b)[:2], out=c, kwargs=kwargs))
        return launch(a, b, c, **kwargs)

    monkeypatch.setattr(matmul, "launch", counted)
    return calls


def check_y(name, y, x, weight, bias, activation):
    """y alone vs the float64 reference, with the tolerance set by eager PyTorch in the same dtype."""
    assert y.dtype == x.dtype
    ref, eager = reference(x, weight, bias, activation, upcast=True), reference(x, weight, bias, activation)
    check(name, y, ref, eager)


def assert_infer_matches(launches, x, weight, bias, activation, name="y (infer)"):
    """A call without autograd (``infer``) launches the Triton matmul once, and its y matches the
    reference. Returns y."""
    before = len(launches)
    with torch.no_grad():
        y = fused_linear(x, weight, bias, activation, backend="triton")
    assert len(launches) == before + 1, f"{name}: {len(launches) - before} Triton matmul launches, not 1"
    check_y(name, y, x, weight, bias, activation)
    return y


# ----------------------------------------------------------------------------- CPU (interpreter) and GPU


@pytest.mark.parametrize("mnk", ODD, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_every_activation_float32(activation, mnk, device, launches):
    """y and gradients with autograd; y without (the Triton matmul) at the shapes inside one tile:
    its epilogue is elementwise, so each activation needs one launch, and the tests below cover the
    tile, group and K edges of 33 x 17 x 40 (a 4-program launch, the interpreter's dearest here)."""
    M, N, K = mnk
    x, weight, bias = _inputs((M, K), N, torch.float32, device)
    grad_y = torch.randn(M, N, device=device)
    if mnk != ODD[-1]:
        assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_half_dtypes(dtype, activation, device, launches):
    x, weight, bias = _inputs((33, 40), 17, dtype, device)
    grad_y = torch.randn(33, 17, device=device).to(dtype)
    if activation == "silu":  # one matmul launch per dtype: its epilogue computes in float32 in either
        assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.parametrize(
    "needs", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)]
)
def test_only_needed_gradients(needs, device):
    x, weight, bias = _inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(33, 17, device=device)
    y, pre = triton_op.forward(x, weight, bias, "relu")
    grads = triton_op.backward(grad_y, x, weight, bias, pre, "relu", needs)
    assert_matches(y, list(grads), x, weight, bias, "relu", grad_y, needs)


@pytest.mark.parametrize("activation", ("identity", "gelu"))
def test_no_bias(activation, device, launches):
    x, weight, _ = _inputs((33, 40), 17, torch.float32, device, bias=False)
    grad_y = torch.randn(33, 17, device=device)
    if activation == "gelu":  # the matmul without a bias: one launch covers it
        assert_infer_matches(launches, x, weight, None, activation)
    assert_matches(
        *run_api(x, weight, None, activation, grad_y),
        x,
        weight,
        None,
        activation,
        grad_y,
        (True, True, False),
    )


def test_three_dim_x(device, launches):
    x, weight, bias = _inputs((2, 5, 24), 17, torch.float32, device)
    grad_y = torch.randn(2, 5, 17, device=device)
    assert_infer_matches(launches, x, weight, bias, "gelu_tanh")
    assert_matches(*run_api(x, weight, bias, "gelu_tanh", grad_y), x, weight, bias, "gelu_tanh", grad_y)


@pytest.mark.parametrize("layout", ("column-major", "sliced"))
def test_non_contiguous_inputs(layout, device, launches):
    if layout == "column-major":  # x and W stored transposed
        x = torch.randn(40, 33, device=device).t()
        weight = (torch.randn(40, 17, device=device) / 7).t()
    else:  # every other column of wider tensors
        x = torch.randn(33, 80, device=device)[:, ::2]
        weight = (torch.randn(17, 81, device=device) / 7)[:, 1::2]
    bias = torch.randn(17, device=device)
    grad_y = torch.randn(17, 33, device=device).t()
    assert not x.is_contiguous() and not weight.is_contiguous()
    assert_infer_matches(launches, x, weight, bias, "silu")
    assert_matches(*run_api(x, weight, bias, "silu", grad_y), x, weight, bias, "silu", grad_y)


@pytest.mark.parametrize("activation", ("identity", "gelu"))
def test_stride_zero_grad(activation, device):
    x, weight, bias = _inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(1, 17, device=device).expand(33, 17)  # e.g. the gradient of y.sum(0)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


def test_empty_rows(device):
    x, weight, bias = _inputs((0, 8), 5, torch.float32, device)
    y, saved = triton_op.forward(x, weight, bias, "gelu")
    assert y.shape == (0, 5) and saved.shape == (0, 5)
    grad_x, grad_w, grad_b = triton_op.backward(y, x, weight, bias, saved, "gelu", (True, True, True))
    assert grad_x.shape == (0, 8)
    assert torch.equal(grad_w, torch.zeros_like(weight)) and torch.equal(grad_b, torch.zeros_like(bias))


def test_empty_reduction(device, launches):
    """K == 0: y = act(b), and the gradients of b still flow. Called directly: the public call sends
    empty inputs to the reference, not to a backend."""
    x, weight, bias = _inputs((5, 0), 3, torch.float32, device)
    grad_y = torch.randn(5, 3, device=device)
    y = triton_op.infer(x, weight, bias, "gelu")
    assert len(launches) == 1
    check_y("y (infer)", y, x, weight, bias, "gelu")
    y, saved = triton_op.forward(x, weight, bias, "gelu")
    grads = triton_op.backward(grad_y, x, weight, bias, saved, "gelu", (True, True, True))
    assert_matches(y, list(grads), x, weight, bias, "gelu", grad_y)


@pytest.mark.parametrize(
    "dtype, transposed",
    [(torch.bfloat16, "x"), (torch.float16, "weight")],
    ids=("bfloat16-x-column-major", "float16-weight-column-major"),
)
def test_tma_variant(dtype, transposed, device, launches):
    """Both layouts of each TMA operand between the two cases: one of x and W row-major (its
    descriptor K-major), the other stored transposed (its descriptor not); misaligned views fall
    back to "pointer"."""
    x, weight, bias = _inputs((48, 40), 24, dtype, device)  # 16-byte aligned rows and columns
    if transposed == "x":
        x = x.t().contiguous().t()
    else:
        weight = weight.t().contiguous().t()
    layouts = (transposed != "x", transposed == "x")  # (x K-major, W^T K-major: W row-major)
    with matmul.options(variant="tma"):
        assert matmul.plan(x, weight.t())[1:] == ("tma", layouts)
        shifted = x[:, 1:] if layouts[0] else x[1:]  # one element along the unit stride: misaligned
        assert matmul.plan(shifted, weight.t())[1] == "pointer"
        assert_infer_matches(launches, x, weight, bias, "gelu")
    assert launches[0].plan[1] == "tma"


def test_plan_cache_tells_layouts_and_alignment_apart(device):
    """plan() is cached by shapes, strides, dtype, device and alignment: every operand layout gets the
    uncached answer, misaligned views included, and forced options bypass the cache."""
    x = torch.randn(40, 48, device=device).to(torch.bfloat16)
    w = torch.randn(24, 48, device=device).to(torch.bfloat16)
    cases = [(x, w.t()), (x.t(), x), (x[:, 1:], w[:, 1:].t()), (x[1:], w.t()), (x.float(), w.float().t())]
    for _ in range(2):  # the second pass reads the cache
        for a, b in cases:
            assert matmul.plan(a, b) == matmul._plan(a, b)
    assert matmul.plan(x[:, 1:], w[:, 1:].t())[1] == "pointer"
    with matmul.options(variant="pointer"):
        assert matmul.plan(x, w.t())[1] == "pointer"
    assert matmul.plan(x, w.t())[1] == matmul.DEFAULT_VARIANT


@pytest.mark.parametrize("n", (24, 21), ids=("aligned-rows", "odd-rows"))
def test_epilogue_split_and_warp_specialize(n, device, launches):
    """Config knobs of the TMA kernel: the epilogue on each half of a tile's columns (edges inside
    either half: N = 21 with 16-column tiles) and tl.range's warp specialization; y matches."""
    base = matmul.CONFIG_INTERPRETER if device == "cpu" else matmul.CONFIGS_16[0]
    config = dataclasses.replace(base, epilogue_split=2, warp_specialize=True)
    x, weight, bias = _inputs((37, 40), n, torch.bfloat16, device)
    with matmul.options(variant="tma", config=config):
        assert_infer_matches(launches, x, weight, bias, "gelu_tanh")
    assert launches[0].plan == (config, "tma")


@pytest.mark.parametrize("config", matmul.CONFIGS_16 + matmul.CONFIGS_32, ids=str)
def test_device_tiles(config, device, launches):
    """The device's tile configs, forced: masks hold when one tile covers the whole problem."""
    if device == "cuda":
        pytest.skip("on the GPU the gpu-marked tests run these configs at real sizes")
    x, weight, bias = _inputs((33, 40), 17, torch.float32, device)
    with matmul.options(config=config):
        assert_infer_matches(launches, x, weight, bias, "gelu")
    assert launches[0].plan == (config, "pointer")  # float32: TMA takes 16-bit operands only


def test_deterministic(device):
    x, weight, bias = _inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(33, 17, device=device)
    first = run_api(x, weight, bias, "gelu", grad_y)
    second = run_api(x, weight, bias, "gelu", grad_y)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_config_rule():
    """Fixed H200 picks (132 SMs), and every config fits Hopper's 227 KiB of shared memory."""
    pick = {
        (M, N): str(matmul.best_config(M, N, matmul.CONFIGS_16, 132))
        for M, N in ((2048, 3072), (8192, 16384), (128, 3072))
    }
    assert pick == {
        (2048, 3072): "128x128x64/w8/s4",
        (8192, 16384): "128x256x64/w8/s3",
        (128, 3072): "64x128x64/w4/s4/c2",
    }
    for cfg, size in [(c, 2) for c in matmul.CONFIGS_16] + [(c, 4) for c in matmul.CONFIGS_32]:
        smem = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * size
        assert smem * cfg.ctas_per_sm <= 227 * 1024, f"{cfg} needs {smem} bytes per program"


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ("identity", "relu", "gelu", "gelu_tanh", "silu"))
def test_realistic_bf16(activation, launches):
    x, weight, bias = _inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    grad_y = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


ODD_GPU = [(torch.bfloat16, a) for a in ("leaky_relu", "squared_relu", "gelu")]  # + test_realistic_bf16's
ODD_GPU += [(d, a) for d in (torch.float16, torch.float32) for a in ("identity", "gelu_tanh")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, activation", ODD_GPU, ids=lambda v: str(v).removeprefix("torch."))
def test_odd_shape_gpu(dtype, activation, launches):
    x, weight, bias = _inputs((1823, 341), 781, dtype, "cuda")
    grad_y = torch.randn(1823, 781, device="cuda").to(dtype)
    assert_infer_matches(launches, x, weight, bias, activation)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.gpu
def test_long_reduction(launches):
    x, weight, bias = _inputs((256, 28672), 512, torch.bfloat16, "cuda")
    grad_y = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    assert_infer_matches(launches, x, weight, bias, "gelu")
    assert_matches(*run_api(x, weight, bias, "gelu", grad_y), x, weight, bias, "gelu", grad_y)


@pytest.mark.gpu
def test_tf32_when_allowed(launches):
    x, weight, bias = _inputs((1024, 2048), 1536, torch.float32, "cuda")
    grad_y = torch.randn(1024, 1536, device="cuda")
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # eager uses TF32 too: the tolerance follows it
    try:
        with torch.no_grad():
            y_infer = fused_linear(x, weight, bias, "gelu", backend="triton")  # the Triton matmul, "tf32"
        assert len(launches) == 1
        y, grads = run_api(x, weight, bias, "gelu", grad_y)
        needs = (True, True, True)
        ref, ref_grads = _reference(x, weight, bias, "gelu", grad_y, needs, upcast=True)
        base, base_grads = _reference(x, weight, bias, "gelu", grad_y, needs, upcast=False)
        # TF32 rounds each operand to 10 mantissa bits and the two libraries accumulate in different
        # orders, so max-abs errors scatter; compare relative Frobenius errors (~3e-4 expected)
        names, outs = ("y (infer)", "y", *NAMES), (y_infer, y, *grads)
        for name, out, r, b in zip(names, outs, (ref, ref, *ref_grads), (base, base, *base_grads)):
            rel = float((out.double() - r).norm() / r.norm())
            rel_eager = float((b.double() - r).norm() / r.norm())
            assert rel <= max(2 * rel_eager, 1e-3), f"{name}: relative error {rel:.2e} (eager {rel_eager:.2e})"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
def test_tma_variant_gpu(launches):
    x, weight, bias = _inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    with matmul.options(variant="tma"):
        assert_infer_matches(launches, x, weight, bias, "gelu_tanh")
    assert launches[0].plan[1] == "tma"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))
def test_epilogue_split_and_warp_specialize_gpu(activation, launches):
    """The TMA kernel's Config knobs at a real size on sm_90: half-tile epilogues, warp specialization."""
    config = dataclasses.replace(matmul.CONFIGS_16[0], epilogue_split=2, warp_specialize=True)
    x, weight, bias = _inputs((2048, 1024), 4096 - 8, torch.bfloat16, "cuda")  # N: a partial last tile
    with matmul.options(variant="tma", config=config):
        assert_infer_matches(launches, x, weight, bias, activation)
    assert launches[0].plan == (config, "tma")


@pytest.mark.gpu
def test_deterministic_gpu():
    x, weight, bias = _inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    grad_y = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    _, pre = triton_op.forward(x, weight, bias, "gelu")
    first = triton_op.backward(grad_y, x, weight, bias, pre, "gelu", (True, True, True))
    for _ in range(3):
        again = triton_op.backward(grad_y, x, weight, bias, pre, "gelu", (True, True, True))
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_64_bit_offsets(launches):
    """y with 2**31 elements: offsets past int32 must not wrap (checked on the last rows), in infer's
    matmul epilogue and in forward's bias + activation pass."""
    x, weight, bias = _inputs((65536, 64), 32768, torch.bfloat16, "cuda")
    tail = slice(-3, None)
    y = triton_op.infer(x, weight, bias, "gelu")
    assert len(launches) == 1
    check_y("infer y[-3:]", y[tail], x[tail], weight, bias, "gelu")
    del y
    y, _ = triton_op.forward(x, weight, bias, "gelu")
    check_y("forward y[-3:]", y[tail], x[tail], weight, bias, "gelu")


@pytest.mark.parametrize("activation", ("gelu", "identity"))
def test_infer_writes_no_pre_activation(activation, device, launches):
    """Calls without autograd take ``infer``: one matmul launch whose only output is y (no
    pre-activation); its y and forward's (torch.mm + the bias_act pass, another kernel) both match
    the reference."""
    x = torch.randn(9, 24, device=device)
    w = torch.randn(17, 24, device=device)
    b = torch.randn(17, device=device)
    y = assert_infer_matches(launches, x, w, b, activation)
    assert launches[0].out is y  # written once, straight into the returned y
    assert set(launches[0].kwargs) == {"activation", "bias"}  # launch has no other output to ask for
    y_forward, saved = triton_op.forward(x, w, b, activation)
    assert len(launches) == 1  # forward does not use the Triton matmul
    assert (saved is None) == (activation == "identity")
    check_y("y (forward)", y_forward, x, w, b, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ("tma", "pointer"))
def test_cached_launches_read_each_calls_operands_gpu(variant, launches):
    """Token counts of one specialization (none a multiple of 16) reuse the first call's compiled
    kernel through ``Launcher``; each call must still read its own operands (new TMA descriptors)."""
    weight = torch.randn(1536, 768, device="cuda").div(768**0.5).to(torch.bfloat16)
    bias = torch.randn(1536, device="cuda").to(torch.bfloat16)
    with matmul.options(variant=variant):
        for m in (37, 300, 1001, 37):
            x = torch.randn(m, 768, device="cuda").to(torch.bfloat16)
            assert_infer_matches(launches, x, weight, bias, "gelu", name=f"y (M={m})")
    assert [c.plan[1] for c in launches] == [variant] * 4
    assert matmul._TMA._compiled or variant == "pointer"
