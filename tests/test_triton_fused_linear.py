"""Triton fused_linear against the float64 reference: outputs and every gradient.

On CPU the kernels run under Triton's interpreter with 32x16x16 tiles, so the tiny shapes here
still cross tile, group and K-block edges; ``gpu``-marked tests use real sizes and the H200 tiles.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from dispatch.backends.eager.fused_linear import reference
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


# ----------------------------------------------------------------------------- CPU (interpreter) and GPU


@pytest.mark.parametrize("mnk", ODD, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_every_activation_float32(activation, mnk, device):
    M, N, K = mnk
    x, weight, bias = _inputs((M, K), N, torch.float32, device)
    grad_y = torch.randn(M, N, device=device)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_half_dtypes(dtype, activation, device):
    x, weight, bias = _inputs((33, 40), 17, dtype, device)
    grad_y = torch.randn(33, 17, device=device).to(dtype)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_backward_recomputes_without_saved(activation, device):
    x, weight, bias = _inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(33, 17, device=device)
    y, saved = triton_op.forward(x, weight, bias, activation)
    assert (saved is None) == (activation == "identity")
    grads = triton_op.backward(grad_y, x, weight, bias, None, activation, (True, True, True))
    assert_matches(y, list(grads), x, weight, bias, activation, grad_y)


@pytest.mark.parametrize(
    "needs", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)]
)
@pytest.mark.parametrize("saved", (True, False), ids=("saved", "recompute"))
def test_only_needed_gradients(needs, saved, device):
    x, weight, bias = _inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(33, 17, device=device)
    y, pre = triton_op.forward(x, weight, bias, "relu")
    grads = triton_op.backward(grad_y, x, weight, bias, pre if saved else None, "relu", needs)
    assert_matches(y, list(grads), x, weight, bias, "relu", grad_y, needs)


@pytest.mark.parametrize("activation", ("identity", "gelu"))
def test_no_bias(activation, device):
    x, weight, _ = _inputs((33, 40), 17, torch.float32, device, bias=False)
    grad_y = torch.randn(33, 17, device=device)
    assert_matches(
        *run_api(x, weight, None, activation, grad_y),
        x,
        weight,
        None,
        activation,
        grad_y,
        (True, True, False),
    )


def test_three_dim_x(device):
    x, weight, bias = _inputs((2, 5, 24), 17, torch.float32, device)
    grad_y = torch.randn(2, 5, 17, device=device)
    assert_matches(*run_api(x, weight, bias, "gelu_tanh", grad_y), x, weight, bias, "gelu_tanh", grad_y)


@pytest.mark.parametrize("layout", ("column-major", "sliced"))
def test_non_contiguous_inputs(layout, device):
    if layout == "column-major":  # x and W stored transposed
        x = torch.randn(40, 33, device=device).t()
        weight = (torch.randn(40, 17, device=device) / 7).t()
    else:  # every other column of wider tensors
        x = torch.randn(33, 80, device=device)[:, ::2]
        weight = (torch.randn(17, 81, device=device) / 7)[:, 1::2]
    bias = torch.randn(17, device=device)
    grad_y = torch.randn(17, 33, device=device).t()
    assert not x.is_contiguous() and not weight.is_contiguous()
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


def test_empty_reduction(device):
    """K == 0: y = act(b), and the gradients of b still flow."""
    x, weight, bias = _inputs((5, 0), 3, torch.float32, device)
    grad_y = torch.randn(5, 3, device=device)
    assert_matches(*run_api(x, weight, bias, "gelu", grad_y), x, weight, bias, "gelu", grad_y)


@pytest.mark.parametrize("variant", ("tma", "tma_flat", "tma_store"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_tma_variants(variant, dtype, device):
    x, weight, bias = _inputs((33, 40), 24, dtype, device)  # 16-byte aligned rows: TMA can read every operand
    grad_y = torch.randn(33, 24, device=device).to(dtype)
    with matmul.options(variant=variant):
        assert matmul.plan(x, weight.t())[1] == variant
        assert matmul.plan(grad_y.t(), x)[1] == variant  # grad_W: a transposed (M-major) A
        assert matmul.plan(x[:, 1:], weight[:, 1:].t())[1] == "pointer"  # misaligned: falls back
        result = run_api(x, weight, bias, "gelu", grad_y)
    assert_matches(*result, x, weight, bias, "gelu", grad_y)


@pytest.mark.parametrize("n", (24, 21), ids=("aligned-rows", "odd-rows"))
def test_tma_store_writes_through_descriptors_where_rows_align(n, device, monkeypatch):
    """"tma_store": outputs whose rows are 16-byte aligned go through the descriptor-store launcher
    (forward with its pre-activation, and every backward product); others keep pointer stores. Both
    match the reference, edges included (M, N not multiples of the tiles)."""
    x, weight, bias = _inputs((37, 40), n, torch.bfloat16, device)
    grad_y = torch.randn(37, n, device=device).to(torch.bfloat16)
    used = []
    real = {name: getattr(matmul, name) for name in ("_TMA", "_TMA_STORE")}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __call__(self, *args):
            used.append(self.name)
            return real[self.name](*args)

    for name in real:
        monkeypatch.setattr(matmul, name, Spy(name))
    with matmul.options(variant="tma_store"):
        result = run_api(x, weight, bias, "gelu", grad_y)
    assert_matches(*result, x, weight, bias, "gelu", grad_y)
    if n % 8 == 0:  # forward (y and pre), grad_x, grad_W
        assert used == ["_TMA_STORE"] * 3
    else:  # y's rows are 42 bytes: pointer stores; the backward's operands rule TMA out altogether
        assert used == ["_TMA"]


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


@pytest.mark.parametrize("variant", ("tma", "tma_store"))
@pytest.mark.parametrize("n", (24, 21), ids=("aligned-rows", "odd-rows"))
def test_epilogue_split_and_warp_specialize(variant, n, device):
    """Config knobs of the TMA kernel: the epilogue on each half of a tile's columns (edges inside
    either half: N = 21 with 16-column tiles) and tl.range's warp specialization; forward with its
    pre-activation, grad_pre with the bias's column sums, and the plain products all match."""
    base = matmul.CONFIG_INTERPRETER if device == "cpu" else matmul.CONFIGS_16[0]
    config = dataclasses.replace(base, epilogue_split=2, warp_specialize=True)
    x, weight, bias = _inputs((37, 40), n, torch.bfloat16, device)
    grad_y = torch.randn(37, n, device=device).to(torch.bfloat16)
    with matmul.options(variant=variant, config=config):
        assert matmul.plan(x, weight.t())[:2] == (config, variant)
        result = run_api(x, weight, bias, "gelu_tanh", grad_y)
    assert_matches(*result, x, weight, bias, "gelu_tanh", grad_y)


