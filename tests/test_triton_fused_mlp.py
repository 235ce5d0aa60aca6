"""Triton fused_mlp: the output and every gradient against the float64 reference with the same masks
(drawn as the op's runner draws them), the masks identical to eager's for the same generator seed,
the gradient subsets, inference, and bitwise-deterministic gradients.

On CPU the kernels run under Triton's interpreter, so the cases are a representative subset of
activation x (stacked, pair) weights x bias x p x p_out x dtype on tiny odd shapes that still cross the
paths that matter: F % 8 == 0 (one Philox call per 8 elements) and not, decode shapes (grad_b_in
written directly) and longer ones (partial bias sums plus a reduction). ``gpu``-marked tests use real
sizes.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from dispatch import fused_mlp
from dispatch.backends.triton import fused_mlp as triton_fused_mlp
from dispatch.backends.triton import matmul, mlp_gemm, mlp_hidden
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import GATED_NAMES, GATES
from dispatch.contracts.tolerances import check
from dispatch.ops.fused_mlp import TENSORS, MLPOperands, reference

triton_backend = pytest.importorskip("dispatch.backends.triton").BACKEND
if triton_backend.unavailable():
    pytest.skip(triton_backend.unavailable(), allow_module_level=True)

F32, BF16 = torch.float32, torch.bfloat16
GRADS = tuple(f"grad_{name}" for name in TENSORS)


# "cublaslt" runs cuBLASLt on CUDA alone (the CPU runs "passes" for it; test_gelu_aux_product.py fakes it)
@pytest.fixture(autouse=True, params=[v for v in triton_fused_mlp.VARIANTS
                                      if v != "cublaslt" or torch.cuda.is_available()])  # fmt: skip
def variant(request):
    """Every test under each variant: the products on cuBLAS with passes (keeping pre, or pre and a),
    on Triton with the passes in their epilogues, and gelu_tanh's first product in cuBLASLt's."""
    with triton_fused_mlp.options(variant=request.param):
        yield request.param


def _inputs(activation, pair, bias, dtype, shape, device, x_shape=None):
    """MLPOperands.tensors for (M, H, F, H_out): x, w_in, w_up, b_in, b_up, w_out, b_out."""
    m, h, f, h_out = shape
    f_in = 2 * f if activation in GATES and not pair else f

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device=device) * scale).to(dtype)

    x = randn(*(x_shape or (m, h)))
    w_in, w_up = randn(f_in, h, scale=1 / math.sqrt(h)), randn(f, h, scale=1 / math.sqrt(h)) if pair else None
    b_in, b_up = (randn(f_in, scale=0.5), randn(f, scale=0.5) if pair else None) if bias else (None, None)
    w_out, b_out = randn(h_out, f, scale=1 / math.sqrt(f)), randn(h_out, scale=0.5) if bias else None
    return x, w_in, w_up, b_in, b_up, w_out, b_out


def _leaves(tensors, needs, dtype=None):
    return [
        None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(need)
        for t, need in zip(tensors, needs)
    ]


def _grads(y, leaves, grad_y) -> list[Optional[torch.Tensor]]:
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad(y, wanted, grad_y.to(y.dtype)) if wanted else ())
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]


def _public(backend, tensors, activation, p, p_out, seed, grad_y, needs, training=True):
    """fused_mlp on ``backend``, generator seeded ``seed``: y and, for a ``grad_y``, the gradients in
    MLPOperands.tensors order."""
    x, w_in, w_up, b_in, b_up, w_out, b_out = leaves = _leaves(tensors, needs)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    w = w_in if w_up is None else (w_in, w_up)
    b = b_in if b_up is None else (b_in, b_up)
    y = fused_mlp(x, w, b, w_out, b_out, activation, p, p_out, training, generator=gen, backend=backend)
    return y.detach(), None if grad_y is None else _grads(y, leaves, grad_y)


def _reference(tensors, activation, p, p_out, seed, grad_y, needs):
    """The float64 reference with the masks of the runner's draws from a generator seeded ``seed``."""
    x = tensors[0]
    m, f, h_out = x.numel() // x.shape[-1], tensors[5].shape[1], tensors[5].shape[0]
    gen = torch.Generator(device=x.device).manual_seed(seed)
    hidden = dropout_rng.draw_for(x, gen, m * f) if p > 0 else None
    out = dropout_rng.draw_for(x, gen, m * h_out) if p_out > 0 else None
    leaves = _leaves(tensors, needs, torch.float64)
    rows = leaves[0].reshape(m, x.shape[-1])
    operands = MLPOperands(rows, *leaves[1:], activation, p, p_out)
    y = reference(operands, (hidden, out)).view(*x.shape[:-1], h_out)
    return y.detach(), None if grad_y is None else _grads(y, leaves, grad_y)


