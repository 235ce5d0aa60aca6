"""dispatch.patch's report: the blocks it saw and left alone, each with the reason a user can act on.

Gated MLPs of classes whose forward patch does not know (a hand-written one under LLaMA's names, T5's
wi_0/wi_1/wo) are listed, not rewritten, and the model is unchanged; LLaMA's own become one FusedMLP. The
Hugging Face cases build tiny models from configs (no download) and skip without transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dispatch import patch
from dispatch.contracts.activations import LEAKY_RELU_SLOPE
from dispatch.nn import FusedLinear
from patch_checks import NO_TRANSFORMERS

GATED = "gated MLP (gate_proj, up_proj, down_proj"


class _GatedMLP(nn.Module):
    """LLaMA's MLP: down(act(gate(x)) * up(x)), under its attribute names."""

    def __init__(self, dim: int = 16, hidden: int = 40) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _assert_unchanged(model: nn.Module, original: nn.Module, x) -> None:
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]
    with torch.no_grad():
        torch.testing.assert_close(model(x), original(x), rtol=0, atol=0)


def test_unknown_gated_mlp_is_listed_as_left_alone_with_the_reason():
    original = nn.Sequential(nn.LayerNorm(16), _GatedMLP())
    model = copy.deepcopy(original)
    report = patch(model)
    why = f"{GATED}, act_fn=SiLU): "
    why += "patch does not know the forward of _GatedMLP (FusedMLP.from_linears fuses it)"
    assert report.skipped == [("1", why)] and not report.replaced
    assert str(report).splitlines() == ["dispatch.patch: 0 replaced, 1 left alone", f"  left alone 1: {why}"]
    _assert_unchanged(model, original, torch.randn(3, 16))


def test_gated_mlp_needs_all_three_linears():
    """A block with a gate_proj but no up_proj is not taken for a gated MLP."""
    model = _GatedMLP()
    del model.up_proj
    assert not patch(model).skipped


def test_tiny_llama_reports_each_layers_mlp_as_one_fused_block():
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    original = tf.LlamaForCausalLM(config).eval()
    model = copy.deepcopy(original)
    report = patch(model)
    mlps = [(r.path, r.block) for r in report.replaced if r.block == "LlamaMLP"]
    assert mlps == [(f"model.layers.{i}.mlp", "LlamaMLP") for i in (0, 1)]
    norms = [r for r in report.replaced if r.block == "LlamaRMSNorm"]  # the norms alone: no add in sight
    places = [f"model.layers.{i}.{n}_layernorm" for i in (0, 1) for n in ("input", "post_attention")]
    assert [r.path for r in norms] == [*places, "model.norm"]
    assert all("the norm alone" in r.after for r in norms)
    assert not report.skipped
    lines = str(report).splitlines()
    assert lines[0] == "dispatch.patch: 7 replaced, 0 left alone"
    act = type(original.model.layers[0].mlp.act_fn).__name__
    before = f"gate_proj=Linear(32->48) + up_proj=Linear(32->48) + act_fn={act} + down_proj=Linear(48->32)"
    assert lines[1] == f"  model.layers.0.mlp (LlamaMLP): {before}  ->  FusedMLP(swiglu)"
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits)
    kept = copy.deepcopy(original)
    assert len(patch(kept, norms=False)) == 2 and type(kept.model.norm).__name__ == "LlamaRMSNorm"


def test_tiny_gated_t5_lists_its_gated_feed_forwards():
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = tf.T5Config(
        vocab_size=64, d_model=32, d_ff=48, num_layers=1, num_heads=2, d_kv=8, feed_forward_proj="gated-gelu"
    )
    report = patch(tf.T5Model(config))
    paths = [f"{stack}.block.0.layer.{i}.DenseReluDense" for stack, i in (("encoder", 1), ("decoder", 2))]
    assert [path for path, _ in report.skipped] == paths
    assert all(why.startswith("gated MLP (wi_0, wi_1, wo, act=") for _, why in report.skipped)


@pytest.mark.parametrize("slope", (0.2, 0.1, 0.0))
def test_leaky_relu_slope_is_the_reason(slope):
    model = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(slope), nn.Dropout(0.1), nn.Linear(16, 4))
    report = patch(model)
    why = f"LeakyReLU(negative_slope={slope}): only slope {LEAKY_RELU_SLOPE} is fused"
    assert report.skipped == [("0", why)] and not report.replaced
    assert f"left alone 0: {why}" in str(report)
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.LeakyReLU


def test_leaky_relu_with_the_fused_slope_is_replaced():
    model = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(LEAKY_RELU_SLOPE), nn.Linear(16, 4), nn.Tanh())
    report = patch(model)
    assert isinstance(model[0], FusedLinear) and model[0].activation == "leaky_relu"
    assert report.skipped == [("2", "activation Tanh has no fused equivalent")]
