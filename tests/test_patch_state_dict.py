"""dispatch.patch keeps the state_dict: the same keys, in the same order, with the same shapes and
tensors, so the original's checkpoint loads into the patched model and the patched model's into the
original, both with strict=True, and the two then compute the same function. Every parameter keeps
one name: ``named_parameters()`` and the state_dict call it what the original did.

Here nn.Sequential in every form ``patch`` rewrites: a Sequential that is exactly an MLP, Linear +
activation (fused into the GEMM), Linear + activation + Dropout (bias, activation and dropout in one
pass after the GEMM), Linear + Dropout (bias in the GEMM, or in the dropout's pass with
``bias_in_linear=False``, or left alone with ``linear_dropout=False``), and runs with nothing to fuse;
plain modules, which it leaves alone. Hugging Face blocks: test_patch_state_dict_hf.py.
"""

from __future__ import annotations

import copy
import io
from collections import OrderedDict

import pytest
import torch
from torch import nn

from dispatch import patch
from patch_checks import OPTIONS, assert_one_name_per_parameter, check_round_trip, randomize


# ----------------------------------------------------------------------------- nn.Sequential


def _sequential_cases():
    """name -> (builder, input shape, runs replaced per option)."""

    def mlp():  # Linear -> GELU -> Dropout, then Linear -> Dropout: the model
        return nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16), nn.Dropout(0.1)
        )  # fmt: skip

    def full():  # every form, a run with nothing fusable (Tanh), one with p = 0
        return nn.Sequential(
            nn.Linear(16, 64), nn.GELU(approximate="tanh"), nn.Dropout(0.2),
            nn.Linear(64, 16), nn.Dropout(0.2),
            nn.Linear(16, 32), nn.SiLU(), nn.Dropout(0.0),
            nn.Linear(32, 8), nn.Tanh(),
        )  # fmt: skip

    def after_norm():  # parameters after a moved bias, inside the same Sequential
        return nn.Sequential(
            nn.Linear(16, 48), nn.ReLU(), nn.Dropout(0.3), nn.LayerNorm(48),
            nn.Linear(48, 24), nn.LeakyReLU(), nn.Dropout(0.3), nn.Linear(24, 8),
        )  # fmt: skip

    def named():  # an OrderedDict Sequential: children with names, not positions
        return nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(16, 64), act=nn.GELU(), drop1=nn.Dropout(0.1),
                fc2=nn.Linear(64, 16), drop2=nn.Dropout(0.1),
            )
        )  # fmt: skip

    return {
        "mlp": (mlp, 16, {"default": 2, "bias_in_dropout": 2, "no_linear_dropout": 1}),
        "linear_relu": (lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU()), 16, 1),
        "linear_dropout": (lambda: nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1)), 16,
                           {"default": 1, "bias_in_dropout": 1, "no_linear_dropout": 0}),
        "no_bias": (lambda: nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Dropout(0.1),
                                          nn.Linear(32, 8, bias=False), nn.Dropout(0.1)), 16,
                    {"default": 2, "bias_in_dropout": 2, "no_linear_dropout": 1}),
        "full": (full, 16, {"default": 3, "bias_in_dropout": 3, "no_linear_dropout": 2}),
        "after_norm": (after_norm, 16, 2),
        "named": (named, 16, {"default": 2, "bias_in_dropout": 2, "no_linear_dropout": 1}),
    }  # fmt: skip


SEQUENTIAL = _sequential_cases()


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", SEQUENTIAL)
def test_sequential_state_dict_round_trip(case, option):
    build, n_in, replaced = SEQUENTIAL[case]
    replaced = replaced[option] if isinstance(replaced, dict) else replaced
    check_round_trip(build, OPTIONS[option], lambda: torch.randn(3, 5, n_in), replaced)


