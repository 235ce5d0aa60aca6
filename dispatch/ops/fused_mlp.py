"""fused_mlp: the MLP block, Dropout_out(Dropout_p(act(x @ W_in^T + b_in)) @ W_out^T + b_out), the op's
one room. ``act`` is any activation of the table or a gate (``GATES``: act(gate) * up, where the first
projection yields [gate; up], gate rows first, from one stacked (2F, H) weight or a (gate, up) pair).

In order: the call object and its checks, how its kernels take a call (``dispatch.contracts.running``
runs it: inference, torch's autograd, or one autograd node that regenerates both dropout masks in
backward), the torch.library custom op a compiled graph keeps, the spec with its calibration inputs,
and the public function. The block's
definition (the ``MLPOperands`` kernels take, their signatures, the reference and baseline math) is
``fused_mlp_math.py``, the room's other file.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from dispatch import ops
from dispatch.contracts import checks, running
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS, GATED_NAMES, GATES
from dispatch.contracts.backend import Call, Kernels, new_call
from dispatch.contracts.op import Case, Grid, Inputs, OpCall, OpSpec, torch_keep
from dispatch.ops.fused_mlp_math import (
    BASELINE_KERNELS, TENSORS, MLPOperands, baseline, composite_runner, reference,
)  # fmt: skip

__all__ = ["TENSORS", "MLPOperands", "FusedMLPCall", "fused_mlp", "parse", "reference"]

NAME = "fused_mlp"
TRAITS = ("activation", "dropout")  # a call's, past its sizes and dtype: what decisions key on
_grad_enabled = torch.is_grad_enabled


class FusedMLPCall(OpCall):
    __slots__ = ("block", "generator", "x_shape", "flat")

    def __init__(self, call: Call, block: MLPOperands, generator: Optional[torch.Generator],
                 x_shape: torch.Size, flat: bool) -> None:  # fmt: skip
        super().__init__(call, block.p == 1.0 or block.p_out == 1.0)  # every element dropped: SPEC.special
        self.block, self.generator, self.x_shape = block, generator, x_shape
        self.flat = flat  # x is (M, H) itself: the output needs no view

    @property
    def out_shape(self) -> tuple[int, ...]:  # (..., H_out): made only where x is not (M, H)
        return (*self.x_shape[:-1], self.block.w_out.shape[0])


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
    x_shape = x.shape
    flat = len(x_shape) == 2
    m, h = x_shape if flat else checks.rows_of(x_shape)
    device, dtype = x.device, x.dtype
    w_in, w_up = _pair("w_in", w_in)
    w_in = checks.check_like("w_in", w_in, dtype, device)
    in_shape = w_in.shape
    if len(in_shape) != 2 or in_shape[1] != h:
        raise ValueError(f"w_in must have shape (hidden, {h}) to match x's last dim, got {tuple(in_shape)}")
    if w_up is not None:
        if not gated:
            raise ValueError(f"w_in may be a (gate, up) pair only for a gated activation, not {activation!r}")
        w_up = checks.check_like("w_up", w_up, dtype, device)
        if w_up.shape != in_shape:
            raise ValueError(f"w_up must have the gate's shape {tuple(in_shape)}, got {tuple(w_up.shape)}")
        f = in_shape[0]
    elif gated:
        if in_shape[0] % 2:
            raise ValueError(f"w_in must stack [gate; up] for {activation!r}: even rows, got {in_shape[0]}")
        f = in_shape[0] // 2
    else:
        f = in_shape[0]
    bias_pair = isinstance(b_in, (tuple, list))
    b_in, b_up = _pair("b_in", b_in)
    if bias_pair and (b_in is None) != (b_up is None):
        raise ValueError("b_in as a (gate, up) pair must hold two tensors (or be None: no bias)")
    if b_in is not None and (b_up is None) != (w_up is None):
        raise ValueError("b_in must be a (gate, up) pair exactly when w_in is")
    b_in = checks.check_bias("b_in", b_in, in_shape[0], dtype, device)
    b_up = checks.check_bias("b_up", b_up, f, dtype, device)
    w_out = checks.check_like("w_out", w_out, dtype, device)
    out_shape = w_out.shape
    if len(out_shape) != 2 or out_shape[1] != f:
        raise ValueError(f"w_out must have shape (out_features, {f}) for hidden {f}, got {list(out_shape)}")
    b_out = checks.check_bias("b_out", b_out, out_shape[0], dtype, device)
    p, p_out = checks.check_p(p, "p"), checks.check_p(p_out, "p_out")
    training = checks.check_training(training)
    checks.check_generator(generator, device)
    p, p_out = (p, p_out) if training else (0.0, 0.0)
    rows = x if flat else x.reshape(m, h)
    grad = _grad_enabled() and (
        x.requires_grad or w_in.requires_grad or w_out.requires_grad
        or (b_in is not None and b_in.requires_grad) or (b_out is not None and b_out.requires_grad)
        or (w_up is not None and (w_up.requires_grad or (b_up is not None and b_up.requires_grad)))
    )  # fmt: skip
    call = new_call((NAME, device, dtype, (m, h, f), grad, TRAITS, (activation, p > 0 or p_out > 0)))
    block = MLPOperands(rows, w_in, w_up, b_in, b_up, w_out, b_out, activation, p, p_out)
    return FusedMLPCall(call, block, generator, x_shape, flat)


# ----------------------------------------------------------------------------- running on kernels

# The kernels' arguments are (operands, rngs), flat: the operands' seven tensors, then the settings
# (activation, p, p_out) and the rngs; forward returns (y, saved), saved a tuple.
def _operands(tensors: tuple, settings: tuple) -> MLPOperands:
    return MLPOperands(*tensors, *settings[:3])


def _forward_flat(kernels: Kernels, args: tuple) -> tuple:
    y, saved = kernels.forward(MLPOperands(*args[:10]), args[10])
    return y, *saved


CALLING = running.Calling(
    tensors=7,
    backward=lambda kernels, grad_y, tensors, saved, settings, needs: kernels.backward(
        grad_y, _operands(tensors, settings), settings[3], saved, needs
    ),
    differentiable=lambda tensors, settings: reference(_operands(tensors, settings), settings[3]),
    flat=lambda args: (*args[0], args[1]),
    forward=_forward_flat,
)


def _bind(run: Callable[..., Tensor], kernels: Kernels, draws: bool) -> Callable[[FusedMLPCall], Tensor]:
    """One call on ``run``: both rngs drawn where the masks are the spec's, else the caller's generator."""
    spec_masks = kernels.masks == "spec"

    def rngs(c: FusedMLPCall) -> tuple:
        if not spec_masks:
            return (c.generator, None)
        b, m = c.block, c.call.shape[0]
        hidden = dropout_rng.draw_for(b.x, c.generator, m * b.w_out.shape[1]) if b.p > 0 else None
        out = dropout_rng.draw_for(b.x, c.generator, m * b.w_out.shape[0]) if b.p_out > 0 else None
        return hidden, out

    def one(c: FusedMLPCall) -> Tensor:
        y = run(c.block, rngs(c))
        return y if c.flat else y.view(c.out_shape)

    return one


def runner(kernels: Kernels, call: Call) -> Callable[[FusedMLPCall], Tensor]:
    """How calls like ``call`` run on ``kernels`` (``running.runner``; the baseline as a user writes it)."""
    if kernels is BASELINE_KERNELS:
        return composite_runner(call)
    return running.runner(CALLING, kernels, call, _bind)


# ----------------------------------------------------------------------------- torch.compile

_EMPTY = (0,)


def _kernels(b: MLPOperands, training: bool, backend: str) -> Kernels:
    """The kernels a graph's call runs on, chosen as it runs: ones that take the spec's rngs the graph
    drew (``select.kernels``: a graph traced under ``use_backend()`` may run outside it)."""
    m, h = b.x.shape
    dropout = b.p > 0 or b.p_out > 0
    shape = (m, h, b.w_out.shape[1])
    call = Call(NAME, b.x.device, b.x.dtype, shape, training, TRAITS, (b.activation, dropout))
    return ops.dispatcher().kernels(call, backend or None)


def _fake(x, w_in, w_up, b_in, b_up, w_out, b_out, *settings):  # settings: ..., backend, training
    f_in = w_in.shape[0] * (1 if w_up is None else 2)
    pre = (x.shape[0], f_in) if settings[-1] else _EMPTY
    return x.new_empty((x.shape[0], w_out.shape[0])), x.new_empty(pre)


def _backward(grad_y: Tensor, x: Tensor, w_in: Tensor, w_up: Optional[Tensor], b_in: Optional[Tensor],
              b_up: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], activation: str, p: float,
              p_out: float, rng_hidden: Optional[Tensor], rng_out: Optional[Tensor], backend: str,
              pre: Tensor, needs: list[bool]) -> list[Tensor]:  # fmt: skip
    b = MLPOperands(x, w_in, w_up, b_in, b_up, w_out, b_out, activation, p, p_out)
    grads = _kernels(b, True, backend).backward(grad_y, b, (rng_hidden, rng_out), (pre,), tuple(needs))
    # an output may alias no other: the halves of one stacked gradient (a pair's biases) are copied
    return [x.new_empty(_EMPTY) if g is None else g.clone() if g._base is not None else g for g in grads]


@running.custom_op(NAME, _fake, _backward, tensors=7)
def _custom(x: Tensor, w_in: Tensor, w_up: Optional[Tensor], b_in: Optional[Tensor], b_up: Optional[Tensor],
            w_out: Tensor, b_out: Optional[Tensor], activation: str, p: float, p_out: float,
            rng_hidden: Optional[Tensor], rng_out: Optional[Tensor], backend: str,
            training: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(y, pre): the first projection's output kept for backward, empty without autograd."""
    b = MLPOperands(x, w_in, w_up, b_in, b_up, w_out, b_out, activation, p, p_out)
    kernels = _kernels(b, training, backend)
    if not training:
        return kernels.inference(b, (rng_hidden, rng_out)), x.new_empty(_EMPTY)
    y, (pre, *_) = kernels.forward(b, (rng_hidden, rng_out))  # a kernel's other kept tensors: formed again
    return y, pre


