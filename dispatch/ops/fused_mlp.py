"""fused_mlp: the MLP block, Dropout_out(Dropout_p(act(x @ W_in^T + b_in)) @ W_out^T + b_out), the op's
one room. ``act`` is any activation of the table or a gate (``GATES``: act(gate) * up, where the first
projection yields [gate; up], gate rows first, from one stacked (2F, H) weight or a (gate, up) pair).

In order: the call object and its checks, the kernels' signatures, the reference and baseline math,
how a call runs on kernels (inference, torch's autograd, or the autograd Function that regenerates
both dropout masks in backward), the public function, and the calibration inputs. Under
torch.compile the block traces as its baseline math, which inductor fuses with its neighbours.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch import ops
from dispatch.contracts import checks
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS, GATED_NAMES, GATES
from dispatch.contracts.backend import Call, Kernels, composite_kernels
from dispatch.contracts.op import (
    Case, Grid, Inputs, OpCall, OpSpec, compute_dtype, differentiable_grads, torch_keep,
)  # fmt: skip

NAME = "fused_mlp"
TENSORS = ("x", "w_in", "w_up", "b_in", "b_up", "w_out", "b_out")  # the Function's inputs, in order


class Block(NamedTuple):
    """The block's tensors and settings as kernels take them. ``w_in`` (F, H), or (2F, H) stacked
    [gate; up] for a gate, with ``w_up`` None; or a gate's pair: ``w_in`` the gate's (F, H), ``w_up``
    the up projection's. Biases likewise ((F,) / (2F,) / a pair), or None."""

    x: Tensor  # (M, H)
    w_in: Tensor
    w_up: Optional[Tensor]
    b_in: Optional[Tensor]
    b_up: Optional[Tensor]
    w_out: Tensor  # (H_out, F)
    b_out: Optional[Tensor]  # (H_out,)
    activation: str
    p: float  # dropout on the hidden activation; 0.0 unless training
    p_out: float  # dropout on the output

    @property
    def tensors(self) -> tuple[Optional[Tensor], ...]:
        return self[:7]


class FusedMLPCall(OpCall):
    __slots__ = ("block", "generator", "out_shape", "flat")

    def __init__(self, call: Call, block: Block, generator: Optional[torch.Generator],
                 out_shape: tuple[int, ...], flat: bool) -> None:  # fmt: skip
        super().__init__(call, block.p == 1.0 or block.p_out == 1.0)  # every element dropped: SPEC.special
        self.block, self.generator, self.out_shape = block, generator, out_shape
        self.flat = flat  # x is (M, H) itself: the output needs no view


def _pair(name: str, value: object) -> tuple[object, object]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be a tensor or a (gate, up) pair, got {len(value)} items")
        return value[0], value[1]
    return value, None