@pytest.mark.parametrize("config", matmul.CONFIGS_16 + matmul.CONFIGS_32, ids=str)
def test_device_tiles(config, device):
    """The device's tile configs, forced: masks hold when one tile covers the whole problem."""
    if device == "cuda":
        pytest.skip("on the GPU the gpu-marked tests run these configs at real sizes")
    x, weight, bias = _inputs((33, 40), 17, torch.float32, device)
    grad_y = torch.randn(33, 17, device=device)
    with matmul.options(config=config):
        result = run_api(x, weight, bias, "gelu", grad_y)
    assert_matches(*result, x, weight, bias, "gelu", grad_y)


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
def test_realistic_bf16(activation):
    x, weight, bias = _inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    grad_y = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


ODD_GPU = [(torch.bfloat16, a) for a in ("leaky_relu", "squared_relu", "gelu")]  # + test_realistic_bf16's
ODD_GPU += [(d, a) for d in (torch.float16, torch.float32) for a in ("identity", "gelu_tanh")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, activation", ODD_GPU, ids=lambda v: str(v).removeprefix("torch."))
def test_odd_shape_gpu(dtype, activation):
    x, weight, bias = _inputs((1823, 341), 781, dtype, "cuda")
    grad_y = torch.randn(1823, 781, device="cuda").to(dtype)
    assert_matches(*run_api(x, weight, bias, activation, grad_y), x, weight, bias, activation, grad_y)


@pytest.mark.gpu
def test_long_reduction():
    x, weight, bias = _inputs((256, 28672), 512, torch.bfloat16, "cuda")
    grad_y = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    assert_matches(*run_api(x, weight, bias, "gelu", grad_y), x, weight, bias, "gelu", grad_y)


@pytest.mark.gpu
def test_tf32_when_allowed():
    x, weight, bias = _inputs((1024, 2048), 1536, torch.float32, "cuda")
    grad_y = torch.randn(1024, 1536, device="cuda")
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # eager uses TF32 too: the tolerance follows it
    try:
        y, grads = run_api(x, weight, bias, "gelu", grad_y)
        needs = (True, True, True)
        ref, ref_grads = _reference(x, weight, bias, "gelu", grad_y, needs, upcast=True)
        base, base_grads = _reference(x, weight, bias, "gelu", grad_y, needs, upcast=False)
        # TF32 rounds each operand to 10 mantissa bits and the two libraries accumulate in different
        # orders, so max-abs errors scatter; compare relative Frobenius errors (~3e-4 expected)
        for name, out, r, b in zip(("y", *NAMES), (y, *grads), (ref, *ref_grads), (base, *base_grads)):
            rel = float((out.double() - r).norm() / r.norm())
            rel_eager = float((b.double() - r).norm() / r.norm())
            assert rel <= max(2 * rel_eager, 1e-3), f"{name}: relative error {rel:.2e} (eager {rel_eager:.2e})"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ("tma", "tma_flat", "tma_store"))