# ----------------------------------------------------------------------------- the spec


class FusedMLPSpec(OpSpec):
    name = NAME
    public_name = "fused_mlp"
    dims = ("M", "H", "F")
    traits = TRAITS
    activations = (*ACTIVATION_NAMES, *GATED_NAMES)
    grid = Grid(
        features=((768, 3072), (1024, 4096), (896, 4864), (4096, 11008)),  # GPT-2, BERT-large, Qwen2, LLaMA-2
        quick={"cuda": ((768, 3072), (4096, 11008)), "cpu": ((64, 256),)},
        # gelu_tanh and relu: the first product's epilogue writes a without dropout (triton's block 0.92-0.94x
        # the passes' time at GPT-2's, H100); the rest run the passes
        classes=(
            ("gelu_tanh", "relu"),
            ("gelu", "silu", "identity", "leaky_relu", "squared_relu"),
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
        """Inline: the baseline math, which inductor fuses with its neighbours, dropout from its own RNG
        (or the generator's, as in eager mode). Otherwise (a backend requested that takes the spec's
        rngs) one custom op running it, both masks the spec's, their rngs drawn in the graph. Where the
        opaque op beats inductor's code for the block is not measured yet: math unless asked."""
        assert isinstance(c, FusedMLPCall)
        b = c.block
        if inline:
            return baseline(b, c.generator).view(c.out_shape)
        rngs = (dropout_rng.draw(b.x.device, c.generator) if q > 0 else None for q in (b.p, b.p_out))
        y = _custom(*b.tensors, b.activation, b.p, b.p_out, *rngs, backend or "", c.call.training)[0]
        return y.view(c.out_shape)

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
            return baseline(MLPOperands(x, w_in, None, b_in, None, w_out, b_out, case.activation, p, p_out))
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
        block = MLPOperands(x, w_in, None, b_in, None, w_out, b_out, case.activation, p, p)
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


def module_call(x: Tensor, dtype: torch.dtype, hidden: int, activation: str, dropout: bool, grad: bool) -> Call:
    """The decision key ``parse`` would make for a module's call on x (..., H) whose weights are known to
    fit it (``dispatch.nn.FusedMLP``'s own layers): the key alone, without checking the arguments."""
    m, h = checks.rows_of(x.shape)
    return new_call((NAME, x.device, dtype, (m, h, hidden), grad, TRAITS, (activation, dropout)))


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