def parse(
    x: object,
    w_in: object,
    b_in: object,
    w_out: object,
    b_out: object = None,
    activation: object = "gelu",
    p: object = 0.0,
    p_out: object = 0.0,
    training: object = True,
    *,
    generator: object = None,
) -> FusedMLPCall:
    """The checked call; the errors name the first bad argument in argument order."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS and activation not in GATES:
        names = ", ".join((*ACTIVATION_NAMES, *GATED_NAMES))
        raise ValueError(f"activation must be one of {names}; got {activation!r}")
    gated = activation in GATES
    x = checks.check_tensor("x", x)
    m, h = checks.rows_of(x.shape)
    device, dtype = x.device, x.dtype
    w_in, w_up = _pair("w_in", w_in)
    w_in = checks.check_like("w_in", w_in, dtype, device)
    if w_in.dim() != 2 or w_in.shape[1] != h:
        raise ValueError(f"w_in must have shape (hidden, {h}) to match x's last dim, got {tuple(w_in.shape)}")
    if w_up is not None:
        if not gated:
            raise ValueError(f"w_in may be a (gate, up) pair only for a gated activation, not {activation!r}")
        w_up = checks.check_like("w_up", w_up, dtype, device)
        if w_up.shape != w_in.shape:
            raise ValueError(f"w_up must have the gate's shape {tuple(w_in.shape)}, got {tuple(w_up.shape)}")
        f = w_in.shape[0]
    elif gated:
        if w_in.shape[0] % 2:
            raise ValueError(f"w_in must stack [gate; up] for {activation!r}: even rows, got {w_in.shape[0]}")
        f = w_in.shape[0] // 2
    else:
        f = w_in.shape[0]
    b_in, b_up = _pair("b_in", b_in)
    if (b_up is None) != (w_up is None) and b_in is not None:
        raise ValueError("b_in must be a (gate, up) pair exactly when w_in is")
    b_in = checks.check_bias("b_in", b_in, w_in.shape[0], dtype, device)
    b_up = checks.check_bias("b_up", b_up, f, dtype, device)
    w_out = checks.check_like("w_out", w_out, dtype, device)
    if w_out.dim() != 2 or w_out.shape[1] != f:
        raise ValueError(f"w_out must have shape (out_features, {f}) for hidden {f}, got {list(w_out.shape)}")
    b_out = checks.check_bias("b_out", b_out, w_out.shape[0], dtype, device)
    p, p_out = checks.check_p(p, "p"), checks.check_p(p_out, "p_out")
    training = checks.check_training(training)
    checks.check_generator(generator, device)
    p, p_out = (p, p_out) if training else (0.0, 0.0)
    flat = x.dim() == 2
    rows = x if flat else x.reshape(m, h)
    grad = torch.is_grad_enabled() and (
        x.requires_grad or w_in.requires_grad or w_out.requires_grad
        or any(t is not None and t.requires_grad for t in (w_up, b_in, b_up, b_out))
    )  # fmt: skip
    call = Call(NAME, device, dtype, (m, h, f), activation, p > 0 or p_out > 0, grad)
    block = Block(rows, w_in, w_up, b_in, b_up, w_out, b_out, activation, p, p_out)
    return FusedMLPCall(call, block, generator, (*x.shape[:-1], w_out.shape[0]), flat)


# A backend's ``Kernels`` (dispatch.contracts.backend) for this op. ``rngs`` is (rng_hidden, rng_out),
# the spec's (seed, offset) of each mask for masks "spec" (None where its p is 0), or (generator, None)
# for masks "torch". ``saved`` is what backward needs beyond the inputs; never a mask.
#   forward(block, rngs) -> (y, saved)                       a call with autograd
#   inference(block, rngs) -> y                              a call without
#   backward(grad_y, block, rngs, saved, needs) -> grads     needs and grads follow Block.tensors


# ----------------------------------------------------------------------------- math


def project_in(x: Tensor, b: Block, dtype: Optional[torch.dtype] = None) -> Tensor:
    """x @ W_in^T + b_in: (M, F), or (M, 2F) [gate; up] for a gate; in ``dtype`` if given."""
    cast = (lambda t: t) if dtype is None else (lambda t: None if t is None else t.to(dtype))  # noqa: E731
    pre = F.linear(cast(x), cast(b.w_in), cast(b.b_in))
    if b.w_up is None:
        return pre
    return torch.cat([pre, F.linear(cast(x), cast(b.w_up), cast(b.b_up))], dim=-1)


def activate(pre: Tensor, activation: str) -> Tensor:
    """act(pre), or act(gate) * up for a gate."""
    if activation in GATES:
        gate, up = pre.chunk(2, dim=-1)
        return ACTIVATIONS[GATES[activation]].forward(gate) * up
    return ACTIVATIONS[activation].forward(pre)


def reference(b: Block, rngs: tuple[Any, Any] = (None, None), upcast: bool = False,
              keeps: tuple[Optional[Tensor], Optional[Tensor]] = (None, None)) -> Tensor:  # fmt: skip
    """The definition, differentiable, on the block's (M, H) rows; float64 when ``upcast``. The masks
    are the spec's for ``rngs``, or ``keeps`` (masks another RNG drew)."""
    dtype = torch.float64 if upcast else b.x.dtype
    a = activate(project_in(b.x, b, dtype), b.activation)
    a = drop(a, b.p, rngs[0], keeps[0])
    y = F.linear(a, b.w_out.to(dtype), None if b.b_out is None else b.b_out.to(dtype))
    return drop(y, b.p_out, rngs[1], keeps[1])