def test_tma_variants_gpu(variant):
    x, weight, bias = _inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    grad_y = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    with matmul.options(variant=variant):
        assert matmul.plan(x, weight.t())[1] == variant
        result = run_api(x, weight, bias, "gelu_tanh", grad_y)
    assert_matches(*result, x, weight, bias, "gelu_tanh", grad_y)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ("tma", "tma_store"))
@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))
def test_epilogue_split_and_warp_specialize_gpu(variant, activation):
    """The TMA kernel's Config knobs at a real size on sm_90: half-tile epilogues, warp specialization."""
    config = dataclasses.replace(matmul.CONFIGS_16[0], epilogue_split=2, warp_specialize=True)
    x, weight, bias = _inputs((2048, 1024), 4096 - 8, torch.bfloat16, "cuda")  # N: a partial last tile
    grad_y = torch.randn(2048, 4096 - 8, device="cuda").to(torch.bfloat16)
    with matmul.options(variant=variant, config=config):
        assert matmul.plan(x, weight.t())[:2] == (config, variant)
        result = run_api(x, weight, bias, activation, grad_y)
    assert_matches(*result, x, weight, bias, activation, grad_y)


@pytest.mark.gpu
@pytest.mark.parametrize("saved", (True, False), ids=("saved", "recompute"))
def test_deterministic_gpu(saved):
    x, weight, bias = _inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    grad_y = torch.randn(2048, 4096, device="cuda").to(torch.bfloat16)
    _, pre = triton_op.forward(x, weight, bias, "gelu")
    kept = pre if saved else None
    first = triton_op.backward(grad_y, x, weight, bias, kept, "gelu", (True, True, True))
    for _ in range(3):
        again = triton_op.backward(grad_y, x, weight, bias, kept, "gelu", (True, True, True))
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_64_bit_offsets():
    """y with 2**31 elements: offsets past int32 must not wrap (checked on the last rows)."""
    x, weight, bias = _inputs((65536, 64), 32768, torch.bfloat16, "cuda")
    y, pre = triton_op.forward(x, weight, bias, "gelu")
    tail = slice(-3, None)
    ref = reference(x[tail], weight, bias, "gelu", upcast=True)
    check("y[-3:]", y[tail], ref, reference(x[tail], weight, bias, "gelu"))
    check("pre[-3:]", pre[tail], reference(x[tail], weight, bias, "identity", upcast=True))


@pytest.mark.parametrize("activation", ("gelu", "identity"))
def test_infer_writes_no_pre_activation(activation, device, monkeypatch):
    """Calls without autograd take ``infer``: the same y as forward's, bit for bit, and the matmul
    is launched without a pre-activation output."""
    x = torch.randn(9, 24, device=device)
    w = torch.randn(17, 24, device=device)
    b = torch.randn(17, device=device)
    launched = []
    launch = matmul.launch
    monkeypatch.setattr(matmul, "launch", lambda *a, **k: launched.append(k.get("pre")) or launch(*a, **k))
    y = triton_op.infer(x, w, b, activation)
    assert launched == [None]
    assert torch.equal(y, triton_op.forward(x, w, b, activation)[0])
    with torch.no_grad():
        assert torch.equal(fused_linear(x, w, b, activation, backend="triton"), y)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ("tma", "pointer"))
def test_cached_launches_read_each_calls_operands_gpu(variant):
    """Token counts of one specialization (none a multiple of 16) reuse the first call's compiled
    kernel through ``Launcher``; each call must still read its own operands (new TMA descriptors)."""
    weight = torch.randn(1536, 768, device="cuda").div(768**0.5).to(torch.bfloat16)
    bias = torch.randn(1536, device="cuda").to(torch.bfloat16)
    with matmul.options(variant=variant):
        for m in (37, 300, 1001, 37):
            x = torch.randn(m, 768, device="cuda").to(torch.bfloat16)
            y, pre = triton_op.forward(x, weight, bias, "gelu")
            ref, eager = reference(x, weight, bias, "gelu", upcast=True), reference(x, weight, bias, "gelu")
            check(f"y (M={m})", y, ref, eager)
            check(f"pre (M={m})", pre, reference(x, weight, bias, "identity", upcast=True))
    assert matmul._TMA._compiled or variant == "pointer"
