"""dispatch.patch: what it replaces, where, and that the patched model computes the same function.

The Hugging Face cases build GPT-2 and BERT from small configs (no download) and skip without
transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dispatch import patch
from dispatch.nn import FusedBiasActDropout, FusedLinear, FusedMLP
from dispatch.patch import activation_name
from patch_checks import NO_TRANSFORMERS, assert_same


def _transformers():
    return pytest.importorskip("transformers", reason=NO_TRANSFORMERS)


# ----------------------------------------------------------------------------- plain torch


def _mlp(p: float = 0.1) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.GELU(approximate="tanh"),
        nn.Dropout(p),
        nn.Linear(64, 16),
        nn.Dropout(p),
        nn.Linear(16, 32),
        nn.SiLU(),
        nn.Linear(32, 8),
        nn.Tanh(),
    )


def test_sequential_report_and_modules():
    model = _mlp()
    weights = [model[i].weight for i in (0, 3, 5)]
    report = patch(model)
    assert len(report) == 3
    text = str(report)
    assert "0=Linear(16->64) + 1=GELU + 2=Dropout(p=0.1)  ->  0=FusedLinear(gelu_tanh, dropout=0.1)" in text
    assert "3=FusedLinear() + 4=FusedBiasActDropout(identity, p=0.1, bias=False)" in text
    assert "5=FusedLinear(silu)" in text
    assert "activation Tanh has no fused equivalent" in text
    assert [type(m).__name__ for m in model] == [
        "FusedLinear", "Identity", "Identity",
        "FusedLinear", "FusedBiasActDropout",
        "FusedLinear", "Identity", "Linear", "Tanh",
    ]  # fmt: skip
    assert model[0].activation == "gelu_tanh" and model[0].dropout == 0.1 and model[0].bias is not None
    assert model[4].activation == "identity" and model[4].bias is None and model[3].bias is not None
    assert [model[i].weight for i in (0, 3, 5)] == weights, "parameters must be reused, not copied"
    assert len(patch(model)) == 0, "a second patch must find nothing left to fuse"


@pytest.mark.parametrize("train", (False, True), ids=("eval", "train_p0"))
def test_sequential_same_function_without_dropout(train):
    p = 0.0 if train else 0.3
    original = _mlp(p).train(train)
    patched = copy.deepcopy(original)
    patch(patched)
    x = torch.randn(5, 7, 16, requires_grad=True)
    y0, y1 = original(x), patched(x)
    assert_same(y1, y0)
    g = torch.randn_like(y0)
    (g0,) = torch.autograd.grad(y0, x, g)
    (g1,) = torch.autograd.grad(y1, x, g)
    assert_same(g1, g0)


def test_sequential_training_dropout_runs_through_fused_module():
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.5))
    patch(model)
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)  # relu(0 + 1) = 1 everywhere: zeros are exactly the dropped elements
    x = torch.randn(64, 32)
    y1, y2 = model(x), model(x)
    assert 0.45 < float((y1 == 0).float().mean()) < 0.55
    assert set(y1.unique().tolist()) <= {0.0, 2.0}
    assert not torch.equal(y1, y2)
    y1.sum().backward()
    torch.testing.assert_close(model[0].bias.grad, (y1 != 0).float().sum(0) * 2.0)  # relu' = 1, scale 2
    model.eval()
    torch.testing.assert_close(model(x), torch.ones(64, 256), rtol=0, atol=0)


@pytest.mark.parametrize("bias_in_linear", (True, False))
def test_where_a_linear_dropout_run_keeps_its_bias(bias_in_linear):
    """Linear -> Dropout keeps its bias in the linear's GEMM and the dropout op gets none (the default),
    or with bias_in_linear=False one FusedLinear adds it in the dropout's pass, as for runs with an
    activation either way. The bias stays the linear's parameter. Same function."""
    original = _mlp(0.3).eval()
    model = copy.deepcopy(original)
    report = patch(model, bias_in_linear=bias_in_linear)
    if bias_in_linear:
        assert "3=FusedLinear() + 4=FusedBiasActDropout(identity, p=0.3, bias=False)" in str(report)
        assert model[4].bias is None and model[4].p == 0.3 and model[4].activation == "identity"
        assert model[3].dropout == 0.0
    else:
        assert "3=FusedLinear(identity, dropout=0.3)" in str(report)
        assert type(model[4]) is nn.Identity and model[3].dropout == 0.3
    assert model[3].bias is not None and torch.equal(model[3].bias, original[3].bias)
    assert model[0].dropout == 0.3 and model[0].bias is not None and type(model[2]) is nn.Identity
    x = torch.randn(5, 7, 16)
    assert_same(model(x), original(x))
    y = model[:5].train()(torch.randn(64, 16))  # up to the dropout after the bare linear
    assert 0.2 < float((y == 0).float().mean()) < 0.4, "dropout did not run at p = 0.3"


