"""The norm modules (``dispatch.nn.FusedRMSNorm``, ``FusedLayerNorm``) and ``dispatch.patch`` on Hugging
Face RMSNorms: parameters named and initialized as the modules they stand for, state_dicts loading both
ways, the residual add fused when given one; every RMSNorm class ``patch`` replaces
(``patch_norm._HF_NORMS``), built from a small config of the installed transformers, becomes a
FusedRMSNorm with its keys, and computes as it did: to the bit where the dispatcher picks plain PyTorch
(no table here), within tolerance on the reference backend.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dispatch import patch, use_backend
from dispatch.nn import FusedLayerNorm, FusedRMSNorm
from dispatch.contracts.tolerances import check
from dispatch.ops import add_norm as spec
from dispatch.patch_norm import _HF_NORMS
from patch_checks import NO_TRANSFORMERS, assert_same


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward, as written there."""
    hf = x.to(torch.float32)
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# ----------------------------------------------------------------------------- the modules


def test_rms_norm_module_is_llamas_and_gemmas():
    """weight starts at a unit scale (ones; Gemma's zeros with offset 1); forward(x) is the norm,
    forward(x, residual) returns (norm(x + residual), x + residual); keys as Hugging Face's."""
    norm = FusedRMSNorm(16, eps=1e-5)
    assert list(norm.state_dict()) == ["weight"] and torch.equal(norm.weight, torch.ones(16))
    assert torch.equal(FusedRMSNorm(16, offset=1.0).weight, torch.zeros(16))
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    assert torch.equal(norm(x), llama_rms_norm(x, norm.weight, 1e-5))  # plain PyTorch here: to the bit
    y, h = norm(x, r)
    assert torch.equal(h, x + r) and torch.equal(y, llama_rms_norm(x + r, norm.weight, 1e-5))
    assert repr(norm) == "FusedRMSNorm(16, eps=1e-05)"
    assert norm.explain(x, r).call.values == ("rms",)


def test_layer_norm_module_is_nn_layer_norm():
    """The same keys, initialization and function as nn.LayerNorm, with and without bias; its
    state_dict loads both ways."""
    for bias in (True, False):
        ours, theirs = FusedLayerNorm(24, eps=1e-6, bias=bias), nn.LayerNorm(24, eps=1e-6, bias=bias)
        assert list(ours.state_dict()) == list(theirs.state_dict())
        mine, its = ours.state_dict(), theirs.state_dict()
        assert all(torch.equal(mine[k], its[k]) for k in its)
        with torch.no_grad():
            for p in theirs.parameters():
                p.normal_()
        ours.load_state_dict(theirs.state_dict(), strict=True)
        x, r = torch.randn(5, 24, requires_grad=True), torch.randn(5, 24)
        assert torch.equal(ours(x), theirs(x))
        y, h = ours(x, r)
        assert torch.equal(y, theirs(x + r)) and torch.equal(h, x + r)
        theirs.load_state_dict(ours.state_dict(), strict=True)
    assert repr(FusedLayerNorm(8, bias=False)) == "FusedLayerNorm(8, eps=1e-05, bias=False)"


def test_modules_on_the_reference_backend_and_mixed_dtypes():
    """On eager: within tolerance of the float64 reference, gradients too. A float32 weight with
    bfloat16 x (a float32 norm in a bf16 model): the module computes the Hugging Face formula as it
    stands, LLaMA's product promoting to float32."""
    norm, layer = FusedRMSNorm(32), FusedLayerNorm(32)
    with torch.no_grad():
        for p in (*norm.parameters(), *layer.parameters()):
            p.normal_()
    x, r = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32)
    with use_backend("eager"):
        y, _ = norm(x, r)
        y2, _ = layer(x, r)
    want, _ = spec.reference(x.double(), r.double(), norm.weight.double(), None, 1e-6, "rms", upcast=True)
    check("rms y", y.detach(), want.detach())
    wide = (x.double(), r.double(), layer.weight.double(), layer.bias.double())
    want2, _ = spec.reference(*wide, 1e-5, "layer", upcast=True)
    check("layer y", y2.detach(), want2.detach())
    xb = x.detach().bfloat16()
    mixed = norm(xb)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, llama_rms_norm(xb, norm.weight, 1e-6))


def test_bad_input_names_the_module():
    with pytest.raises(ValueError, match="x's last dimension must be hidden_size=8 of this FusedRMSNorm"):
        FusedRMSNorm(8)(torch.randn(2, 7))


# ----------------------------------------------------------------------------- patch on Hugging Face

transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)

H = 24
FOLDERS = {
    "LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2RMSNorm": "qwen2", "Qwen3RMSNorm": "qwen3",
    "GemmaRMSNorm": "gemma", "Gemma2RMSNorm": "gemma2", "Gemma3RMSNorm": "gemma3",
}  # fmt: skip


def test_every_patched_class_is_checked_here():
    assert set(FOLDERS) == set(_HF_NORMS)


def build(name: str) -> nn.Module:
    """The real class, its weight around its unit scale, or a skip where this transformers lacks it."""
    module = importlib.import_module(f"transformers.models.{FOLDERS[name]}.modeling_{FOLDERS[name]}")
    if not hasattr(module, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    norm = getattr(module, name)(H, eps=1e-5)
    torch.nn.init.normal_(norm.weight, mean=1.0 - _HF_NORMS[name], std=0.3)
    return norm


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_hf_rms_norm_becomes_fused_with_its_keys_and_function(name):
    original = build(name)
    model = nn.Sequential(copy.deepcopy(original))  # a parent for it: patch puts the fused norm there
    weight, keys = model[0].weight, list(model.state_dict())
    report = patch(model)
    assert isinstance(model[0], FusedRMSNorm) and model[0].weight is weight
    assert model[0].offset == _HF_NORMS[name] and model[0].eps == 1e-5
    assert list(model.state_dict()) == keys == ["0.weight"]
    assert len(report) == 1 and report.replaced[0].block == name
    assert "the norm alone" in report.replaced[0].after
    assert model[0].explain(torch.randn(3, H)).backend.name == "pytorch"
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = copy.deepcopy(model).to(dtype), copy.deepcopy(original).to(dtype)
        x = torch.randn(2, 5, H, dtype=dtype, requires_grad=True)
        got, want = ours(x), theirs(x)
        assert torch.equal(got, want), (name, dtype)
        gy = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, [x, *ours.parameters()], gy),
                        torch.autograd.grad(want, [x, *theirs.parameters()], gy)):  # fmt: skip
            assert torch.equal(a, b), (name, dtype)
        with use_backend("eager"):
            assert_same(ours(x), want)
    nn.Sequential(build(name)).load_state_dict(model.state_dict(), strict=True)


def test_a_model_that_is_a_norm_is_left_alone():
    norm = build("LlamaRMSNorm")
    report = patch(norm)
    assert report.skipped == [("", "the model is this norm: no parent to hold a FusedRMSNorm")]


def test_fused_layer_norm_is_f_layer_norm_over_bf16():
    x = torch.randn(3, 10).bfloat16()
    layer = FusedLayerNorm(10).bfloat16()
    assert torch.equal(layer(x), F.layer_norm(x, (10,), layer.weight, layer.bias, 1e-5))