def assert_matches(tensors, activation, p, p_out, seed=7, needs=None):
    """Triton vs the float64 reference, within twice eager's error in the same dtype plus the dtype's
    tolerance; eager with the same generator seed drops exactly the same outputs."""
    needs = needs or tuple(t is not None for t in tensors)
    x, w_out = tensors[0], tensors[5]
    grad_y = torch.randn(*x.shape[:-1], w_out.shape[0], device=x.device).to(x.dtype)
    y, grads = _public("triton", tensors, activation, p, p_out, seed, grad_y, needs)
    eager, eager_grads = _public("eager", tensors, activation, p, p_out, seed, grad_y, needs)
    ref, ref_grads = _reference(tensors, activation, p, p_out, seed, grad_y, needs)
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert torch.equal(y == 0, eager == 0), "the output masks differ from eager's"
    check("y", y, ref, eager)
    for name, g, r, e, t, need in zip(GRADS, grads, ref_grads, eager_grads, tensors, needs):
        if need and t is not None:
            assert g is not None and g.dtype == t.dtype and g.shape == t.shape, name
            check(name, g, r, e)
        else:
            assert g is None, f"{name} computed but not needed"


# ----------------------------------------------------------------------------- parity

# (activation, (gate, up) pair weights, bias, p, p_out, dtype, (M, H, F, H_out)): every activation the
# brief names and every gate, stacked and pair, bias on and off, each p and p_out, F % 8 == 0 and not
CASES = [
    ("gelu", False, True, 0.3, 0.2, F32, (7, 9, 17, 9)),
    ("relu", False, False, 0.3, 0.0, F32, (1, 5, 6, 5)),
    ("squared_relu", False, True, 0.0, 0.2, F32, (7, 5, 6, 9)),
    ("silu", False, False, 0.0, 0.0, F32, (7, 9, 16, 9)),
    ("swiglu", False, True, 0.3, 0.2, F32, (7, 9, 17, 9)),
    ("swiglu", True, True, 0.3, 0.0, F32, (7, 5, 6, 5)),
    ("geglu", True, False, 0.0, 0.2, F32, (1, 9, 17, 9)),
    ("geglu_tanh", False, False, 0.3, 0.2, F32, (7, 5, 16, 5)),
    ("reglu", True, True, 0.3, 0.2, F32, (7, 9, 17, 5)),
    ("reglu", False, True, 0.0, 0.0, F32, (1, 5, 6, 5)),
    ("relu", False, True, 0.0, 0.2, F32, (7, 9, 17, 9)),
    ("relu", False, False, 0.0, 0.0, BF16, (7, 5, 16, 5)),
    ("swiglu", True, True, 0.3, 0.2, BF16, (7, 9, 17, 9)),
]


@pytest.mark.parametrize(
    "activation, pair, bias, p, p_out, dtype, shape",
    [pytest.param(*case, id="-".join(map(str, case[:5])) + f"-{str(case[5])[6:]}") for case in CASES],
)
def test_matches_reference(activation, pair, bias, p, p_out, dtype, shape, device):
    assert_matches(_inputs(activation, pair, bias, dtype, shape, device), activation, p, p_out)


def test_every_gate_is_declared():
    assert set(GATED_NAMES) <= triton_backend.activations
    assert {case[0] for case in CASES} >= {"gelu", "relu", "squared_relu", "silu", *GATED_NAMES}