def test_linear_dropout_false_leaves_runs_without_an_activation_alone():
    """patch(linear_dropout=False): Linear -> Dropout stays native (reported as skipped, with why);
    runs with an activation are fused as before. Same function."""
    original = _mlp(0.3).eval()
    model = copy.deepcopy(original)
    report = patch(model, linear_dropout=False)
    assert type(model[3]) is nn.Linear and type(model[4]) is nn.Dropout
    assert isinstance(model[0], FusedLinear) and model[0].dropout == 0.3 and type(model[2]) is nn.Identity
    why = "Linear -> Dropout without an activation: left alone (linear_dropout=False)"
    assert ("3", why) in report.skipped
    assert len(report) == 2  # 0-1-2 and 5-6; 7-8's Tanh has no fused form
    x = torch.randn(5, 7, 16)
    assert_same(model(x), original(x))


def test_activation_names():
    assert activation_name(nn.GELU()) == "gelu"
    assert activation_name(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert activation_name(nn.ReLU(inplace=True)) == "relu"
    assert activation_name(nn.SiLU()) == "silu"
    assert activation_name(nn.LeakyReLU()) == "leaky_relu"
    assert activation_name(nn.LeakyReLU(0.2)) is None
    assert activation_name(nn.Tanh()) is None


def test_patch_rejects_non_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch(lambda x: x)


# ----------------------------------------------------------------------------- Hugging Face


def _gpt2(activation: str = "gelu_new", pdrop: float = 0.1):
    tf = _transformers()
    config = tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, activation_function=activation,
        resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop, bos_token_id=0, eos_token_id=0,
        initializer_range=0.3,  # pre-activations of order 1, where gelu and gelu_tanh differ
    )  # fmt: skip
    return tf.GPT2LMHeadModel(config)


def _bert(activation: str = "gelu"):
    tf = _transformers()
    config = tf.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=32, hidden_act=activation, initializer_range=0.3,
    )  # fmt: skip
    return tf.BertModel(config)


def test_hf_activation_names():
    tf = _transformers()
    act = tf.activations.ACT2FN
    expected = {
        "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
        "relu": "relu", "silu": "silu", "swish": "silu", "relu2": "squared_relu", "leaky_relu": "leaky_relu",
        "linear": "identity", "quick_gelu": None, "tanh": None,
    }  # fmt: skip
    assert {name: activation_name(act[name]) for name in expected} == expected


