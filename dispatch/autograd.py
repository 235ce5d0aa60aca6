"""The autograd glue of both ops: a backend's forward and backward in one ``torch.autograd.Function``
per op, and, when a backward builds a graph (``create_graph=True``), gradients from differentiating the
eager reference instead, so that second-order terms are never lost whatever the backend.

The dropout mask is never saved: backward regenerates it from the forward's ``rng``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The eager backends' math dtype: float32 for half inputs (PyTorch's opmath), else x's own."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _differentiable_grads(
    make_y: Callable[[], Tensor], inputs: tuple, needs: tuple, grad_y: Tensor
) -> tuple[Optional[Tensor], ...]:
    """A backward with ``create_graph=True``: the gradients of the eager reference ``make_y()`` in
    ``inputs``, computed by torch's autograd with a graph, so that they are differentiable again in the
    inputs and in ``grad_y``. ``inputs``: the Function's saved inputs, which unpack to the caller's own
    tensors, so that graph reaches them; None where an input is None or needs no gradient."""
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    if not wanted:
        return (None,) * len(inputs)
    y = make_y()
    found = iter(torch.autograd.grad(y, wanted, grad_y.to(y.dtype), create_graph=True, allow_unused=True))
    return tuple(next(found) if need and t is not None else None for t, need in zip(inputs, needs))


class BiasActDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, bias, impl, activation, p, rng):  # type: ignore[override]
        ctx.impl, ctx.activation, ctx.p = impl, activation, p
        if isinstance(rng, Tensor) or rng is None:
            ctx.save_for_backward(x, bias, rng)
            ctx.rng = None
        else:  # HostRng: plain integers
            ctx.save_for_backward(x, bias)
            ctx.rng = rng
        return impl.forward(x, bias, activation, p, rng)

    @staticmethod
    def backward(ctx: Any, grad_y):  # type: ignore[override]
        saved = ctx.saved_tensors
        x, bias, rng = saved[0], saved[1], saved[2] if len(saved) == 3 else ctx.rng
        need_x, need_bias = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():
            # create_graph=True (backward runs in grad mode exactly then): the backends' kernels give
            # numbers without a graph, and a gradient penalty would silently lose its second-order
            # term. Differentiate the eager reference instead (same mask: the forward's rng).
            from dispatch.backends.eager.bias_act_dropout import reference

            activation, p = ctx.activation, ctx.p
            dtype = _compute_dtype(x.dtype)

            def make_y() -> Tensor:
                b = None if bias is None else bias.to(dtype)
                return reference(x.to(dtype), b, activation, p, rng)

            grad_x, grad_bias = _differentiable_grads(make_y, (x, bias), (need_x, need_bias), grad_y)
        else:
            grad_x, grad_bias = ctx.impl.backward(
                grad_y, x, bias, ctx.activation, ctx.p, rng, need_x, need_bias
            )
        return grad_x, grad_bias, None, None, None, None


class FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, impl, activation):  # type: ignore[override]
        y, saved = impl.forward(x, weight, bias, activation)
        ctx.impl, ctx.activation = impl, activation
        ctx.save_for_backward(x, weight, bias, saved)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y):  # type: ignore[override]
        x, weight, bias, saved = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        if torch.is_grad_enabled():
            # create_graph=True: as in BiasActDropout. ``saved`` (the forward's pre-activation or y) has
            # no graph: a backward built on it misses every second-order term through x and weight.
            from dispatch.backends.eager.fused_linear import reference

            activation = ctx.activation
            dtype = _compute_dtype(x.dtype)

            def make_y() -> Tensor:
                b = None if bias is None else bias.to(dtype)
                return reference(x.to(dtype), weight.to(dtype), b, activation)

            grads = _differentiable_grads(make_y, (x, weight, bias), needs, grad_y)
        else:
            grads = ctx.impl.backward(grad_y, x, weight, bias, saved, ctx.activation, needs)
        return (*grads, None, None)



def fused_linear_training(
    impl: Any, activation: str
) -> Callable[[Tensor, Tensor, Optional[Tensor], str], Tensor]:
    """How a fused_linear call with autograd runs on the op module ``impl``: its ``differentiable``
    function where it offers one for ``activation`` (ops that torch's autograd differentiates, no Python
    Function around them), else ``impl.forward``/``impl.backward`` in ``FusedLinear``."""
    differentiable = getattr(impl, "differentiable", None)
    fn = differentiable(activation) if differentiable is not None else None
    if fn is not None:
        return fn
    apply = FusedLinear.apply

    def with_function(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
        return apply(x, weight, bias, impl, activation)

    return with_function
