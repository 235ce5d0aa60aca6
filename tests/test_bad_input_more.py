"""More bad input, each with an error naming the argument: unhashable activations, sparse and nested
tensors, numpy scalars for p and training; and p = 1, which is valid: no dropout in eval mode, everything dropped in training, as
``F.dropout`` does."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dispatch.ops import bias_act_dropout as bad_spec
from dispatch import ACTIVATION_NAMES, explain, fused_bias_act_dropout, fused_linear
from dispatch.registry import backends
from harness import require_call

N, K = 8, 6  # x is (4, N) for bias_act_dropout, (4, K) for fused_linear with weight (N, K)
ACTIVATION_LIST = re.escape(", ".join(ACTIVATION_NAMES))


def _quiet(make):
    with warnings.catch_warnings():  # "nested tensors are a prototype", "sparse CSR is in beta"
        warnings.simplefilter("ignore")
        return make()


def _nested(rows):
    return torch.nested.nested_tensor([torch.randn(r, rows[-1]) for r in rows[:-1]])


def _jagged(rows):
    return torch.nested.nested_tensor([torch.randn(r, rows[-1]) for r in rows[:-1]], layout=torch.jagged)


def _x_layouts(features: int) -> dict:
    """x in a layout no backend indexes: sparse COO and CSR, nested strided and jagged."""
    return {
        "x-sparse-coo": (dict(x=lambda: torch.randn(4, features).to_sparse()), TypeError,
                         DENSE.format("x") + r"layout torch\.sparse_coo"),
        "x-sparse-csr": (dict(x=lambda: torch.randn(4, features).to_sparse_csr()), TypeError,
                         DENSE.format("x") + r"layout torch\.sparse_csr"),
        "x-nested": (dict(x=lambda: _nested((2, 3, features))), TypeError,
                     DENSE.format("x") + r"a nested tensor \(layout torch\.strided\)"),
        "x-jagged": (dict(x=lambda: _jagged((2, 3, features))), TypeError,
                     DENSE.format("x") + r"a nested tensor \(layout torch\.jagged\)"),
    }  # fmt: skip


DENSE = r"{} must be a dense \(strided\) torch\.Tensor, got "
BAD_BIAS_ACT_DROPOUT = {  # name: (builders of kwargs over the call (x, bias, "gelu", 0.1), error, match)
    "activation-list": (
        dict(activation=lambda: ["gelu"]),
        ValueError,
        rf"activation must be one of {ACTIVATION_LIST}; got \['gelu'\]",
    ),
    "activation-dict": (
        dict(activation=lambda: {"gelu": 1}),
        ValueError,
        r"activation must be one of .*; got \{'gelu': 1\}",
    ),
    "activation-set": (
        dict(activation=lambda: {"gelu"}),
        ValueError,
        r"activation must be one of .*; got \{'gelu'\}",
    ),
    **_x_layouts(N),
    "bias-sparse-coo": (
        dict(bias=lambda: torch.randn(N).to_sparse()),
        TypeError,
        DENSE.format("bias") + r"layout torch\.sparse_coo",
    ),
    "p-numpy-bool": (
        dict(p=lambda: np.True_),
        ValueError,
        r"p must be a number in \[0, 1\], got .*True.* \(a bool\)",
    ),
    "p-false": (dict(p=lambda: False), ValueError, r"p must be a number in \[0, 1\], got False \(a bool\)"),
    "p-nan": (
        dict(p=lambda: float("nan")),
        ValueError,
        r"p must be a number in \[0, 1\], got nan \(not a number\)",
    ),
    "p-numpy-nan": (
        dict(p=lambda: np.float64("nan")),
        ValueError,
        r"p must be a number in \[0, 1\], got .*nan.* \(not a number\)",
    ),
    "p-numpy-float32-nan": (dict(p=lambda: np.float32("nan")), ValueError, r"\(not a number\)"),
    "p-numpy-above-one": (
        dict(p=lambda: np.float32(1.5)),
        ValueError,
        r"p must be a number in \[0, 1\], got .*1\.5",
    ),
    "p-inf": (dict(p=lambda: float("inf")), ValueError, r"p must be a number in \[0, 1\], got inf"),
    "p-str": (dict(p=lambda: "0.1"), ValueError, r"p must be a number in \[0, 1\], got '0\.1' \(str\)"),
    "training-numpy-int": (
        dict(training=lambda: np.int64(1)),
        TypeError,
        r"training must be a bool, got numpy\.int64$",
    ),
    "training-tensor": (
        dict(training=lambda: torch.tensor(True)),
        TypeError,
        r"training must be a bool, got torch\.Tensor$",
    ),
    "training-int": (dict(training=lambda: 1), TypeError, r"training must be a bool, got int$"),
    "generator-numpy": (
        dict(generator=lambda: np.random.default_rng(0)),
        TypeError,
        r"generator must be a torch\.Generator or None, got numpy\.random\._generator\.Generator",
    ),
}


@pytest.mark.parametrize("case", BAD_BIAS_ACT_DROPOUT)
def test_bias_act_dropout_bad_input(case):
    change, error, match = BAD_BIAS_ACT_DROPOUT[case]
    kwargs = dict(x=torch.randn(4, N), bias=torch.randn(N), activation="gelu", p=0.1)
    kwargs |= {name: _quiet(make) for name, make in change.items()}
    with pytest.raises(error, match=match):
        fused_bias_act_dropout(**kwargs)
    with pytest.raises(error, match=match):
        explain("fused_bias_act_dropout", **kwargs)


BAD_FUSED_LINEAR = {  # name: (builders of kwargs over the call (x, weight, bias, "gelu"), error, match)
    "activation-list": (
        dict(activation=lambda: ["gelu"]),
        ValueError,
        rf"activation must be one of {ACTIVATION_LIST}; got \['gelu'\]",
    ),
    "activation-dict": (
        dict(activation=lambda: {"gelu": "tanh"}),
        ValueError,
        r"activation must be one of .*; got \{'gelu': 'tanh'\}",
    ),
    **_x_layouts(K),
    "weight-sparse-coo": (
        dict(weight=lambda: torch.randn(N, K).to_sparse()),
        TypeError,
        DENSE.format("weight") + r"layout torch\.sparse_coo",
    ),
    "weight-sparse-csr": (
        dict(weight=lambda: torch.randn(N, K).to_sparse_csr()),
        TypeError,
        DENSE.format("weight") + r"layout torch\.sparse_csr",
    ),
    "weight-nested": (
        dict(weight=lambda: _nested((2, 3, K))),
        TypeError,
        DENSE.format("weight") + r"a nested tensor",
    ),
    "bias-sparse-coo": (
        dict(bias=lambda: torch.randn(N).to_sparse()),
        TypeError,
        DENSE.format("bias") + r"layout torch\.sparse_coo",
    ),
    "backend-numpy-str": (
        dict(backend=lambda: np.int32(3)),
        TypeError,
        r"backend must be a backend name \(str\) or None, got numpy\.int32",
    ),
}


@pytest.mark.parametrize("case", BAD_FUSED_LINEAR)
def test_fused_linear_bad_input(case):
    change, error, match = BAD_FUSED_LINEAR[case]
    kwargs = dict(x=torch.randn(4, K), weight=torch.randn(N, K), bias=torch.randn(N), activation="gelu")
    kwargs |= {name: _quiet(make) for name, make in change.items()}
    with pytest.raises(error, match=match):
        fused_linear(**kwargs)
    if "backend" not in change:
        with pytest.raises(error, match=match):
            explain("fused_linear", **kwargs)


# ----------------------------------------------------------------------------- numpy scalars


def _dropout(p, training, x, bias, seed=7):
    return fused_bias_act_dropout(x, bias, "gelu", p, training, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("flag", (True, False))
def test_training_accepts_numpy_bools(flag):
    x, bias = torch.randn(4, N), torch.randn(N)
    y = _dropout(0.3, np.bool_(flag), x, bias)
    torch.testing.assert_close(y, _dropout(0.3, flag, x, bias), rtol=0, atol=0)


@pytest.mark.parametrize("make", (np.float64, np.float32, np.float16, float), ids=lambda t: t.__name__)
def test_p_accepts_numpy_floats(make):
    """0.25 is exact in every float format, so each gives the float's mask and scale."""
    x, bias = torch.randn(16, N), torch.randn(N)
    y = _dropout(make(0.25), True, x, bias)
    torch.testing.assert_close(y, _dropout(0.25, True, x, bias), rtol=0, atol=0)
    assert (y == 0).any() and (y != 0).any()