@pytest.mark.parametrize("activation", ("gelu_new", "gelu_pytorch_tanh", "relu", "relu2"))
def test_gpt2_eval_same_logits(activation):
    original = _gpt2(activation).eval()
    patched = copy.deepcopy(original)
    params = [id(p) for p in patched.parameters()]
    report = patch(patched)
    assert [id(p) for p in patched.parameters()] == params  # reused, none copied: an optimizer keeps them
    assert [(r.path, r.block) for r in report.replaced] == [("transformer.h.0.mlp", "GPT2MLP"),
                                                            ("transformer.h.1.mlp", "GPT2MLP")]  # fmt: skip
    assert not report.skipped
    mlp, before = patched.transformer.h[0].mlp, original.transformer.h[0].mlp
    fused_act = activation_name(before.act)
    assert f"FusedMLP({fused_act}, p_out=0.1)" in str(report)
    # the whole block is one FusedMLP over the block's own Conv1D layers, under their names
    assert isinstance(mlp, FusedMLP) and mlp.activation == fused_act and mlp.p_out == 0.1 and mlp.p == 0.0
    assert mlp.transposed and type(mlp.c_fc) is type(before.c_fc) and type(mlp.c_proj) is type(before.c_proj)
    torch.testing.assert_close(mlp.c_fc.weight, before.c_fc.weight, rtol=0, atol=0)
    assert {k: v.shape for k, v in patched.state_dict().items()} == {
        k: v.shape for k, v in original.state_dict().items()
    }
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        assert_same(patched(ids).logits, original(ids).logits)


def test_gpt2_training_without_dropout_same_loss_and_gradients():
    original = _gpt2(pdrop=0.0).train()
    patched = copy.deepcopy(original)
    report = patch(patched)
    assert len(report) == 2 and "FusedMLP(gelu_tanh)" in str(report)  # one block per layer, p_out = 0
    ids = torch.randint(0, 128, (2, 24))
    losses = []
    for model in (original, patched):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert_same(losses[1].detach(), losses[0].detach())
    for i in range(2):
        for name in ("c_fc", "c_proj"):
            a, b = (getattr(m.transformer.h[i].mlp, name) for m in (original, patched))
            assert_same(b.weight.grad, a.weight.grad)
            assert_same(b.bias.grad, a.bias.grad)


def test_gpt2_trains_with_dropout():
    model = _gpt2().train()
    assert len(patch(model)) == 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 24))
    losses = []
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        assert model.transformer.h[0].mlp.c_proj.bias.grad is not None
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("activation", ("gelu", "relu2"))
def test_bert_eval_same_output(activation):
    original = _bert(activation).eval()
    patched = copy.deepcopy(original)
    report = patch(patched)
    blocks = [(r.path, r.block) for r in report.replaced]
    assert blocks == [
        (f"encoder.layer.{i}.{part}", block)
        for i in (0, 1)
        for part, block in (("intermediate", "BertIntermediate"), ("output", "BertOutput"))
    ]
    layer = patched.encoder.layer[0]
    expected = activation_name(original.encoder.layer[0].intermediate.intermediate_act_fn)
    assert layer.intermediate.dense.activation == expected
    assert isinstance(layer.output.dropout, FusedBiasActDropout)
    assert isinstance(layer.attention.output.dense, nn.Linear), "only MLP blocks are patched"
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    with torch.no_grad():
        want = original(ids, attention_mask=mask).last_hidden_state
        assert_same(patched(ids, attention_mask=mask).last_hidden_state, want)


@pytest.mark.gpu
def test_gpt2_cuda_float32_and_bf16_autocast():
    """On the GPU (where the dispatcher may pick fused kernels): float32 logits as the original's; under
    bf16 autocast, at most twice the original's own bf16 error (against its float32 logits) plus the
    bf16 tolerance; and a training step with dropout runs."""
    from dispatch.contracts.tolerances import check

    original = _gpt2().cuda().eval()
    patched = copy.deepcopy(original)
    patch(patched)
    ids = torch.randint(0, 128, (4, 32), device="cuda")
    with torch.no_grad():
        want = original(ids).logits
        assert_same(patched(ids).logits, want)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got_bf16, eager_bf16 = patched(ids).logits, original(ids).logits
    check("bf16 logits", got_bf16, want, eager_bf16)
    patched.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = patched(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(patched.transformer.h[0].mlp.c_fc.weight.grad).all()