@pytest.mark.parametrize("activation, pair", [("gelu", False), ("geglu", True)])
def test_long_shapes_reduce_partials(activation, pair, device):
    """M = 300: several backward row programs, partial bias sums and their reduction; bitwise the same
    gradients on a second run."""
    tensors = _inputs(activation, pair, True, F32, (300, 5, 16, 5), device)
    assert_matches(tensors, activation, 0.3, 0.2, seed=3)
    grad_y = torch.randn(300, 5, device=device)
    needs = (True,) * 7
    first = _public("triton", tensors, activation, 0.3, 0.2, 3, grad_y, needs)[1]
    second = _public("triton", tensors, activation, 0.3, 0.2, 3, grad_y, needs)[1]
    for a, b in zip(first, second):
        assert (a is None and b is None) or torch.equal(a, b)


def test_leading_dims(device):
    tensors = _inputs("swiglu", False, True, F32, (6, 9, 17, 9), device, x_shape=(2, 3, 9))
    assert_matches(tensors, "swiglu", 0.3, 0.2)


@pytest.mark.parametrize(
    "needs",
    [
        (False, False, False, False, False, True, False),  # grad_W_out only: a recomputed alone
        (False, False, False, True, True, False, False),  # grad_b_in only: no grad_pre written
        (True, False, False, False, False, False, True),  # grad_x and grad_b_out
    ],
    ids=["w_out", "b_in", "x-b_out"],
)
def test_gradient_subsets(needs, device):
    tensors = _inputs("geglu", True, True, F32, (7, 5, 6, 5), device)
    assert_matches(tensors, "geglu", 0.3, 0.2, needs=needs)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("activation, pair", [("silu", False), ("swiglu", True)])
@pytest.mark.parametrize("f", [24, 13])
def test_hidden_mask_identical_to_eager(activation, pair, f, device):
    """W_out = I, no output dropout: y is the hidden activation a, so its zeros are the hidden mask."""
    x, w_in, w_up, b_in, b_up, _, _ = _inputs(activation, pair, True, F32, (70, 5, f, f), device)
    tensors = (x, w_in, w_up, b_in, b_up, torch.eye(f, device=device), None)
    no_grads = (False,) * 7
    y = _public("triton", tensors, activation, 0.5, 0.0, 11, None, no_grads)[0]
    eager = _public("eager", tensors, activation, 0.5, 0.0, 11, None, no_grads)[0]
    assert torch.equal(y == 0, eager == 0)
    assert 0.4 < (y == 0).float().mean().item() < 0.6


def test_host_rng_equals_its_tensor_form(device):
    """A HostRng (CUDA's form outside graph capture) reaches the gate kernels as four int32 words, with
    high bits set: the same a and gradients as the same (seed, offset) as a tensor."""
    host = dropout_rng.HostRng(2**64 - 3, 2**32 + 7)
    tensor = dropout_rng.as_tensor(host, torch.device(device))
    pre, grad_a = torch.randn(9, 26, device=device), torch.randn(9, 13, device=device)
    forward = mlp_hidden.forward
    assert torch.equal(forward(pre, "swiglu", 0.3, host), forward(pre, "swiglu", 0.3, tensor))
    for a, b in zip(
        mlp_hidden.backward(grad_a, pre, "swiglu", 0.3, host, True, True, True),
        mlp_hidden.backward(grad_a, pre, "swiglu", 0.3, tensor, True, True, True),
    ):
        assert torch.equal(a, b)


