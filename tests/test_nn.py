"""dispatch.nn modules: against the float64 reference and against nn.Linear / nn.Dropout; state_dict,
initialization, training mode, autocast, torch.compile, CUDA graph capture."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dispatch.contracts.rng as dropout_rng
from dispatch.ops import bias_act_dropout as bad_spec
from dispatch.ops import fused_linear as linear_spec
from dispatch import ACTIVATION_NAMES, use_backend
from dispatch.contracts.activations import ACTIVATIONS
from dispatch.nn import FusedBiasActDropout, FusedLinear
from dispatch.contracts.tolerances import check

DTYPES = (torch.float32, torch.bfloat16)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _grads(y: torch.Tensor, inputs, grad_y: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(y, inputs, grad_y))


# ----------------------------------------------------------------------------- FusedLinear


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ACTIVATION_NAMES)
def test_fused_linear_matches_reference(activation, dtype):
    module = FusedLinear(13, 11, activation=activation, dtype=dtype)
    x = _leaf(torch.randn(2, 5, 13, dtype=dtype))
    grad_y = torch.randn(2, 5, 11, dtype=dtype)
    params = [x, module.weight, module.bias]
    y = module(x)
    got = [y, *_grads(y, params, grad_y)]

    ref_in = [_leaf(t) for t in params]
    ref_y = linear_spec.reference(*ref_in, activation, upcast=True)
    ref = [ref_y, *_grads(ref_y, ref_in, grad_y.double())]
    same_in = [_leaf(t) for t in params]
    eager_y = linear_spec.reference(*same_in, activation)
    eager = [eager_y, *_grads(eager_y, same_in, grad_y)]
    for name, out, r, e in zip(("y", "grad_x", "grad_weight", "grad_bias"), got, ref, eager):
        assert out.dtype == dtype
        check(name, out.detach(), r.detach(), e.detach())


def test_fused_linear_without_bias_equals_linear_then_activation():
    module = FusedLinear(9, 4, bias=False, activation="silu")
    assert module.bias is None
    x = torch.randn(6, 9)
    torch.testing.assert_close(module(x), F.silu(F.linear(x, module.weight)))


@pytest.mark.parametrize("bias", (True, False))
def test_fused_linear_loads_linear_state_dict_unchanged(bias):
    linear = nn.Linear(7, 5, bias=bias)
    module = FusedLinear(7, 5, bias=bias, activation="relu")
    module.load_state_dict(linear.state_dict(), strict=True)
    assert list(module.state_dict()) == list(linear.state_dict())
    x = torch.randn(3, 7)
    torch.testing.assert_close(module(x), torch.relu(linear(x)))
    back = nn.Linear(7, 5, bias=bias)
    back.load_state_dict(module.state_dict(), strict=True)  # and the other way round
    torch.testing.assert_close(back.weight, linear.weight, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ("gelu_tanh", "squared_relu"))
def test_fused_linear_transposed_weight(activation, dtype):
    """``transposed=True``: the weight stored (in, out) as Hugging Face's Conv1D does, initialized with
    fan_in = in_features, the same function and gradients (the grad in the parameter's layout)."""
    module = FusedLinear(96, 40, activation=activation, dtype=dtype, transposed=True)
    assert module.weight.shape == (96, 40) and "transposed=True" in repr(module)
    bound = 1.0 / math.sqrt(96)  # fan_in = 40 (the stored layout read as nn.Linear's) would give 0.158
    largest = float(module.weight.detach().abs().max())
    assert 0.9 * bound < largest <= bound * (1 + 2**-8)  # bf16 may round the bound up by half an ulp
    x = _leaf(torch.randn(3, 5, 96, dtype=dtype))
    grad_y = torch.randn(3, 5, 40, dtype=dtype)
    params = [x, module.weight, module.bias]
    y = module(x)
    got = [y, *_grads(y, params, grad_y)]
    assert got[2].shape == (96, 40)

    def as_linear(t: torch.Tensor, upcast: bool) -> list[torch.Tensor]:
        leaves = [_leaf(p.double() if upcast else p) for p in params]
        out = linear_spec.reference(leaves[0], leaves[1].t(), leaves[2], activation, upcast=upcast)
        return [out, *_grads(out, leaves, grad_y.double() if upcast else grad_y)]

    ref, eager = as_linear(params, True), as_linear(params, False)
    for name, out, r, e in zip(("y", "grad_x", "grad_weight", "grad_bias"), got, ref, eager):
        check(name, out.detach(), r.detach(), e.detach())
    twin = FusedLinear(96, 40, activation=activation, dtype=dtype, transposed=True)
    twin.load_state_dict(module.state_dict(), strict=True)  # a Conv1D-shaped state_dict loads unchanged
    torch.testing.assert_close(twin(x), y, rtol=0, atol=0)
    with pytest.raises(TypeError, match="transposed must be a bool"):
        FusedLinear(3, 4, transposed=1)


def test_fused_linear_initializes_like_linear():
    torch.manual_seed(3)
    linear = nn.Linear(256, 512)
    torch.manual_seed(3)
    module = FusedLinear(256, 512, activation="gelu")
    torch.testing.assert_close(module.weight, linear.weight, rtol=0, atol=0)
    torch.testing.assert_close(module.bias, linear.bias, rtol=0, atol=0)
    # kaiming_uniform(a=sqrt(5)) and the bias rule both give U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    bound = 1.0 / math.sqrt(256)
    for p in (module.weight.detach(), module.bias.detach()):
        assert p.abs().max() <= bound
        std = bound / math.sqrt(3.0)
        assert abs(float(p.std()) - std) < 5 * std / math.sqrt(2 * p.numel()) + 1e-3 * std
        assert abs(float(p.mean())) < 5 * std / math.sqrt(p.numel())
    module.reset_parameters()
    assert not torch.equal(module.weight, linear.weight)


def test_extra_repr_and_bad_arguments():
    assert "in_features=3, out_features=4, bias=True, activation='gelu_tanh'" in repr(
        FusedLinear(3, 4, activation="gelu_tanh")
    )
    assert "activation='relu', p=0.25" in repr(FusedBiasActDropout(4, "relu", 0.25))
    with pytest.raises(ValueError, match="activation must be one of"):
        FusedLinear(3, 4, activation="tanh")
    with pytest.raises(ValueError, match="p must be a number in"):
        FusedBiasActDropout(4, p=1.5)
    dropped = FusedBiasActDropout(4, "relu", p=1.0)  # as nn.Dropout(1.0): zeros in training, identity in eval
    x = torch.randn(3, 4)
    assert torch.equal(dropped(x), torch.zeros(3, 4))
    torch.testing.assert_close(dropped.eval()(x), torch.relu(x + dropped.bias))
    with pytest.raises(ValueError, match="dropout must be a number in"):
        FusedLinear(3, 4, dropout=-0.1)
    assert "activation='relu', dropout=0.25" in repr(FusedLinear(3, 4, activation="relu", dropout=0.25))


@pytest.mark.parametrize("transposed", (False, True))
@pytest.mark.parametrize("shape", ((3, 9), (2, 5, 7), (16,), ()), ids=str)
def test_fused_linear_names_x_when_its_last_dimension_is_wrong(shape, transposed):
    """The module knows in_features: a wrong x is x's fault, whatever layout the weight has."""
    module = FusedLinear(8, 16, transposed=transposed)
    want = f"x's last dimension must be in_features=8 of this FusedLinear, got x of shape {shape}"
    with pytest.raises(ValueError, match=re.escape(want)):
        module(torch.randn(shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ("gelu_tanh", "silu"))  # no exact zeros but the dropped ones
def test_fused_linear_dropout_matches_reference(activation, dtype, spec_masks):
    """``dropout=p`` in training: the GEMM, then bias, activation and dropout with the rng the op drew,
    output and every gradient (the bias's included) as the reference's."""
    module = FusedLinear(13, 24, activation=activation, dtype=dtype, dropout=0.3)
    x = _leaf(torch.randn(3, 5, 13, dtype=dtype))
    grad_y = torch.randn(3, 5, 24, dtype=dtype)
    params = [x, module.weight, module.bias]
    torch.manual_seed(11)
    y = module(x)
    got = [y, *_grads(y, params, grad_y)]
    assert 0.2 < float((y == 0).float().mean()) < 0.4
    torch.manual_seed(11)
    rng = dropout_rng.draw(x.device)

    def reference(upcast: bool) -> list[torch.Tensor]:
        x, weight, bias = [_leaf(t) for t in params]
        z = linear_spec.reference(x, weight, None, "identity", upcast=upcast)
        out = bad_spec.reference(z, bias, activation, 0.3, rng, upcast=upcast)
        return [out, *_grads(out, [x, weight, bias], grad_y.double() if upcast else grad_y)]

    ref, eager = reference(True), reference(False)
    for name, out, r, e in zip(("y", "grad_x", "grad_weight", "grad_bias"), got, ref, eager):
        check(name, out.detach(), r.detach(), e.detach())


def test_fused_linear_dropout_off_in_eval_mode():
    module = FusedLinear(9, 32, activation="silu", dropout=0.5).eval()
    x = torch.randn(6, 9)
    state = torch.random.get_rng_state()
    torch.testing.assert_close(module(x), F.silu(F.linear(x, module.weight, module.bias)))
    assert torch.equal(torch.random.get_rng_state(), state), "eval mode drew random numbers"


# ----------------------------------------------------------------------------- FusedBiasActDropout


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ("gelu", "gelu_tanh", "squared_relu"))
def test_bias_act_dropout_module_matches_reference(activation, dtype, spec_masks):
    """Training mode with p > 0: the module's output and gradients equal the reference run with the
    very rng the op drew (re-seeding the global generator replays the draw)."""
    module = FusedBiasActDropout(24, activation, p=0.3, dtype=dtype)
    with torch.no_grad():
        module.bias.normal_()
    x = _leaf(torch.randn(3, 5, 24, dtype=dtype))
    grad_y = torch.randn(3, 5, 24, dtype=dtype)
    torch.manual_seed(11)
    y = module(x)
    got = [y, *_grads(y, [x, module.bias], grad_y)]
    torch.manual_seed(11)
    rng = dropout_rng.draw(x.device)

    ref_in = [_leaf(x), _leaf(module.bias)]
    ref_y = bad_spec.reference(*ref_in, activation, 0.3, rng, upcast=True)
    ref = [ref_y, *_grads(ref_y, ref_in, grad_y.double())]
    same_in = [_leaf(x), _leaf(module.bias)]
    eager_y = bad_spec.reference(*same_in, activation, 0.3, rng)
    eager = [eager_y, *_grads(eager_y, same_in, grad_y)]
    for name, out, r, e in zip(("y", "grad_x", "grad_bias"), got, ref, eager):
        check(name, out.detach(), r.detach(), e.detach())


def test_dropout_follows_module_training():
    module = FusedBiasActDropout(64, "identity", p=0.5)
    x = torch.randn(32, 64) + 3.0  # nonzero everywhere, so zeros in y are exactly the dropped elements
    y1, y2 = module(x), module(x)
    dropped = (y1 == 0).float().mean()
    assert 0.4 < dropped < 0.6
    assert not torch.equal(y1 == 0, y2 == 0), "two training calls reused one mask"
    kept = y1 != 0
    torch.testing.assert_close(y1[kept], (x * dropout_rng.keep_scale(0.5))[kept])
    module.eval()
    torch.testing.assert_close(module(x), x, rtol=0, atol=0)
    state = torch.random.get_rng_state()
    module(x)
    assert torch.equal(torch.random.get_rng_state(), state), "eval mode drew random numbers"


def test_bias_follows_x_dtype():
    module = FusedBiasActDropout(8, "relu")  # float32 bias
    with torch.no_grad():
        module.bias.uniform_(-1, 1)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        y = module(x)
    assert y.dtype == torch.bfloat16
    bias = module.bias.detach().to(torch.bfloat16)
    check("y", y, bad_spec.reference(x, bias, "relu", upcast=True), bad_spec.reference(x, bias, "relu"))


# ----------------------------------------------------------------------------- autocast, compile


def _autocast_case(device: str, activation: str) -> None:
    """Under autocast, FusedLinear casts like nn.Linear: bf16 output, float32 parameter gradients, and
    results as close to the float64 truth (of the bf16-rounded operands) as nn.Linear's."""
    linear = nn.Linear(40, 24, device=device)
    module = FusedLinear(40, 24, activation=activation, device=device)
    module.load_state_dict(linear.state_dict())
    x = torch.randn(6, 40, device=device)
    grad_y = torch.randn(6, 24, device=device, dtype=torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = module(x)
        y_nn = ACTIVATIONS[activation].forward(linear(x))
    assert y.dtype == y_nn.dtype == torch.bfloat16
    y.backward(grad_y)
    y_nn.backward(grad_y)
    assert module.weight.grad.dtype == torch.float32
    operands = (x.bfloat16(), linear.weight.detach().bfloat16(), linear.bias.detach().bfloat16())
    ref = linear_spec.reference(*operands, activation, upcast=True)
    check("y", y.detach(), ref, y_nn.detach())
    for name in ("weight", "bias"):
        got, want = getattr(module, name).grad, getattr(linear, name).grad
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    with torch.autocast(device, dtype=torch.bfloat16):
        z = FusedBiasActDropout(24, "gelu", device=device)(y)
    assert z.dtype == torch.bfloat16


@pytest.mark.parametrize("activation", ("identity", "gelu"))
def test_autocast_cpu_bf16_like_linear(activation):
    _autocast_case("cpu", activation)


def test_compile_fullgraph_training_with_autocast():
    """Compiles of a model of both modules (FusedLinear's dropout too) in training mode (dropout on)
    under bf16 autocast, forward and backward, no graph break. With a backend requested the ops stay
    custom ops and, inductor's RNG falling back to torch's, the compiled model draws the same rng as
    eager mode and so matches it exactly; with none, inductor owns the dropout (its mask,
    dispatch/ops/)."""
    import torch._inductor.config as inductor_config

    model = nn.Sequential(
        FusedLinear(16, 32, activation="gelu", dropout=0.1),  # the GEMM, then bias + gelu + dropout
        FusedLinear(32, 16, bias=False, transposed=True),  # the op gets a transposed weight view
        FusedBiasActDropout(16, "identity", p=0.2),
    )
    x = torch.randn(4, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.compile(model, fullgraph=True)(_leaf(x))
    assert y.dtype == torch.bfloat16 and (y == 0).any() and (y != 0).any()
    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True), use_backend("eager"):
        compiled = torch.compile(model, fullgraph=True)
        runs = []
        for fn in (compiled, model):
            torch.manual_seed(5)
            xi = _leaf(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = fn(xi)
            y.float().square().sum().backward()
            runs.append((y, xi.grad, model[0].weight.grad.clone(), model[1].weight.grad.clone()))
            model.zero_grad()
    compiled_run, eager_run = runs
    assert compiled_run[0].dtype == torch.bfloat16
    assert (eager_run[0] == 0).any(), "dropout did not run"
    assert compiled_run[3].shape == (32, 16)  # the transposed module's grad in its stored layout
    for got, expected in zip(compiled_run, eager_run):
        torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ("identity", "gelu_tanh"))
def test_autocast_cuda_bf16_like_linear(activation):
    _autocast_case("cuda", activation)


@pytest.mark.gpu
def test_cuda_graph_replays_draw_new_masks(monkeypatch):
    """Capture forward and backward of FusedBiasActDropout in one CUDA graph; every replay must use a new
    mask, equal to the reference for the rng that replay drew, and its backward the same mask."""
    drawn = []
    draw = dropout_rng.draw

    def recording_draw(device, generator=None):
        rng = draw(device, generator)
        drawn.append(rng)  # a buffer of the graph's pool: each replay rewrites it in place
        return rng

    monkeypatch.setattr(dropout_rng, "draw", recording_draw)
    module = FusedBiasActDropout(512, "gelu", p=0.25, device="cuda")
    with torch.no_grad():
        module.bias.uniform_(2.0, 3.0)  # gelu(x + b) > 0 here, so zeros in y are the dropped elements
    x = torch.rand(256, 512, device="cuda", requires_grad=True)
    grad_y = torch.rand(256, 512, device="cuda") + 0.5  # never 0, so zeros in grad_x are dropped elements

    def step():  # on triton, whatever this GPU's table says (no table: plain PyTorch, torch's masks)
        with use_backend("triton"):
            y = module(x)
            (gx,) = torch.autograd.grad(y, x, grad_y)
        return y, gx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: kernels compiled, decisions cached, before capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    drawn.clear()
    with torch.cuda.graph(graph):
        y, gx = step()
    assert len(drawn) == 1
    rng = drawn[0]

    masks, rngs = [], []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        rngs.append(rng.clone())
        mask = y != 0
        masks.append(mask)
        operands = (x.detach(), module.bias.detach(), "gelu", 0.25, rngs[-1])
        check("replay y", y.detach(), bad_spec.reference(*operands, upcast=True), bad_spec.reference(*operands))
        assert torch.equal(gx != 0, mask), "backward used another mask than its forward"
        assert 0.2 < 1.0 - mask.float().mean() < 0.3
    assert not torch.equal(rngs[0], rngs[1]) and not torch.equal(rngs[1], rngs[2])
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
