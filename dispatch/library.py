"""The ops as ``torch.library`` custom ops, used when ``torch.compile`` traces a model.

When no backend is requested (no ``backend=`` argument, ``use_backend`` or ``DISPATCH_BACKEND`` at
trace time), both ops are traced as plain math instead (``inline``): inductor then fuses bias,
activation and dropout with their neighbours exactly as it does for ``nn.Linear`` + activation +
``nn.Dropout``, where an opaque node would block that fusion (compiled GPT-2 ran at 0.74x of the
unpatched compiled model with opaque nodes, 0.996x with only dropout opaque; benchmarks/PERF.md).
Dropout's mask then comes from inductor's RNG, as ``nn.Dropout``'s does under compile. A requested
backend, or a ``generator`` passed to the op, keeps the custom op and ``dispatch.contracts.rng``'s spec.

Inside a compiled graph each custom op is one opaque node with a fake (shape-only) implementation
and a registered autograd formula; the backend is chosen when the node runs, by the same rules as in
eager mode. Forward and backward may land on different backends: every backend computes the same
function and regenerates the same dropout mask from ``rng``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dispatch import select
from dispatch.registry import fused_linear_inference

_EMPTY = (0,)


@torch._dynamo.assume_constant_result
def _requested_at_trace_time() -> bool:
    """Whether ``use_backend`` or ``DISPATCH_BACKEND`` names a backend: read when a graph is traced
    (a compiled graph keeps the choice it was traced with)."""
    return select._requested.get() is not None or select.env_backend() is not None


def inline(backend: Optional[str]) -> bool:
    """Trace the reference math rather than the custom op: no backend requested in any way."""
    return backend is None and not _requested_at_trace_time()


def _impl(op: str, x: Tensor, shape: tuple[int, ...], activation: str, dropout: bool, training: bool, backend: str):
    key = select.key(op, x.device, x.dtype, shape, activation, dropout, training, backend or None)
    return select.decision(key).backend.ops[op]


def _empty_if_none(t: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty(_EMPTY) if t is None else t


# ----------------------------------------------------------------------------- bias_act_dropout


@torch.library.custom_op("fusedispatch::bias_act_dropout", mutates_args=())
def bias_act_dropout(
    x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Tensor], backend: str, training: bool
) -> Tensor:
    impl = _impl("bias_act_dropout", x, tuple(x.shape), activation, rng is not None, training, backend)
    return impl.forward(x, bias, activation, p, rng)


@bias_act_dropout.register_fake
def _(x, bias, activation, p, rng, backend, training):
    return x.new_empty(x.shape)


@torch.library.custom_op("fusedispatch::bias_act_dropout_backward", mutates_args=())
def bias_act_dropout_backward(
    grad_y: Tensor,
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float,
    rng: Optional[Tensor],
    need_x: bool,
    need_bias: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    impl = _impl("bias_act_dropout", x, tuple(x.shape), activation, rng is not None, True, backend)
    grad_x, grad_bias = impl.backward(grad_y, x, bias, activation, p, rng, need_x, need_bias)
    return _empty_if_none(grad_x, x), _empty_if_none(grad_bias, x)


@bias_act_dropout_backward.register_fake
def _(grad_y, x, bias, activation, p, rng, need_x, need_bias, backend):
    grad_x = x.new_empty(x.shape if need_x else _EMPTY)
    grad_bias = x.new_empty(bias.shape if need_bias and bias is not None else _EMPTY)
    return grad_x, grad_bias


def _bad_setup(ctx, inputs, output):
    x, bias, activation, p, rng, backend, _ = inputs
    ctx.save_for_backward(x, bias, rng)
    ctx.args = (activation, p, backend)


def _bad_backward(ctx, grad_y):
    x, bias, rng = ctx.saved_tensors
    activation, p, backend = ctx.args
    need_x, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and bias is not None
    grad_x, grad_bias = bias_act_dropout_backward(grad_y, x, bias, activation, p, rng, need_x, need_bias, backend)
    return (grad_x if need_x else None), (grad_bias if need_bias else None), None, None, None, None, None


bias_act_dropout.register_autograd(_bad_backward, setup_context=_bad_setup)


# ----------------------------------------------------------------------------- fused_linear


@torch.library.custom_op("fusedispatch::fused_linear", mutates_args=())
def _fused_linear_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str, training: bool
) -> tuple[Tensor, Tensor]:
    shape = (x.shape[0], weight.shape[0], x.shape[1])
    impl = _impl("fused_linear", x, shape, activation, False, training, backend)
    if not training:  # no autograd: nothing to keep (the fake promises an empty saved tensor)
        return fused_linear_inference(impl)(x, weight, bias, activation), x.new_empty(_EMPTY)
    y, saved = impl.forward(x, weight, bias, activation)
    if saved is None and activation != "identity":  # cublaslt recomputes it in backward; the fake promises (M, N)
        saved = torch.nn.functional.linear(x, weight, bias)
    return y, _empty_if_none(saved, x)


@_fused_linear_op.register_fake
def _(x, weight, bias, activation, backend, training):
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(_EMPTY if activation == "identity" or not training else shape)


@torch.library.custom_op("fusedispatch::fused_linear_backward", mutates_args=())
def _fused_linear_backward(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    saved: Tensor,
    activation: str,
    needs: list[bool],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    shape = (x.shape[0], weight.shape[0], x.shape[1])
    impl = _impl("fused_linear", x, shape, activation, False, True, backend)
    kept = None if saved.numel() == 0 and activation == "identity" else saved
    grads = impl.backward(grad_y, x, weight, bias, kept, activation, tuple(needs))
    return tuple(_empty_if_none(g, x) for g in grads)  # type: ignore[return-value]


@_fused_linear_backward.register_fake
def _(grad_y, x, weight, bias, saved, activation, needs, backend):
    shapes = (x.shape, weight.shape, None if bias is None else bias.shape)
    return tuple(x.new_empty(s if need and s is not None else _EMPTY) for need, s in zip(needs, shapes))


def _linear_setup(ctx, inputs, output):
    x, weight, bias, activation, backend, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.args = (activation, backend)


def _linear_backward(ctx, grad_y, _grad_saved):
    x, weight, bias, saved = ctx.saved_tensors
    activation, backend = ctx.args
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and bias is not None]
    grads = _fused_linear_backward(grad_y, x, weight, bias, saved, activation, needs, backend)
    return *(g if need else None for g, need in zip(grads, needs)), None, None, None


_fused_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str, training: bool) -> Tensor:
    return _fused_linear_op(x, weight, bias, activation, backend, training)[0]