def test_epilogue_kernels_take_host_rng_words(device):
    """The epilogue kernels with a HostRng of high bits set: the same a, pre and gradients as the same
    (seed, offset) as a tensor, and what the pass kernels make of the same pre."""
    host = dropout_rng.HostRng(2**64 - 3, 2**32 + 7)
    tensor = dropout_rng.as_tensor(host, torch.device(device))
    x, w, w_up = (torch.randn(9, 5, device=device), torch.randn(13, 5, device=device),
                  torch.randn(13, 5, device=device))  # fmt: skip
    g, w_out = torch.randn(9, 4, device=device), torch.randn(4, 13, device=device)
    results = []
    for rng in (host, tensor):
        a, pre = torch.empty(9, 13, device=device), torch.empty(9, 26, device=device)
        mlp_gemm.up(x, w, w_up, None, None, "silu", 0.3, rng, a, pre)
        grads = mlp_gemm.grad_hidden(g, w_out, pre, "silu", True, 0.3, rng, True, True, True)
        results.append((a, pre, *grads))
    for first, second in zip(*results):
        assert torch.equal(first, second)
    a, pre, grad_pre, a_again, grad_bias = results[0]
    assert torch.equal(a, a_again)
    check("a", a, mlp_hidden.forward(pre, "swiglu", 0.3, host))
    want_pre, _, want_bias = mlp_hidden.backward(g @ w_out, pre, "swiglu", 0.3, host, True, False, True)
    check("grad_pre", grad_pre, want_pre)
    check("grad_bias", grad_bias, want_bias)


