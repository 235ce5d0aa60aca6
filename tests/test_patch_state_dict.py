"""dispatch.patch keeps the state_dict: the same keys, in the same order, with the same shapes and
tensors, so the original's checkpoint loads into the patched model and the patched model's into the
original, both with strict=True, and the two then compute the same function. Every parameter keeps
one name: ``named_parameters()`` and the state_dict call it what the original did.

Every form ``patch`` rewrites is covered: a whole MLP block (one FusedMLP over the block's own layers,
GPT-2's, and a Sequential that is exactly an MLP), Linear + activation (fused into the GEMM), Linear +
activation + Dropout (bias, activation and dropout in one pass after the GEMM), Linear + Dropout (bias
in the GEMM, or in the dropout's pass with ``bias_in_linear=False``, or left alone with
``linear_dropout=False``), and runs with nothing to fuse. Hugging Face blocks are checked on lookalikes
(the class names, modules, attribute names and Conv1D layout ``patch`` recognizes) and, where
transformers is installed, on real GPT-2 and BERT built from small configs.
"""

from __future__ import annotations

import copy
import io
from collections import OrderedDict

import pytest
import torch
from torch import nn

from dispatch import patch
from dispatch.contracts.tolerances import ATOL, RTOL

NO_TRANSFORMERS = "transformers is not installed (pip install transformers): real Hugging Face models skipped"

OPTIONS = {
    "default": {},
    "bias_in_dropout": {"bias_in_linear": False},
    "no_linear_dropout": {"linear_dropout": False},
}


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL[want.dtype] + RTOL[want.dtype] * scale)


def _randomize(model: nn.Module) -> nn.Module:
    """Fresh random values in every parameter (biases too, which some modules start at zero), so a
    load that skipped an entry would show."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _assert_state_dicts_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


def _assert_one_name_per_parameter(model: nn.Module, names: dict[str, nn.Parameter]) -> None:
    """``model``'s parameters are ``names`` (the original's), by the same names in named_parameters() and
    in the state_dict."""
    params = dict(model.named_parameters())
    assert list(params) == list(names) and all(params[n] is p for n, p in names.items())
    saved = model.state_dict(keep_vars=True)
    assert {k: v for k, v in saved.items() if isinstance(v, nn.Parameter)} == params


def _check_round_trip(build, options: dict, x_fn, replaced: int) -> None:
    """patch(build()) keeps the keys and the parameters' names; original -> patched and patched ->
    original load strictly, with identical tensors and the same eval-mode outputs."""
    original = _randomize(build()).eval()
    want = original.state_dict()

    patched = copy.deepcopy(original)
    names = dict(patched.named_parameters())
    report = patch(patched, **options)
    assert len(report) == replaced, str(report)
    _assert_state_dicts_equal(patched.state_dict(), want)  # its own parameters, saved under the old keys
    _assert_one_name_per_parameter(patched, names)

    # the original's checkpoint into a separately built, patched model
    target = _randomize(build()).eval()
    patch(target, **options)
    assert any(not torch.equal(v, want[k]) for k, v in target.state_dict().items())
    target.load_state_dict(want, strict=True)
    _assert_state_dicts_equal(target.state_dict(), want)
    x = x_fn()
    with torch.no_grad():
        _assert_same(target(x), original(x))

    # and the patched model's checkpoint into an unpatched one
    back = _randomize(build()).eval()
    back.load_state_dict(target.state_dict(), strict=True)
    _assert_state_dicts_equal(back.state_dict(), want)
    with torch.no_grad():
        _assert_same(back(x), original(x))


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
    _check_round_trip(build, OPTIONS[option], lambda: torch.randn(3, 5, n_in), replaced)


@pytest.mark.parametrize("option", OPTIONS)
def test_a_bias_run_in_the_dropouts_pass_keeps_the_linears_name(option):
    """The issue's model: named_parameters(), the state_dict and an optimizer's param group built from
    named_parameters() all call the first bias ``0.bias``, and a training step changes it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Dropout(0.1), nn.Linear(16, 4), nn.Dropout(0.1))
    names = dict(model.named_parameters())
    keys = list(model.state_dict())
    patch(model, **OPTIONS[option])
    assert type(model[2]) is nn.Identity and model[0].bias is names["0.bias"]
    _assert_one_name_per_parameter(model, names)
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
    source = _randomize(copy.deepcopy(model)).state_dict()
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
        state = _randomize(copy.deepcopy(model)).state_dict()
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
    _check_round_trip(_AttributeMLP, OPTIONS[option], lambda: torch.randn(4, 16), 0)


@pytest.mark.parametrize("option", OPTIONS)
def test_nested_blocks_state_dict_round_trip(option):
    build = lambda: nn.Sequential(_Block(), _Block())  # noqa: E731
    _check_round_trip(build, OPTIONS[option], lambda: torch.randn(2, 6, 16), 2)


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
    _check_round_trip(_GPT2Like, OPTIONS[option], lambda: torch.randn(2, 7, 32), 2)  # one FusedMLP a layer


@pytest.mark.parametrize("option", OPTIONS)
def test_bert_lookalike_state_dict_round_trip(option):
    replaced = 2 if option == "no_linear_dropout" else 4
    _check_round_trip(_BertLike, OPTIONS[option], lambda: torch.randn(2, 7, 32), replaced)


# ----------------------------------------------------------------------------- real Hugging Face


class _LastHidden(nn.Module):
    """A Hugging Face model's output as one tensor, for the shared round-trip check."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).last_hidden_state


def _real_gpt2():
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _LastHidden(tf.GPT2Model(config))


def _real_bert():
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = tf.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=32,
    )  # fmt: skip
    return _LastHidden(tf.BertModel(config))


@pytest.mark.parametrize("option", OPTIONS)
def test_real_gpt2_state_dict_round_trip(option):
    _real_gpt2()  # skips without transformers
    _check_round_trip(_real_gpt2, OPTIONS[option], lambda: torch.randint(0, 128, (2, 24)), 2)


@pytest.mark.parametrize("option", OPTIONS)
def test_real_bert_state_dict_round_trip(option):
    _real_bert()
    replaced = 2 if option == "no_linear_dropout" else 4
    _check_round_trip(_real_bert, OPTIONS[option], lambda: torch.randint(0, 128, (2, 20)), replaced)