def drop(t: Tensor, p: float, rng: Any, keep: Optional[Tensor] = None) -> Tensor:
    """t * keep * scale (F.dropout's product), the mask ``keep`` or the spec's for ``rng``."""
    if keep is None and rng is not None and p > 0:
        keep = dropout_rng.keep_mask(rng, t.shape[0], t.shape[1], p, t.device)
    return t if keep is None else t * keep * dropout_rng.keep_scale(p)  # F.dropout's product


def baseline(b: Block, generator: Optional[torch.Generator] = None) -> Tensor:
    """The module a user writes, in x's dtype, dropout from torch's RNG (``generator``'s if given)."""
    a = activate(project_in(b.x, b), b.activation)
    return _torch_dropout(F.linear(_torch_dropout(a, b.p, generator), b.w_out, b.b_out), b.p_out, generator)


def _torch_dropout(t: Tensor, p: float, generator: Optional[torch.Generator]) -> Tensor:
    if p == 0.0:
        return t
    if generator is None:
        return F.dropout(t, p, training=True)
    return t * torch_keep(t.shape, t.dtype, t.device, p, generator) * (1.0 / (1.0 - p))


def _baseline_backward(grad_y: Tensor, b: Block, rngs: tuple, saved: tuple, needs: tuple) -> tuple:
    """Without dropout only: a torch-RNG mask is kept by autograd, never regenerated."""
    if b.p or b.p_out:
        raise RuntimeError("the pytorch backend's dropout masks are torch's: its backward is autograd's")
    return _grads_of(lambda blk: baseline(blk), b, needs, grad_y)


def _grads_of(fn: Callable[[Block], Tensor], b: Block, needs: tuple, grad_y: Tensor) -> tuple:
    leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(b.tensors, needs)]
    with torch.enable_grad():
        y = fn(Block(*leaves, *b[7:]))  # type: ignore[arg-type]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad(y, wanted, grad_y) if wanted else ())
    return tuple(next(found) if t is not None and t.requires_grad else None for t in leaves)


BASELINE_KERNELS = composite_kernels(
    lambda b, rngs: (baseline(b, rngs[0]), ()), _baseline_backward, lambda b, rngs: baseline(b, rngs[0])
)


def _cast(b: Block, dtype: torch.dtype) -> Block:
    return Block(*(None if t is None else t.to(dtype) for t in b.tensors), *b[7:])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- running on kernels


class FusedMLP(torch.autograd.Function):
    """A backend's forward and backward; both masks regenerated from their rngs, never saved."""

    @staticmethod
    def forward(ctx: Any, kernels, settings, rngs, *tensors):  # type: ignore[override]
        block = Block(*tensors, *settings)
        y, saved = kernels.forward(block, rngs)
        ctx.kernels, ctx.settings, ctx.rngs, ctx.n_saved = kernels, settings, rngs, len(saved)
        ctx.save_for_backward(*tensors, *saved)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y):  # type: ignore[override]
        kept = ctx.saved_tensors
        tensors, saved = kept[: len(TENSORS)], kept[len(TENSORS) :]
        block = Block(*tensors, *ctx.settings)
        needs = tuple(ctx.needs_input_grad[3:])
        if torch.is_grad_enabled():  # create_graph=True: the reference, same masks
            dtype = compute_dtype(block.x.dtype)
            grads = differentiable_grads(
                lambda: reference(_cast(block, dtype), ctx.rngs), tensors, needs, grad_y
            )
        else:
            grads = ctx.kernels.backward(grad_y, block, ctx.rngs, saved, needs)
        return (None, None, None, *grads)


