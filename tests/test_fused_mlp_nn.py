"""dispatch.nn.FusedMLP against the op's float64 reference (fresh and adopted layers, both gate layouts,
the Conv1D layout, dropout, autocast, compile), and dispatch.patch mapping whole MLP blocks onto it:
GPT-2, ViT, LLaMA, Mistral and Qwen2 built from tiny configs (no download; skipped without transformers),
BERT (fused per linear), and hand-written nn.Sequential MLPs. For each: the same outputs in eval, the
same gradients in training at p = 0, the same state_dict keys and parameter names, and checkpoints that
load both ways with strict=True.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dispatch import patch
from dispatch.contracts.activations import GATES
from dispatch.contracts.tolerances import check
from dispatch.nn import FusedLinear, FusedMLP
from dispatch.ops import fused_mlp as mlp_spec
from patch_checks import NO_TRANSFORMERS, LastHidden


def _reference(module: FusedMLP, x: torch.Tensor, upcast: bool) -> torch.Tensor:
    """The op's reference over the module's parameters, read through its children; no dropout."""
    t = (lambda w: w.t()) if module.transposed else (lambda w: w)  # noqa: E731
    if module.activation in GATES and module.gate_layout == "pair":
        gate, up, out = module.gate_proj, module.up_proj, module.down_proj
        w_in, w_up, b_in, b_up = t(gate.weight), t(up.weight), gate.bias, up.bias
    else:
        out = module.fc2
        w_in, w_up, b_in, b_up = t(module.fc1.weight), None, module.fc1.bias, None
    rows = x.reshape(-1, x.shape[-1])
    w_out, act = t(out.weight), module.activation
    block = mlp_spec.MLPOperands(rows, w_in, w_up, b_in, b_up, w_out, out.bias, act, 0.0, 0.0)
    return mlp_spec.reference(block, upcast=upcast).view(*x.shape[:-1], -1)


def _grads(y: torch.Tensor, inputs: list, grad_y: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(y, inputs, grad_y))


# ----------------------------------------------------------------------------- the module


CASES = (  # activation, gate_layout, transposed
    ("gelu", "stacked", False), ("squared_relu", "stacked", True), ("swiglu", "stacked", False),
    ("swiglu", "pair", False), ("geglu_tanh", "pair", True), ("reglu", "stacked", True),
)  # fmt: skip


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation, layout, transposed", CASES)
def test_matches_reference_output_and_every_gradient(activation, layout, transposed, dtype):
    module = FusedMLP(13, 11, 7, activation, dtype=dtype, gate_layout=layout, transposed=transposed)
    x = torch.randn(2, 5, 13, dtype=dtype, requires_grad=True)
    grad_y = torch.randn(2, 5, 7, dtype=dtype)
    inputs = [x, *module.parameters()]
    y = module(x)
    got = [y, *_grads(y, inputs, grad_y)]
    ref_y = _reference(module, x, upcast=True)
    ref = [ref_y, *_grads(ref_y, inputs, grad_y.double())]
    eager_y = _reference(module, x, upcast=False)
    eager = [eager_y, *_grads(eager_y, inputs, grad_y)]
    names = ["y", "grad_x", *(f"grad_{n}" for n, _ in module.named_parameters())]
    for name, out, r, e in zip(names, got, ref, eager):
        assert out.dtype == dtype, name
        check(name, out.detach(), r.detach(), e.detach())


def test_fresh_parameters_names_shapes_and_linear_init():
    module = FusedMLP(24, 40, 8)
    assert list(module.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert module.fc1.weight.shape == (40, 24) and module.fc2.weight.shape == (8, 40)
    for layer, fan_in in ((module.fc1, 24), (module.fc2, 40)):  # nn.Linear's U(-1/sqrt(in), 1/sqrt(in))
        bound = 1 / math.sqrt(fan_in)
        for p in (layer.weight, layer.bias):
            assert 0.8 * bound < float(p.detach().abs().max()) <= bound
    assert FusedMLP(24, 40, activation="swiglu").fc1.weight.shape == (80, 24)  # [gate; up] stacked
    pair = FusedMLP(24, 40, activation="swiglu", bias=False, dtype=torch.float64, gate_layout="pair")
    assert {k: tuple(v.shape) for k, v in pair.state_dict().items()} == {
        "gate_proj.weight": (40, 24), "up_proj.weight": (40, 24), "down_proj.weight": (24, 40)
    }  # fmt: skip
    assert all(p.dtype == torch.float64 for p in pair.parameters())
    flipped = FusedMLP(24, 40, transposed=True)
    assert flipped.fc1.weight.shape == (24, 40)
    assert float(flipped.fc1.weight.detach().abs().max()) <= 1 / math.sqrt(24)


def test_from_linears_adopts_layers_by_reference_under_their_names():
    fc1, fc2 = nn.Linear(16, 48).double(), nn.Linear(48, 16).double()
    module = FusedMLP.from_linears(fc1, "gelu", fc2, names=("up", "down")).eval()
    assert module.up is fc1 and module.down is fc2
    assert dict(module.named_parameters()) == {"up.weight": fc1.weight, "up.bias": fc1.bias,
                                               "down.weight": fc2.weight, "down.bias": fc2.bias}  # fmt: skip
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    torch.testing.assert_close(module(x), fc2(F.gelu(fc1(x))))
    gate, up, down = (nn.Linear(*shape, bias=False).double() for shape in ((16, 24), (16, 24), (24, 10)))
    gated = FusedMLP.from_linears((gate, up), "swiglu", down).eval()
    assert list(gated.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert gated.gate_proj is gate and gated.gate_layout == "pair" and gated.out_features == 10
    torch.testing.assert_close(gated(x), down(F.silu(gate(x)) * up(x)))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: FusedMLP(8, 16, activation="tanh"), ValueError, "activation must be one of"),
        (lambda: FusedMLP(8, 16, gate_layout="pair"), ValueError, "gate_layout='pair' needs a gated"),
        (lambda: FusedMLP(8, 16, gate_layout="split"), ValueError, "gate_layout must be"),
        (lambda: FusedMLP(8, 16, p=1.5), ValueError, "p must be a number in"),
        (lambda: FusedMLP(8, 16, transposed=1), TypeError, "transposed must be a bool"),
        (lambda: FusedMLP.from_linears((nn.Linear(8, 4), nn.Linear(8, 4)), "gelu", nn.Linear(4, 8)),
         ValueError, "pair only for a gated"),
        (lambda: FusedMLP.from_linears(nn.Linear(8, 16), "gelu", nn.Linear(12, 8)),
         ValueError, "fc2 takes 12 features; the activation gives 16"),
        (lambda: FusedMLP.from_linears(nn.Linear(8, 16), "swiglu", nn.Linear(16, 8)),
         ValueError, "fc2 takes 16 features; the activation gives 8"),
        (lambda: FusedMLP.from_linears(nn.Linear(8, 17), "swiglu", nn.Linear(8, 8)),
         ValueError, r"fc1 must stack \[gate; up\] for 'swiglu': got 17 outputs"),
        (lambda: FusedMLP.from_linears((nn.Linear(8, 4), nn.Linear(8, 4, bias=False)), "reglu",
                                       nn.Linear(4, 8)), ValueError, "biases both or neither"),
        (lambda: FusedMLP.from_linears(nn.Linear(8, 16), "gelu", FusedLinear(16, 8, transposed=True)),
         ValueError, "store weights one way"),
        (lambda: FusedMLP.from_linears(FusedLinear(8, 16, activation="relu"), "gelu", nn.Linear(16, 8)),
         TypeError, "fc1 must be an nn.Linear"),
        (lambda: FusedMLP.from_linears(nn.Linear(8, 16), "gelu", nn.Linear(16, 8), names=("a", "a")),
         ValueError, "2 distinct child names"),
    ],
)  # fmt: skip
def test_bad_arguments_name_what_was_expected(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_x_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match=r"in_features=8 of this FusedMLP, got x of shape \(3, 9\)"):
        FusedMLP(8, 16)(torch.randn(3, 9))


def test_dropout_runs_in_training_mode_only():
    module = FusedMLP(32, 64, 48, "relu", p_out=0.5)
    x = torch.randn(64, 32)
    y = module(x)
    want = module.eval()(x)
    torch.testing.assert_close(module(x), want, rtol=0, atol=0)  # eval: no mask
    assert 0.4 < float((y == 0).float().mean()) < 0.6
    kept = y != 0
    torch.testing.assert_close(y[kept], 2.0 * want[kept])  # kept outputs scaled by 1 / (1 - p)
    hidden = FusedMLP(32, 64, 48, "relu", p=0.5)
    assert not torch.equal(hidden(x), hidden.eval()(x))


def test_autocast_cpu_bf16_casts_like_linear():
    module = FusedMLP(40, 24, 16, "swiglu", gate_layout="pair")
    x = torch.randn(6, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16
    y.backward(torch.randn_like(y))
    assert all(p.grad.dtype == torch.float32 for p in module.parameters())
    rounded = copy.deepcopy(module).to(torch.bfloat16)  # the operands autocast gives the op
    ref = _reference(rounded, x.bfloat16(), upcast=True)
    check("y", y.detach(), ref.detach(), _reference(rounded, x.bfloat16(), upcast=False).detach())


def test_extra_repr():
    text = repr(FusedMLP(8, 16, 4, "geglu", p=0.1, p_out=0.2, gate_layout="pair", transposed=True))
    head = "in_features=8, hidden_features=16, out_features=4, activation='geglu', gate_layout='pair'"
    assert f"{head}, p=0.1, p_out=0.2, transposed=True" in text and "(down_proj): FusedLinear(" in text


def test_compiles_fullgraph():
    module = FusedMLP(8, 16, activation="swiglu", gate_layout="pair").eval()
    x = torch.randn(4, 8)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")  # tracing only: no C++ build
    torch.testing.assert_close(compiled(x), module(x))
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- patch: Hugging Face


def _build(family: str, pdrop: float) -> nn.Module:
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    size = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
            "initializer_range": 0.3}  # fmt: skip
    text = {**size, "vocab_size": 64, "max_position_embeddings": 32}
    decoder = {**text, "num_key_value_heads": 2, "attention_dropout": pdrop}
    if family == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                               resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop, bos_token_id=0,
                               eos_token_id=0, initializer_range=0.3)  # fmt: skip
        return LastHidden(tf.GPT2Model(config))
    if family in ("bert", "vit"):
        drops = {"hidden_dropout_prob": pdrop, "attention_probs_dropout_prob": pdrop}
        if family == "bert":
            return LastHidden(tf.BertModel(tf.BertConfig(**text, **drops)))
        return LastHidden(tf.ViTModel(tf.ViTConfig(**size, **drops, image_size=16, patch_size=8)))
    if family.startswith("llama"):
        extra = {"hidden_act": "gelu_pytorch_tanh", "mlp_bias": True} if family == "llama_geglu_bias" else {}
        return LastHidden(tf.LlamaModel(tf.LlamaConfig(**decoder, **extra)))
    names = {"mistral": ("MistralModel", "MistralConfig"), "qwen2": ("Qwen2Model", "Qwen2Config")}
    model, config = names[family]
    return LastHidden(getattr(tf, model)(getattr(tf, config)(**decoder)))


# family -> (the blocks patch replaces in a layer, FusedMLP's activation (None: fused per linear), whether
# the block's output dropout is the config's; ViT's dropout follows its MLP in the layer)
FAMILIES = {
    "gpt2": (("GPT2MLP",), "gelu_tanh", True),
    "vit": (("ViTMLP",), "gelu", False),
    "llama": (("LlamaMLP",), "swiglu", False),
    "llama_geglu_bias": (("LlamaMLP",), "geglu_tanh", False),
    "mistral": (("MistralMLP",), "swiglu", False),
    "qwen2": (("Qwen2MLP",), "swiglu", False),
    "bert": (("BertIntermediate", "BertOutput"), None, False),  # its MLP spans two blocks
}


def _input(family: str) -> torch.Tensor:
    if family == "vit":
        return torch.randn(2, 3, 16, 16, dtype=torch.float64)
    return torch.randint(0, 64, (2, 9))


def _patched(family: str, pdrop: float) -> tuple[nn.Module, nn.Module]:
    """(original, patched copy), float64; checks the report, the parameters' names and the keys."""
    blocks, activation, drops = FAMILIES[family]
    p_out = pdrop if drops else 0.0
    original = _build(family, pdrop).double()
    model = copy.deepcopy(original)
    names = dict(model.named_parameters())
    report = patch(model, norms=False)  # float64: the RMSNorms' patch (test_add_norm_nn.py) computes in it
    blocks = [b for b in blocks if pdrop > 0 or b != "BertOutput"]  # Linear -> Dropout(0): nothing to fuse
    assert [r.block for r in report.replaced] == blocks * 2, str(report)
    assert all(why.startswith("nothing to fuse") for _, why in report.skipped), str(report)
    for r in report.replaced:
        fused = model.get_submodule(r.path)
        if activation is None:
            assert not isinstance(fused, FusedMLP) and "FusedLinear(" in r.after
        else:
            assert isinstance(fused, FusedMLP) and fused.activation == activation and fused.p == 0.0
            assert fused.p_out == p_out and fused.training == model.training
            assert r.after == f"FusedMLP({activation}{f', p_out={p_out}' if p_out else ''})", r.after
    params = dict(model.named_parameters())
    assert list(params) == list(names) and all(params[n] is p for n, p in names.items())
    saved = model.state_dict(keep_vars=True)
    assert {k: v for k, v in saved.items() if isinstance(v, nn.Parameter)} == params
    assert list(saved) == list(original.state_dict())
    return original, model


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_eval_same_output_and_state_dict_loads_both_ways(family):
    original, model = _patched(family, pdrop=0.1)
    x = _input(family)
    with torch.no_grad():
        want = original.eval()(x)
        torch.testing.assert_close(model.eval()(x), want)
        target = _build(family, 0.1).double().eval()  # other random weights
        patch(target, norms=False)
        target.load_state_dict(original.state_dict(), strict=True)
        torch.testing.assert_close(target(x), want)
        back = _build(family, 0.1).double().eval()
        back.load_state_dict(target.state_dict(), strict=True)
        torch.testing.assert_close(back(x), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_training_at_p0_same_gradients(family):
    original, model = _patched(family, pdrop=0.0)
    x = _input(family)
    y0, y1 = original.train()(x), model.train()(x)
    grad_y = torch.randn_like(y0)
    y0.backward(grad_y)
    y1.backward(grad_y)
    torch.testing.assert_close(y1, y0)
    for (name, p0), p1 in zip(original.named_parameters(), model.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("act, why", (
    ("tanh", "activation Tanh has no fused equivalent"),
    ("relu2", "act_fn=ReLUSquaredActivation: gates are fused for silu, gelu, gelu_tanh, relu only"),
))  # fmt: skip
def test_hf_gated_block_without_a_fused_gate_is_left_alone(act, why):
    tf = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, hidden_act=act)  # fmt: skip
    model = tf.LlamaModel(config)
    report = patch(model)
    assert [path for path, _ in report.skipped] == ["layers.0.mlp", "layers.1.mlp"]
    assert {r.block for r in report.replaced} == {"LlamaRMSNorm"}  # the norms, whatever the MLPs
    assert all(reason.endswith(why) for _, reason in report.skipped), report.skipped
    assert type(model.layers[0].mlp).__name__ == "LlamaMLP"


# ----------------------------------------------------------------------------- patch: nn.Sequential


class _Net(nn.Module):
    """A Sequential that is exactly an MLP (one FusedMLP), and one with more (fused per linear)."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(
            nn.Linear(16, 48), nn.GELU(approximate="tanh"), nn.Dropout(p), nn.Linear(48, 16), nn.Dropout(p)
        )  # fmt: skip
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.mlp(self.norm(x)))


@pytest.mark.parametrize("train", (False, True), ids=("eval", "train_p0"))
def test_sequential_mlp_becomes_one_fused_mlp(train):
    original = _Net(0.0 if train else 0.1).double().train(train)
    model = copy.deepcopy(original)
    layers = (model.mlp[0], model.mlp[3])
    report = patch(model)
    mlp_before = "0=Linear(16->48) + 1=GELU + 2=Dropout(p={0}) + 3=Linear(48->16) + 4=Dropout(p={0})"
    p = 0.0 if train else 0.1
    after = "FusedMLP(gelu_tanh)" if train else "FusedMLP(gelu_tanh, p=0.1, p_out=0.1)"
    assert [(r.path, r.block, r.before, r.after) for r in report.replaced] == [
        ("mlp", "Sequential", mlp_before.format(p), after),
        ("head", "Sequential", "0=Linear(16->32) + 1=ReLU", "0=FusedLinear(relu)"),
    ]
    assert report.skipped == [("head.2", "activation Tanh has no fused equivalent")]
    assert isinstance(model.mlp, FusedMLP)
    assert (model.mlp.get_submodule("0"), model.mlp.get_submodule("3")) == layers
    assert list(model.state_dict()) == list(original.state_dict())
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    y0, y1 = original(x), model(x)
    torch.testing.assert_close(y1, y0)
    grad_y = torch.randn_like(y0)
    inputs = [x, *original.parameters()]
    for g0, g1 in zip(_grads(y0, inputs, grad_y), _grads(y1, [x, *model.parameters()], grad_y)):
        torch.testing.assert_close(g1, g0)
    fresh = _Net().double().eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    patch(fresh)
    fresh.load_state_dict(original.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), original.eval()(x))


def test_a_block_held_twice_is_one_fused_mlp_in_both_places():
    model = nn.Module()
    model.a = model.b = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))
    keys = list(model.state_dict())
    assert len(patch(model)) == 1
    assert isinstance(model.a, FusedMLP) and model.b is model.a and list(model.state_dict()) == keys


def test_root_sequential_mlp_is_fused_per_linear():
    """patch cannot put a FusedMLP in place of the model it is given: the per-linear rewrite applies."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    report = patch(model)
    assert [r.after for r in report.replaced] == ["0=FusedLinear(gelu)"] and not report.skipped
    assert type(model[0]) is FusedLinear and type(model[2]) is nn.Linear


@pytest.mark.parametrize("family", ("gpt2", "llama"))
def test_mlp_blocks_false_keeps_the_per_linear_rewrite(family):
    """GPT-2's c_fc -> act and c_proj -> dropout runs become FusedLinear modules as without FusedMLP;
    a gated block has no per-linear form and is left alone. Keys and outputs as the original's."""
    original = _build(family, 0.1).double().eval()
    model = copy.deepcopy(original)
    report = patch(model, mlp_blocks=False, norms=False)  # float64: see _patched
    assert not any(isinstance(m, FusedMLP) for m in model.modules())
    c_proj = "c_proj=FusedLinear() + dropout=FusedBiasActDropout(identity, p=0.1, bias=False)"
    runs = ["c_fc=FusedLinear(gelu_tanh)", c_proj] if family == "gpt2" else []
    assert [r.after for r in report.replaced] == runs * 2
    left_alone = [] if runs else ["a whole MLP block: left alone (mlp_blocks=False)"] * 2
    assert [why for _, why in report.skipped] == left_alone
    assert list(model.state_dict()) == list(original.state_dict())
    x = _input(family)
    with torch.no_grad():
        torch.testing.assert_close(model(x), original(x))
