"""The compiled backends: nvfuser (functorch + TorchScript), inductor (torch.compile) and cublaslt.

Outputs and every gradient against the float64 reference (``dispatch.contracts.tolerances``), dropout masks
bit-identical to eager's and regenerated identically in backward, compile caches keyed by shape,
inductor's dynamic token dimension, honest declarations. Compiling is slow on a small CPU (inductor:
~5 s per graph, ~30 s for a dropout graph), so the CPU grid is small; the GPU tests cover more.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dispatch.backends.eager import bias_act_dropout as eager_bad
from dispatch.backends.eager import fused_linear as eager_fl
from dispatch.ops import fused_linear as linear_spec
from dispatch.backends.inductor import compiler as inductor_compiler
from dispatch.backends.nvfuser import compiler as nvfuser_compiler
from dispatch import explain, fused_bias_act_dropout, fused_linear
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.contracts.compiled import CompileNotice
from dispatch.registry import backends
from harness import (
    BIAS_ACT_DROPOUT_GRADS,
    FUSED_LINEAR_GRADS,
    check_detached,
    generator,
    grads as leaf_grads,
    leaf,
    reference_bias_act_dropout,
    reference_fused_linear,
    run_bias_act_dropout,
    run_fused_linear,
)

COMPILED = ("nvfuser", "inductor")
GEN_SEED = 20261130


@pytest.fixture(autouse=True)
def no_warnings():
    """No warning of any kind (TorchScript's deprecations above all) may reach the user."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # torch's own once-per-process note when cuBLAS first sets its context: not ours to silence
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS")
        # the notice of a compile past a second is ours and meant for the user
        warnings.filterwarnings("ignore", category=CompileNotice)
        yield
    assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]


def _bias_act_dropout_case(backend, shape, dtype, activation, p, device, bias=True):
    """Runs the op on ``backend`` and on eager with the same dropout draw; checks output and grads
    against float64. Returns (y, grads, eager_y, eager_grads) for exactness checks."""
    x = torch.randn(shape, device=device, dtype=dtype)
    b = torch.randn(shape[-1], device=device, dtype=dtype) if bias else None
    grad_y = torch.randn(shape, device=device, dtype=dtype)
    results = {}
    for name in (backend, "eager"):
        xs, bs = leaf(x), None if b is None else leaf(b)
        results[name] = run_bias_act_dropout(name, xs, bs, activation, p, grad_y, GEN_SEED)
    x64, b64 = leaf(x, torch.float64), None if b is None else leaf(b, torch.float64)
    ref, ref_grads = reference_bias_act_dropout(x64, b64, activation, p, grad_y, True, GEN_SEED)
    (y, grads), (ey, egrads) = results[backend], results["eager"]
    assert y.shape == shape and y.dtype == dtype
    check_detached(f"{backend} y", y, ref, ey)
    for name, g, r, e in zip(BIAS_ACT_DROPOUT_GRADS, grads, ref_grads, egrads):
        if g is not None:
            check_detached(f"{backend} {name}", g, r, e)
    return y, grads, ey, egrads