def runner(kernels: Kernels, call: Call) -> Callable[[FusedMLPCall], Tensor]:
    """How calls like ``call`` run on ``kernels``, chosen once per decision."""
    spec_masks = kernels.masks == "spec"

    def draw(c: FusedMLPCall) -> tuple:
        if not spec_masks:
            return (c.generator, None)
        b, m = c.block, c.call.shape[0]
        hidden = dropout_rng.draw_for(b.x, c.generator, m * b.w_out.shape[1]) if b.p > 0 else None
        out = dropout_rng.draw_for(b.x, c.generator, m * b.w_out.shape[0]) if b.p_out > 0 else None
        return hidden, out

    if not call.training or kernels.autograd(call.activation):
        training = call.training

        def direct(c: FusedMLPCall) -> Tensor:
            y = kernels.forward(c.block, draw(c))[0] if training else kernels.inference(c.block, draw(c))
            return y if c.flat else y.view(c.out_shape)

        return direct
    apply = FusedMLP.apply

    def with_function(c: FusedMLPCall) -> Tensor:
        b = c.block
        y = apply(kernels, b[7:], draw(c), *b.tensors)
        return y if c.flat else y.view(c.out_shape)

    return with_function


# ----------------------------------------------------------------------------- the spec


class FusedMLPSpec(OpSpec):
    name = NAME
    public_name = "fused_mlp"
    dims = ("M", "H", "F")
    activations = (*ACTIVATION_NAMES, *GATED_NAMES)
    dropout = True
    grid = Grid(
        features=((768, 3072), (1024, 4096), (896, 4864), (4096, 11008)),  # GPT-2, BERT-large, Qwen2, LLaMA-2
        quick={"cuda": ((768, 3072), (4096, 11008)), "cpu": ((64, 256),)},
        classes=(
            ("gelu_tanh", "gelu", "silu", "relu", "identity", "leaky_relu", "squared_relu"),
            ("swiglu", "geglu", "geglu_tanh", "reglu"),
        ),  # fmt: skip
        gemm=True,
        check_work=2**34,
        families=(("training", False), ("training", True), ("inference", False)),
        parity={"cpu": ((5, 9, 17), (1, 3, 7)), "cuda": ((1823, 129, 781), (1, 3, 7), (2048, 1024, 4096))},
        outputs=("y", "grad_x", "grad_w_in", "grad_b_in", "grad_w_out", "grad_b_out"),
    )

    def parse(self, *args: Any, **kwargs: Any) -> FusedMLPCall:
        return parse(*args, **kwargs)

    def runner(self, kernels: Any, call: Call) -> Callable[[OpCall], Tensor]:
        return runner(kernels, call)  # type: ignore[return-value]

    def special(self, c: OpCall, backend: Optional[str]) -> Optional[Tensor]:
        """p or p_out == 1 in training: zeros through the same math (F.dropout's), not for kernels."""
        assert isinstance(c, FusedMLPCall)
        b = c.block
        keeps = tuple(torch.zeros((), device=b.x.device) if p == 1.0 else None for p in (b.p, b.p_out))
        return reference(b, (None, None), keeps=keeps).view(c.out_shape)  # type: ignore[arg-type]

    def traced(self, c: OpCall, backend: Optional[str], inline: bool) -> Tensor:
        """Always the baseline math under torch.compile (no custom op yet: inductor fuses the block's
        pointwise work; whether an opaque op beats it is not measured)."""
        assert isinstance(c, FusedMLPCall)
        return baseline(c.block).view(c.out_shape)

    def baseline_kernels(self) -> Kernels:
        return BASELINE_KERNELS

    def inputs(self, case: Case, seed: int) -> Inputs:
        g = torch.Generator(device=case.device).manual_seed(seed)
        h, f = case.features
        f_in = 2 * f if case.activation in GATES else f

        def randn(*shape: int, scale: float = 1.0) -> Tensor:
            return (torch.randn(*shape, device=case.device, generator=g) * scale).to(case.dtype)

        tensors = [randn(case.m, h), randn(f_in, h, scale=1 / math.sqrt(h)), randn(f_in, scale=0.5),
                   randn(h, f, scale=1 / math.sqrt(f)), randn(h, scale=0.5)]  # fmt: skip
        return Inputs(tensors, randn(case.m, h), seed)

    def run_case(self, case: Case, leaves: Sequence[Tensor], backend: Optional[str], seed: int) -> Tensor:
        x, w_in, b_in, w_out, b_out = leaves
        p, p_out = (case.p, case.p) if case.dropout else (0.0, 0.0)
        if backend is None:
            return baseline(Block(x, w_in, None, b_in, None, w_out, b_out, case.activation, p, p_out))
        gen = (
            torch.Generator(device=case.device).manual_seed(seed + 1)
            if case.dropout and seed is not None
            else None
        )
        return fused_mlp(
            x, w_in, b_in, w_out, b_out, case.activation, p, p_out, generator=gen, backend=backend
        )

    def reference_case(self, case: Case, leaves: Sequence[Tensor], seed: int,
                       torch_masks: bool = False) -> Tensor:  # fmt: skip
        x, w_in, b_in, w_out, b_out = leaves
        p = case.p if case.dropout else 0.0
        block = Block(x, w_in, None, b_in, None, w_out, b_out, case.activation, p, p)
        if not case.dropout:
            return reference(block, upcast=True)
        gen = torch.Generator(device=case.device).manual_seed(seed + 1)
        m, (h, f) = case.m, case.features
        if torch_masks:  # torch's masks: replayed from the run's generator, hidden then output
            keeps = tuple(torch_keep(s, case.dtype, x.device, p, gen) for s in ((m, f), (m, h)))
            return reference(block, upcast=True, keeps=keeps)
        rngs = (dropout_rng.draw_for(x, gen, m * f), dropout_rng.draw_for(x, gen, m * h))
        return reference(block, rngs, upcast=True)