@pytest.mark.parametrize("option", OPTIONS)
def test_a_bias_run_in_the_dropouts_pass_keeps_the_linears_name(option):
    """The issue's model: named_parameters(), the state_dict and an optimizer's param group built from
    named_parameters() all call the first bias ``0.bias``, and a training step changes it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Dropout(0.1), nn.Linear(16, 4), nn.Dropout(0.1))
    names = dict(model.named_parameters())
    keys = list(model.state_dict())
    patch(model, **OPTIONS[option])
    assert type(model[2]) is nn.Identity and model[0].bias is names["0.bias"]
    assert_one_name_per_parameter(model, names)
    assert list(model.state_dict()) == keys == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert list(model.state_dict(prefix="mlp.")) == [f"mlp.{k}" for k in keys]

    opt = torch.optim.SGD(model.named_parameters(), lr=0.1)  # the group keeps the names (param_names)
    assert opt.state_dict()["param_groups"][0]["param_names"] == keys
    before = names["0.bias"].detach().clone()
    model.train()(torch.randn(32, 8)).square().sum().backward()
    opt.step()
    assert not torch.equal(model.state_dict()["0.bias"], before), "the bias the fused pass adds must train"


def test_loading_leaves_the_callers_dict_alone_and_missing_keys_still_fail():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1))
    source = randomize(copy.deepcopy(model)).state_dict()
    patch(model)
    keys = list(source)
    model.load_state_dict(source, strict=True)
    assert list(source) == keys, "load_state_dict must not rename the caller's entries"
    assert torch.equal(model[0].bias, source["0.bias"])
    del source["0.bias"]
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(source, strict=True)
    source["0.bias"] = torch.zeros(16)
    source["0.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*0\.extra"):
        model.load_state_dict(source, strict=True)


def test_checkpoint_with_the_dropout_key_still_loads():
    """A checkpoint that names the bias by the dropout's key (``2.bias``) loads into the Linear's."""
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Dropout(0.1))
    patch(model)
    old = {"0.weight": torch.randn(16, 8), "2.bias": torch.randn(16)}
    model.load_state_dict(old, strict=True)
    assert torch.equal(model[0].weight, old["0.weight"]) and torch.equal(model[0].bias, old["2.bias"])


def test_copies_keep_the_keys_and_save_their_own_tensors():
    """deepcopy and pickling (torch.save of the whole model) keep the keys, the copy's own parameters
    under them, and carry the dropout-key hook to the copy."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 8), nn.Dropout(0.1))
    keys = list(model.state_dict())
    patch(model, bias_in_linear=False)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        with torch.no_grad():
            twin[0].bias.normal_()
        saved = twin.state_dict()
        assert list(saved) == keys
        assert torch.equal(saved["0.bias"], twin[0].bias) and not torch.equal(saved["0.bias"], model[0].bias)
        state = randomize(copy.deepcopy(model)).state_dict()
        twin.load_state_dict(state, strict=True)
        assert torch.equal(twin[0].bias, state["0.bias"]) and torch.equal(twin[3].bias, state["3.bias"])
        state["2.bias"] = state.pop("0.bias").neg()
        twin.load_state_dict(state, strict=True)
        assert torch.equal(twin[0].bias, state["2.bias"]) and not torch.equal(model[0].bias, state["2.bias"])


# ----------------------------------------------------------------------------- plain modules


class _AttributeMLP(nn.Module):
    """An MLP with named attributes, not an nn.Sequential: patch does not rewrite it (it recognizes
    Sequentials and Hugging Face blocks), so nothing about it may change."""

    def __init__(self, dim: int = 16, hidden: int = 48) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class _Block(nn.Module):
    """Attribute MLP, a named Sequential MLP, and parameters after both (siblings saved after the hook)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn_mlp = _AttributeMLP(dim)
        self.mlp = nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(dim, 4 * dim), act=nn.ReLU(), drop=nn.Dropout(0.1), fc2=nn.Linear(4 * dim, dim)
            )
        )
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_mlp(self.norm(x))
        return self.head(x + self.mlp(x))


@pytest.mark.parametrize("option", OPTIONS)
def test_attribute_mlp_is_left_alone(option):
    check_round_trip(_AttributeMLP, OPTIONS[option], lambda: torch.randn(4, 16), 0)


@pytest.mark.parametrize("option", OPTIONS)
def test_nested_blocks_state_dict_round_trip(option):
    build = lambda: nn.Sequential(_Block(), _Block())  # noqa: E731
    check_round_trip(build, OPTIONS[option], lambda: torch.randn(2, 6, 16), 2)