def test_explain_takes_numpy_scalars():
    x, bias = torch.randn(4, N), torch.randn(N)
    assert explain("fused_bias_act_dropout", x, bias, "gelu", np.float32(0.25), np.True_).call.dropout
    assert not explain("fused_bias_act_dropout", x, bias, "gelu", np.float32(0.25), np.False_).call.dropout


# ----------------------------------------------------------------------------- p = 1


@pytest.mark.parametrize("backend", tuple(backends()))
def test_p_one(backend, device):
    """Eval mode: no dropout, as nn.Dropout(1.0).eval(). Training: every element dropped, zeros and
    zero gradients, as F.dropout(., 1.0), and no random numbers drawn. One kind of call per backend
    (the compiling ones compile once): p = 0 underneath in both modes."""
    call = bad_spec.SPEC.call(torch.device(device), torch.float32, (6, N), True, activation="gelu", dropout=False)
    require_call(backend, call)
    x = torch.randn(2, 3, N, device=device, requires_grad=True)
    bias = torch.randn(N, device=device, requires_grad=True)
    grad_y = torch.randn(2, 3, N, device=device)
    ref = bad_spec.reference(x, bias, "gelu")
    ref_grads = torch.autograd.grad(ref, (x, bias), grad_y)

    y = fused_bias_act_dropout(x, bias, "gelu", 1.0, training=False, backend=backend)
    torch.testing.assert_close(y, ref)
    for g, r in zip(torch.autograd.grad(y, (x, bias), grad_y), ref_grads):
        torch.testing.assert_close(g, r)

    state = torch.random.get_rng_state()
    y = fused_bias_act_dropout(x, bias, "gelu", 1.0, backend=backend)
    assert torch.equal(torch.random.get_rng_state(), state), "p = 1 drew random numbers"
    assert y.shape == x.shape and torch.equal(y, torch.zeros_like(y))
    for g, t in zip(torch.autograd.grad(y, (x, bias), grad_y), (x, bias)):
        assert torch.equal(g, torch.zeros_like(t))
    assert torch.equal(y, F.dropout(ref, 1.0))


