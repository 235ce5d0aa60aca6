"""The Triton matmul behind fused_linear's calls without autograd (``infer``): its variants (TMA and
pointer) and when each is planned, the plan cache, the config knobs and the device's tile configs, the
config rule, one launch writing y alone, and cached launches reading each call's operands. Each test
asserts through ``launches`` that the matmul ran. On CPU it runs under Triton's interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dispatch.backends.triton import fused_linear as triton_op
from dispatch.backends.triton import matmul
from matmul_checks import assert_infer_matches, check_y, linear_inputs

triton_backend = pytest.importorskip("dispatch.backends.triton").BACKEND
if triton_backend.unavailable():
    pytest.skip(triton_backend.unavailable(), allow_module_level=True)


@pytest.mark.parametrize(
    "dtype, transposed",
    [(torch.bfloat16, "x"), (torch.float16, "weight")],
    ids=("bfloat16-x-column-major", "float16-weight-column-major"),
)
def test_tma_variant(dtype, transposed, device, launches):
    """Both layouts of each TMA operand between the two cases: one of x and W row-major (its
    descriptor K-major), the other stored transposed (its descriptor not); misaligned views fall
    back to "pointer"."""
    x, weight, bias = linear_inputs((48, 40), 24, dtype, device)  # 16-byte aligned rows and columns
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
    x, weight, bias = linear_inputs((37, 40), n, torch.bfloat16, device)
    with matmul.options(variant="tma", config=config):
        assert_infer_matches(launches, x, weight, bias, "gelu_tanh")
    assert launches[0].plan == (config, "tma")


@pytest.mark.parametrize("config", matmul.CONFIGS_16 + matmul.CONFIGS_32, ids=str)
def test_device_tiles(config, device, launches):
    """The device's tile configs, forced: masks hold when one tile covers the whole problem."""
    if device == "cuda":
        pytest.skip("on the GPU the gpu-marked tests run these configs at real sizes")
    x, weight, bias = linear_inputs((33, 40), 17, torch.float32, device)
    with matmul.options(config=config):
        assert_infer_matches(launches, x, weight, bias, "gelu")
    assert launches[0].plan == (config, "pointer")  # float32: TMA takes 16-bit operands only


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


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_tma_variant_gpu(launches):
    x, weight, bias = linear_inputs((2048, 1024), 4096, torch.bfloat16, "cuda")
    with matmul.options(variant="tma"):
        assert_infer_matches(launches, x, weight, bias, "gelu_tanh")
    assert launches[0].plan[1] == "tma"


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))
def test_epilogue_split_and_warp_specialize_gpu(activation, launches):
    """The TMA kernel's Config knobs at a real size on sm_90: half-tile epilogues, warp specialization."""
    config = dataclasses.replace(matmul.CONFIGS_16[0], epilogue_split=2, warp_specialize=True)
    x, weight, bias = linear_inputs((2048, 1024), 4096 - 8, torch.bfloat16, "cuda")  # N: a partial last tile
    with matmul.options(variant="tma", config=config):
        assert_infer_matches(launches, x, weight, bias, activation)
    assert launches[0].plan == (config, "tma")


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