SPEC = ops.register(FusedMLPSpec())


def fused_mlp(
    x: Tensor,
    w_in: Tensor | tuple[Tensor, Tensor],
    b_in: Optional[Tensor | tuple[Tensor, Tensor]],
    w_out: Tensor,
    b_out: Optional[Tensor] = None,
    activation: str = "gelu",
    p: float = 0.0,
    p_out: float = 0.0,
    training: bool = True,
    *,
    generator: Optional[torch.Generator] = None,
    backend: Optional[str] = None,
) -> Tensor:
    """The MLP block Dropout_out(Dropout_p(act(x @ w_in.T + b_in)) @ w_out.T + b_out), forward and
    backward, dispatched like the other ops.

    x: (..., H). w_in: (F, H); for a gated activation (``swiglu``, ``geglu``, ``geglu_tanh``, ``reglu``:
    act(gate) * up) either one stacked (2F, H) weight, gate rows first, or a (w_gate, w_up) pair of
    (F, H) weights; b_in likewise ((F,), (2F,), a pair, or None). w_out: (H_out, F); b_out (H_out,) or
    None. p: dropout on the hidden activation (timm's drop1); p_out: dropout on the output (GPT-2's
    residual dropout); both only when ``training``. Masks follow ``dispatch.contracts.rng``'s spec,
    regenerated in backward, never stored (the pytorch backend's are torch's). Differentiable twice.

    Equivalent PyTorch::

        F.dropout(F.linear(F.dropout(act(F.linear(x, w_in, b_in)), p), w_out, b_out), p_out)
    """
    c = parse(x, w_in, b_in, w_out, b_out, activation, p, p_out, training, generator=generator)
    return ops.dispatcher().run(SPEC, c, backend)