def _fused_linear_case(backend, x_shape, n, dtype, activation, device, bias=True):
    k = x_shape[-1]
    x = torch.randn(x_shape, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    b = torch.randn(n, device=device, dtype=dtype) if bias else None
    grad_y = torch.randn(*x_shape[:-1], n, device=device, dtype=dtype)
    results = {}
    for name in (backend, "eager"):
        xs, ws, bs = leaf(x), leaf(w), None if b is None else leaf(b)
        results[name] = run_fused_linear(name, xs, ws, bs, activation, grad_y)
    x64, w64 = leaf(x, torch.float64), leaf(w, torch.float64)
    b64 = None if b is None else leaf(b, torch.float64)
    ref, ref_grads = reference_fused_linear(x64, w64, b64, activation, grad_y, upcast=True)
    (y, grads), (ey, egrads) = results[backend], results["eager"]
    assert y.shape == (*x_shape[:-1], n) and y.dtype == dtype
    check_detached(f"{backend} y", y, ref, ey)
    for name, g, r, e in zip(FUSED_LINEAR_GRADS, grads, ref_grads, egrads):
        if g is not None:
            check_detached(f"{backend} {name}", g, r, e)


def _nonzero(t):
    return torch.where(t == 0, torch.ones_like(t), t)


def _dropout_masks(backend, shape, dtype, p, device):
    """Identity activation, no bias: y = keep * x * scale and grad_x = keep * grad_y * scale, so both
    masks can be read off; returns (forward mask, backward mask, eager's mask, y, eager's y, grad_x,
    eager's grad_x)."""
    # torch.randn returns an exact 0.0 about once in 5 million float32 draws: a zero x or grad_y at a
    # kept element would read as "dropped" (that, not the backends, failed this test on the H200)
    x = _nonzero(torch.randn(shape, device=device, dtype=dtype))
    grad_y = _nonzero(torch.randn(shape, device=device, dtype=dtype))
    out = {}
    for name in (backend, "eager"):
        xs = leaf(x)
        y = fused_bias_act_dropout(xs, None, "identity", p, generator=generator(device, GEN_SEED), backend=name)
        (grad_x,) = leaf_grads(y, (xs,), grad_y)
        out[name] = (y, grad_x)
    rng = dropout_rng.draw_for(x, generator(device, GEN_SEED))
    m = x.numel() // shape[-1]
    keep = dropout_rng.keep_mask(rng, m, shape[-1], p, x.device).view(shape)
    (y, gx), (ey, egx) = out[backend], out["eager"]
    return y != 0, gx != 0, keep, y, ey, gx, egx


# ----------------------------------------------------------------------------- nvfuser (CPU)


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_nvfuser_bias_act_dropout_every_activation(activation):
    _bias_act_dropout_case("nvfuser", (33, 40), torch.float32, activation, 0.0, "cpu")


@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_nvfuser_fused_linear_every_activation(activation):
    _fused_linear_case("nvfuser", (33, 40), 24, torch.float32, activation, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfuser_half_dtypes_3d(dtype):
    _bias_act_dropout_case("nvfuser", (2, 9, 40), dtype, "gelu", 0.0, "cpu")
    _fused_linear_case("nvfuser", (2, 9, 40), 24, dtype, "gelu_tanh", "cpu", bias=False)


def test_nvfuser_dropout_3d_gelu():
    _bias_act_dropout_case("nvfuser", (2, 9, 40), torch.float32, "gelu", 0.3, "cpu")


# ----------------------------------------------------------------------------- inductor (CPU)


def test_inductor_bias_act_dropout_bf16_3d():
    _bias_act_dropout_case("inductor", (2, 9, 40), torch.bfloat16, "gelu", 0.0, "cpu")


def test_inductor_fused_linear_relu_then_new_token_count():
    _fused_linear_case("inductor", (33, 40), 24, torch.float32, "relu", "cpu")
    before = inductor_compiler.cache_info().compiles
    _fused_linear_case("inductor", (2, 9, 40), 24, torch.float32, "relu", "cpu")  # M = 18: same graphs
    assert inductor_compiler.cache_info().compiles == before


# ----------------------------------------------------------------------------- dropout, both


@pytest.mark.parametrize("backend", COMPILED)
def test_dropout_bit_identical_to_eager_and_backward_mask_is_forward_mask(backend):
    from torch._dynamo.utils import counters

    for i, shape in enumerate([(33, 40), (7, 40)]):
        graphs = counters["stats"]["unique_graphs"]
        compiles = inductor_compiler.cache_info().compiles
        fwd_mask, bwd_mask, keep, y, ey, gx, egx = _dropout_masks(backend, shape, torch.float32, 0.25, "cpu")
        assert torch.equal(fwd_mask, keep), f"{backend}: forward mask differs from dispatch.contracts.rng's"
        assert torch.equal(bwd_mask, fwd_mask), f"{backend}: backward regenerated a different mask"
        assert torch.equal(y, ey) and torch.equal(gx, egx), f"{backend}: not bit-identical to eager"
        assert 0.15 < 1 - keep.float().mean().item() < 0.35
        if backend == "inductor":  # compiled for M = 33 (no silent eager), reused for new M
            assert (counters["stats"]["unique_graphs"] > graphs) == (i == 0)
            assert (inductor_compiler.cache_info().compiles > compiles) == (i == 0)


# ----------------------------------------------------------------------------- nvfuser's cache and fuser


def test_nvfuser_cache_keyed_by_shape_and_bounded(monkeypatch):
    monkeypatch.setattr(nvfuser_compiler, "CACHE_LIMIT", 2)
    nvfuser_compiler.clear_cache()
    before = nvfuser_compiler.cache_info().compiles
    shapes = [(5, 16), (6, 16), (5, 24)]
    for i, shape in enumerate(shapes):  # each shape compiles its own graph and gets its own result
        x = torch.randn(shape)
        y = fused_bias_act_dropout(x, None, "silu", backend="nvfuser")
        torch.testing.assert_close(y, eager_bad.forward(x, None, "silu", 0.0, None))
        assert nvfuser_compiler.cache_info().compiles == before + i + 1
    assert nvfuser_compiler.cache_info().size == 2
    fused_bias_act_dropout(torch.randn(shapes[-1]), None, "silu", backend="nvfuser")  # cached
    assert nvfuser_compiler.cache_info().compiles == before + 3
    fused_bias_act_dropout(torch.randn(shapes[0]), None, "silu", backend="nvfuser")  # evicted
    assert nvfuser_compiler.cache_info().compiles == before + 4


def test_nvfuser_reports_the_fuser_that_runs():
    fused_bias_act_dropout(torch.randn(9, 16), None, "relu", backend="nvfuser")
    name = backends()["nvfuser"].display_name()
    assert name.startswith("nvfuser (functorch+TorchScript, fuser: ")
    graphs, fused = nvfuser_compiler.observed_fusers("cpu")
    assert graphs >= 1
    seen = ", ".join(f"{fuser} (fused {n} of {graphs} graphs)" for fuser, n in fused.items())
    assert f"{seen or f'none (0 of {graphs} graphs fused)'} on cpu" in name
    text = str(explain("fused_bias_act_dropout", torch.randn(4, 8), backend="nvfuser"))
    assert "runs on: nvfuser (functorch+TorchScript" in text


@pytest.fixture
def nnc_on_cpu():
    """NNC fusion on CPU through its IR interpreter (this torch has no LLVM): the same lowering as on
    CUDA, with a slow backend."""
    saved = torch._C._jit_can_fuse_on_cpu(), torch._C._jit_get_te_must_use_llvm_cpu()
    torch._C._jit_override_can_fuse_on_cpu(True)
    torch._C._jit_set_te_must_use_llvm_cpu(False)
    yield
    torch._C._jit_override_can_fuse_on_cpu(saved[0])
    torch._C._jit_set_te_must_use_llvm_cpu(saved[1])


def test_nvfuser_nnc_keeps_the_int64_philox_exact(nnc_on_cpu):
    before = nvfuser_compiler.observed_fusers("cpu")[1].get("NNC", 0)
    fwd_mask, bwd_mask, keep, y, ey, gx, egx = _dropout_masks("nvfuser", (29, 24), torch.float32, 0.5, "cpu")
    assert nvfuser_compiler.observed_fusers("cpu")[1].get("NNC", 0) >= before + 2, "NNC fused nothing"
    assert torch.equal(fwd_mask, keep) and torch.equal(bwd_mask, keep)
    assert torch.equal(y, ey) and torch.equal(gx, egx)


def test_nvfuser_fuser_query_prints_no_deprecation(capfd):
    """The fuser is read from TorchScript's flags; nvFuser's deprecated switches, which print a
    warning from C++ straight to stderr, are never touched."""
    backends()["nvfuser"].display_name()
    cpu = nvfuser_compiler.configured_fuser("cpu")
    assert nvfuser_compiler.configured_fuser("cuda") in ("NNC", "none")
    nnc_on_cpu = torch._C._jit_texpr_fuser_enabled() and torch._C._jit_can_fuse_on_cpu()
    assert cpu == "NNC" if nnc_on_cpu else cpu.startswith("none")
    assert "nvfuser" not in capfd.readouterr().err.lower()


# ----------------------------------------------------------------------------- cublaslt


def test_cublaslt_declared_unavailable_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    text = str(explain("fused_linear", x, w, None, "relu"))
    assert "cublaslt: cublaslt needs a CUDA device" in text
    with pytest.raises(ValueError, match="cublaslt needs a CUDA device"):
        fused_linear(x, w, None, "relu", backend="cublaslt")


def test_cublaslt_declarations():
    backend = backends()["cublaslt"]
    assert set(backend.kernels) == {"fused_linear"}
    assert backend.devices == {"cuda"} and backend.activations == {"relu", "gelu_tanh"}
    call = linear_spec.SPEC.call(torch.device("cuda"), torch.bfloat16, (1, 64, 32), True, activation="relu")
    (reason,) = backend.extra_reasons(call, True)
    assert "M, N and K > 1" in reason and "M=1" in reason


def test_cublaslt_relu_math_on_cpu():
    """CPU's _addmm_activation runs relu like CUDA's unfused fallback: checks our forward/backward glue
    (zero bias; relu keeps its output, and backward from it or from a recomputed pre-activation) without
    a GPU. Its gelu is erf GELU on CPU, not tested."""
    from dispatch.backends.cublaslt import fused_linear as cublaslt_fl

    for bias in (True, False):
        x = torch.randn(33, 40, dtype=torch.float64)
        w = torch.randn(24, 40, dtype=torch.float64)
        b = torch.randn(24, dtype=torch.float64) if bias else None
        y, saved = cublaslt_fl.forward(x, w, b, "relu")
        assert saved is y
        torch.testing.assert_close(y, linear_spec.reference(x, w, b, "relu"))
        g = torch.randn_like(y)
        leaves = [leaf(x), leaf(w)] + ([leaf(b)] if bias else [])
        want = leaf_grads(linear_spec.reference(*leaves[:2], leaves[2] if bias else None, "relu"), leaves, g)
        for kept in (saved, None):
            got = cublaslt_fl.backward(g, x, w, b, kept, "relu", (True, True, bias))
            for a, e in zip([t for t in got if t is not None], want):
                torch.testing.assert_close(a, e)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_cublaslt_parity_gpu(activation, dtype):
    for bias in (True, False):
        _fused_linear_case("cublaslt", (257, 384), 512, dtype, activation, "cuda", bias=bias)
    _fused_linear_case("cublaslt", (3, 33, 128), 96, dtype, activation, "cuda")


@pytest.mark.gpu
def test_cublaslt_single_row_refused_gpu():
    x, w = torch.randn(1, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    assert "M, N and K > 1" in str(explain("fused_linear", x, w, None, "relu"))


@pytest.mark.gpu
def test_cublaslt_inside_torch_compile_gpu():
    """Under torch.compile the op is a custom op whose fake promises an (M, N) pre-activation for
    backward; cublaslt returns none, so the spec's custom op recomputes it (and backward may run anywhere)."""
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16) / 128**0.5
    b = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda x, w, b: fused_linear(x, w, b, "gelu_tanh", backend="cublaslt"), fullgraph=True)
    leaves = [leaf(x), leaf(w), leaf(b)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the user's own compile: torch's warnings are theirs to see
        y = f(*leaves)
    grads = leaf_grads(y, leaves, grad_y)
    eager_leaves = [leaf(x), leaf(w), leaf(b)]
    ey = fused_linear(*eager_leaves, "gelu_tanh", backend="eager")
    egrads = leaf_grads(ey, eager_leaves, grad_y)
    leaves64 = [leaf(t, torch.float64) for t in (x, w, b)]
    ref = linear_spec.reference(*leaves64, "gelu_tanh", upcast=True)
    refs = (ref, *leaf_grads(ref, leaves64, grad_y.double()))
    for name, out, r, e in zip(("y", "grad_x", "grad_w", "grad_b"), (y, *grads), refs, (ey, *egrads)):
        check_detached(f"compiled cublaslt {name}", out, r, e)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_compiled_every_activation_gpu(backend, activation):
    _bias_act_dropout_case(backend, (257, 384), torch.float32, activation, 0.0, "cuda")
    _fused_linear_case(backend, (257, 384), 512, torch.float32, activation, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_half_dtypes_gpu(backend, dtype):
    _bias_act_dropout_case(backend, (4, 65, 384), dtype, "gelu", 0.0, "cuda")
    _fused_linear_case(backend, (4, 65, 384), 512, dtype, "gelu_tanh", "cuda", bias=False)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_dropout_masks_gpu(backend, dtype):
    """On CUDA too: the forward's mask is dispatch.contracts.rng's, the backward regenerates the same one, and
    y and grad_x equal eager's bit for bit; inductor reuses one graph across token counts."""
    compiles = inductor_compiler.cache_info().compiles
    for i, shape in enumerate([(257, 1000), (1023, 1000), (8, 3, 1000)]):
        fwd_mask, bwd_mask, keep, y, ey, gx, egx = _dropout_masks(backend, shape, dtype, 0.1, "cuda")
        assert torch.equal(fwd_mask, keep), f"{backend}: forward mask differs from dispatch.contracts.rng's"
        assert torch.equal(bwd_mask, fwd_mask), f"{backend}: backward regenerated a different mask"
        assert torch.equal(y, ey) and torch.equal(gx, egx), f"{backend}: not bit-identical to eager"
        if backend == "inductor" and i == 0:
            compiles = inductor_compiler.cache_info().compiles
    if backend == "inductor":  # M = 1023 and M = 24 reused the graphs compiled for M = 257
        assert inductor_compiler.cache_info().compiles == compiles


@pytest.mark.gpu
def test_nvfuser_fuses_with_nnc_on_cuda_gpu():
    """x + bias, gelu: two ops, so NNC makes a group (a lone gelu forms none: seen on an H100)."""
    x, bias = torch.randn(64, 256, device="cuda"), torch.randn(256, device="cuda")
    fused_bias_act_dropout(x, bias, "gelu", backend="nvfuser")
    graphs, fused = nvfuser_compiler.observed_fusers("cuda")
    assert graphs >= 1 and fused.get("NNC", 0) >= 1, (graphs, fused)
    assert "NNC (fused" in backends()["nvfuser"].display_name()


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_nvfuser_fused_linear_rounds_the_pre_activation_once(activation):
    """nvfuser's half-precision pre-activation (saved for backward) equals eager's bit for bit: the
    bias is added in the GEMM's epilogue, not by a traced mm + add that rounds twice (which flipped
    relu's derivative near 0 and failed the H200 calibration's parity gate)."""
    from dispatch.backends.nvfuser import fused_linear as nvfuser_fl

    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    w = (torch.randn(2048, 1024) / 32).to(torch.bfloat16)
    b = (torch.randn(2048) * 0.5).to(torch.bfloat16)
    y, pre = nvfuser_fl.forward(x, w, b, activation)
    ey, epre = eager_fl.forward(x, w, b, activation)
    assert torch.equal(pre, epre) and torch.equal(y, ey)
