"""dispatch.patch keeps the state_dict of Hugging Face models (keys, order, one name per parameter,
strict loads both ways, the same function; patch_checks.check_round_trip): whole MLP blocks become one
FusedMLP over the block's own layers (GPT-2's), BERT's fuse per linear. Checked on lookalikes (the
class names, modules, attribute names and Conv1D layout ``patch`` recognizes) and, where transformers
is installed, on real GPT-2 and BERT built from small configs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dispatch import patch
from patch_checks import NO_TRANSFORMERS, OPTIONS, LastHidden, check_round_trip


# ----------------------------------------------------------------------------- Hugging Face lookalikes


def _hf(name: str, module: str, *bases):
    """A class ``patch`` takes for Hugging Face's ``name`` (it recognizes them by name and module)."""

    def make(cls):
        cls.__name__ = cls.__qualname__ = name
        cls.__module__ = module
        return cls

    return make


@_hf("Conv1D", "transformers.pytorch_utils")
class _Conv1D(nn.Module):
    """Hugging Face's Conv1D: weight stored (in, out), bias (out,), x @ weight + bias."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], self.nf)


@_hf("NewGELUActivation", "transformers.activations")
class _NewGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x, approximate="tanh")


@_hf("GELUActivation", "transformers.activations")
class _GELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x)


@_hf("GPT2MLP", "transformers.models.gpt2.modeling_gpt2")
class _GPT2MLP(nn.Module):
    def __init__(self, intermediate: int, embed: int, pdrop: float = 0.1) -> None:
        super().__init__()
        # GPT2MLP's registration order (c_proj before act): the state_dict's order follows it
        self.c_fc = _Conv1D(intermediate, embed)
        self.c_proj = _Conv1D(embed, intermediate)
        self.act = _NewGELU()
        self.dropout = nn.Dropout(pdrop)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(h))))


class _GPT2Like(nn.Module):
    def __init__(self, embed: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.h = nn.ModuleList(
            nn.ModuleDict({"ln_2": nn.LayerNorm(embed), "mlp": _GPT2MLP(4 * embed, embed)})
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = x + block["mlp"](block["ln_2"](x))
        return self.ln_f(x)


@_hf("BertIntermediate", "transformers.models.bert.modeling_bert")
class _BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)
        self.intermediate_act_fn = _GELU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(h))


@_hf("BertOutput", "transformers.models.bert.modeling_bert")
class _BertOutput(nn.Module):
    def __init__(self, intermediate: int, hidden: int, pdrop: float = 0.1) -> None:
        super().__init__()
        self.dense = nn.Linear(intermediate, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(pdrop)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class _BertLike(nn.Module):
    def __init__(self, hidden: int = 32, intermediate: int = 48, layers: int = 2) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            nn.ModuleDict(
                {
                    "intermediate": _BertIntermediate(hidden, intermediate),
                    "output": _BertOutput(intermediate, hidden),
                }
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer["output"](layer["intermediate"](x), x)
        return x


def test_lookalikes_are_recognized_as_hugging_face():
    model = _GPT2Like()
    report = patch(model, bias_in_linear=False)
    assert [(r.path, r.block) for r in report.replaced] == [(f"h.{i}.mlp", "GPT2MLP") for i in (0, 1)]
    mlp = model.h[0]["mlp"]
    assert type(mlp).__name__ == "FusedMLP" and mlp.transposed and mlp.activation == "gelu_tanh"
    assert mlp.p_out == 0.1 and type(mlp.c_fc) is _Conv1D and type(mlp.c_proj) is _Conv1D
    report = patch(_BertLike(), bias_in_linear=False)
    assert [r.block for r in report.replaced] == ["BertIntermediate", "BertOutput"] * 2


@pytest.mark.parametrize("option", OPTIONS)
def test_gpt2_lookalike_state_dict_round_trip(option):
    check_round_trip(_GPT2Like, OPTIONS[option], lambda: torch.randn(2, 7, 32), 2)  # one FusedMLP a layer


@pytest.mark.parametrize("option", OPTIONS)
def test_bert_lookalike_state_dict_round_trip(option):
    replaced = 2 if option == "no_linear_dropout" else 4
    check_round_trip(_BertLike, OPTIONS[option], lambda: torch.randn(2, 7, 32), replaced)


# ----------------------------------------------------------------------------- real Hugging Face


def _real_gpt2():
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LastHidden(tf.GPT2Model(config))


def _real_bert():
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = tf.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=32,
    )  # fmt: skip
    return LastHidden(tf.BertModel(config))


@pytest.mark.parametrize("option", OPTIONS)
def test_real_gpt2_state_dict_round_trip(option):
    _real_gpt2()  # skips without transformers
    check_round_trip(_real_gpt2, OPTIONS[option], lambda: torch.randint(0, 128, (2, 24)), 2)


@pytest.mark.parametrize("option", OPTIONS)
def test_real_bert_state_dict_round_trip(option):
    _real_bert()
    replaced = 2 if option == "no_linear_dropout" else 4
    check_round_trip(_real_bert, OPTIONS[option], lambda: torch.randint(0, 128, (2, 20)), replaced)