def test_p_one_matches_f_dropout_on_nan_and_inf():
    """F.dropout(., 1.0) multiplies by a zero mask: NaN stays NaN, inf becomes NaN, -2 gives -0. The
    gradients are zero wherever the activation's derivative is finite."""
    x = torch.randn(3, N, dtype=torch.float64)
    x[0, 1], x[1, 2], x[2, 3] = float("nan"), float("inf"), -float("inf")
    x.requires_grad_()
    bias = torch.randn(N, dtype=torch.float64, requires_grad=True)
    y = fused_bias_act_dropout(x, bias, "silu", 1.0)
    ref = F.dropout(F.silu(x + bias), 1.0)
    torch.testing.assert_close(y, ref, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(torch.signbit(y), torch.signbit(ref))
    grad_y = torch.randn_like(y)
    for g, r in zip(torch.autograd.grad(y, (x, bias), grad_y), torch.autograd.grad(ref, (x, bias), grad_y)):
        torch.testing.assert_close(g, r, equal_nan=True, rtol=0, atol=0)


def test_p_one_explain_says_no_dropout():
    x, bias = torch.randn(4, N), torch.randn(N)
    assert not explain("fused_bias_act_dropout", x, bias, "gelu", 1.0).call.dropout
    assert explain("fused_bias_act_dropout", x, bias, "gelu", 0.999).call.dropout


@pytest.mark.parametrize("requested", (None, "eager"), ids=("inline", "custom-op"))
def test_p_one_under_torch_compile(requested):
    """Both compiled paths: traced as plain math (no backend requested) and the custom op (a backend
    requested). Dynamo's own eager backend: the tracing is what matters here, not inductor."""

    def op(x, bias, training):
        return fused_bias_act_dropout(x, bias, "gelu", 1.0, training, backend=requested)

    compiled = torch.compile(op, backend="eager", fullgraph=True)
    x = torch.randn(4, N, requires_grad=True)
    bias = torch.randn(N, requires_grad=True)
    y = compiled(x, bias, True)
    assert torch.equal(y, torch.zeros_like(y))
    for g, t in zip(torch.autograd.grad(y, (x, bias), torch.randn_like(y)), (x, bias)):
        assert torch.equal(g, torch.zeros_like(t))
    torch.testing.assert_close(compiled(x, bias, False), F.gelu(x + bias))