def test_epilogue_variant_runs_its_kernels(device, variant, monkeypatch):
    """Under "epilogues" both products that carry hidden-layer work run mlp_gemm's kernels (a silent
    fallback to the passes would pass every parity test); a pair of differently laid-out weights
    falls back to the passes."""
    calls = []
    for name in ("up", "grad_hidden"):
        real = getattr(mlp_gemm, name)
        monkeypatch.setattr(
            mlp_gemm, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    tensors = _inputs("geglu", True, True, F32, (7, 5, 6, 5), device)
    assert_matches(tensors, "geglu", 0.3, 0.2)
    # hidden layer and output dropout forward, the hidden layer's gradient backward
    assert calls == (["up", "up", "grad_hidden"] if variant == "epilogues" else [])
    calls.clear()
    x, w_in, w_up, b_in, b_up, w_out, b_out = tensors
    transposed = (x, w_in, w_up.t().contiguous().t(), b_in, b_up, w_out, b_out)
    assert_matches(transposed, "geglu", 0.3, 0.2)
    assert "grad_hidden" not in calls and "up" not in calls


def test_keep_variant_forms_a_once(device, variant, monkeypatch):
    """Under "keep" backward's pass is not asked for a, kept since the forward (a silent recompute
    would pass every parity test); under "passes" it is."""
    asked = []
    real = mlp_hidden.backward
    monkeypatch.setattr(mlp_hidden, "backward", lambda *a: asked.append(a[6]) or real(*a))
    assert_matches(_inputs("gelu_tanh", False, True, F32, (7, 5, 6, 5), device), "gelu_tanh", 0.3, 0.2)
    assert asked == {"keep": [False], "passes": [True], "epilogues": [], "cublaslt": [True]}[variant]


def test_relu_runs_in_the_product(device, variant, monkeypatch):
    """relu without hidden dropout: the first product writes a (cuBLASLt's epilogue), no forward pass
    runs, and backward reads that a for pre without forming it again; with dropout the pass runs."""
    forms, asked = [], []
    real_forward, real_backward = mlp_hidden.forward, mlp_hidden.backward
    monkeypatch.setattr(mlp_hidden, "forward", lambda *a: forms.append(a[1]) or real_forward(*a))
    monkeypatch.setattr(mlp_hidden, "backward", lambda *a: asked.append(a[6]) or real_backward(*a))
    tensors = _inputs("relu", False, True, F32, (7, 5, 6, 5), device)
    assert_matches(tensors, "relu", 0.0, 0.2)
    assert forms == [] and asked == ([] if variant == "epilogues" else [False])
    assert_matches(tensors, "relu", 0.3, 0.2)
    assert forms == ([] if variant == "epilogues" else ["relu"])


def test_gelu_tanh_inference_in_the_product_on_cuda_only(device, variant, monkeypatch):
    """Without autograd gelu_tanh runs in cuBLASLt's epilogue on CUDA; on the CPU, where
    _addmm_activation's GELU is erf's, the pass runs. Either way y is the reference's."""
    forms = []
    real = mlp_hidden.forward
    monkeypatch.setattr(mlp_hidden, "forward", lambda *a: forms.append(a[1]) or real(*a))
    tensors = _inputs("gelu_tanh", False, True, F32, (7, 9, 16, 9), device)
    with torch.no_grad():
        y = _public("triton", tensors, "gelu_tanh", 0.0, 0.0, 5, None, (False,) * 7)[0]
    check("y", y, _reference(tensors, "gelu_tanh", 0.0, 0.0, 5, None, (False,) * 7)[0])
    passes = variant != "epilogues" and device == "cpu"
    assert forms == (["gelu_tanh"] if passes else [])


@pytest.mark.parametrize("split", [1, 2])
def test_epilogue_kernels_take_a_forced_config(device, variant, split):
    """matmul.options' config reaches the epilogue kernels too, warp-specialized tile loop and the
    epilogue split in column halves included (the benchmarks' switches): the same results as the
    rule's tiles."""
    # warp-specialized only under the interpreter: on the GPU tl.range's warp specialization is
    # exercised by the real-size tests' configs, not by a 1-warp tile
    forced = matmul.Config(16, 16, 16, num_warps=1, num_stages=1, group_m=1, warp_specialize=device == "cpu",
                           epilogue_split=split)  # fmt: skip
    tensors = _inputs("swiglu", False, True, F32, (21, 9, 24, 9), device)
    with matmul.options(config=forced):
        assert_matches(tensors, "swiglu", 0.3, 0.2)


def test_epilogue_kernels_64_bit_offsets(device, monkeypatch):
    """INDEX_64 (some tensor past 2**31 elements) takes 64-bit offsets in the main loops and the
    epilogues: bit for bit the 32-bit kernels' results on the same small tensors."""
    x = torch.randn(37, 24, device=device)
    w, w_up = torch.randn(40, 24, device=device) / 5, torch.randn(40, 24, device=device) / 5
    g, w_out = torch.randn(37, 19, device=device), torch.randn(19, 40, device=device) / 5
    rng = dropout_rng.draw_for(x, torch.Generator(device=device).manual_seed(3), 37 * 40)

    def run():
        a, pre = torch.empty(37, 40, device=device), torch.empty(37, 80, device=device)
        mlp_gemm.up(x, w, w_up, None, None, "silu", 0.3, rng, a, pre)
        return (a, pre, *mlp_gemm.grad_hidden(g, w_out, pre, "silu", True, 0.3, rng, True, True, True))

    small = run()
    monkeypatch.setattr(matmul, "_extent", lambda shape, strides: 2**31)
    for got, want in zip(run(), small):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------- inference


def test_inference_without_grad_keeps_the_masks(device):
    """Under no_grad the op runs ``inference``: with the same seed, y is bitwise the training call's."""
    tensors = _inputs("reglu", False, True, F32, (7, 9, 17, 9), device)
    trained = _public("triton", tensors, "reglu", 0.3, 0.2, 5, None, (True,) * 7)[0]
    with torch.no_grad():
        inferred = _public("triton", tensors, "reglu", 0.3, 0.2, 5, None, (False,) * 7)[0]
    assert torch.equal(trained, inferred)


def test_eval_mode_drops_nothing(device):
    tensors = _inputs("gelu", False, True, F32, (7, 9, 17, 9), device)
    with torch.no_grad():
        y = _public("triton", tensors, "gelu", 0.3, 0.2, 5, None, (False,) * 7, training=False)[0]
    check("y", y, _reference(tensors, "gelu", 0.0, 0.0, 5, None, (False,) * 7)[0])


# ----------------------------------------------------------------------------- real sizes


@pytest.mark.gpu
@pytest.mark.parametrize(
    "activation, pair, dtype, shape",
    [
        ("swiglu", False, BF16, (2048, 1024, 2816, 1024)),
        ("geglu", True, torch.float16, (1823, 129, 781, 129)),
        ("gelu", False, BF16, (4096, 768, 3072, 768)),
        ("squared_relu", False, F32, (1823, 129, 781, 257)),
        ("relu", False, BF16, (4096, 768, 3072, 768)),
    ],
    ids=str,
)
def test_real_sizes(activation, pair, dtype, shape, device):
    p = 0.0 if activation == "relu" else 0.1  # relu without hidden dropout: in the product's epilogue
    assert_matches(_inputs(activation, pair, True, dtype, shape, device), activation, p, 0.1)
