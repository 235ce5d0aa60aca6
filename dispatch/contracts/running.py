"""How a call runs on a backend's kernels, written once for every op; each op says only how its own
kernels take its operands (``Calling``). Imports nothing of ours but the other contracts.

- ``runner``: what the calls of one decision run, chosen once: the kernels' inference, their forward
  under torch's autograd, or forward and backward through ``KernelsFunction``.
- ``KernelsFunction``: a backend's forward and backward as one autograd node.
- ``custom_op``: the torch.library op a compiled graph keeps, its backward op and the autograd between.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from dispatch.contracts.backend import Call, Kernels
from dispatch.contracts.op import compute_dtype, differentiable_grads


@dataclass(frozen=True)
class Calling:
    """How an op's kernels take its operands (their signatures are the op's, in its spec file): their
    arguments are the op's ``tensors`` differentiable inputs (None where absent), then its settings
    (activation, p, the spec's rngs...), unless ``flat`` says otherwise. The op returns ``outputs``
    tensors (y, or y and more: a tuple), each of which may carry a gradient."""

    tensors: int
    # (kernels, grad_y, tensors, saved, settings, needs) -> a gradient per tensor (None where not needed);
    # grad_y a tuple of one gradient per output (None where unused) for an op of several outputs
    backward: Callable[[Kernels, Any, tuple, tuple, tuple, tuple], tuple]
    # the reference, for a backward building a graph: differentiated in the kept tensors
    differentiable: Optional[Callable[[tuple, tuple], Tensor]] = None
    saves: bool = True  # the kernels' forward returns (*outputs, *saved); False: the outputs alone
    # Kernels whose arguments are not (*tensors, *settings), as fused_mlp's (operands, rngs): their
    # arguments as those, and forward on them -> (y, *saved).
    flat: Optional[Callable[[tuple], tuple]] = None
    forward: Optional[Callable[[Kernels, tuple], tuple]] = None
    outputs: int = 1
    # Which tensors the autograd node keeps for backward (None: all): one its backward does not read is
    # let go (it reaches backward as None). A backward building a graph then runs
    # ``differentiable_backward`` (the same signature as ``backward``, in differentiable torch ops on
    # what was kept) instead of differentiating ``differentiable``.
    kept: Optional[tuple[bool, ...]] = None
    differentiable_backward: Optional[Callable[[Any, tuple, tuple, tuple, tuple], tuple]] = None


class KernelsFunction(torch.autograd.Function):
    """A backend's forward and backward as one autograd node, ``apply((calling, kernels), *args)`` on
    the kernels' own arguments: the tensors are saved for backward (those ``Calling.kept`` names), the
    settings ride along (a dropout mask is regenerated from its rng in backward, never saved). A backward
    that builds a graph (create_graph=True) differentiates the reference on the same settings instead:
    the kernels' numbers carry no graph, and would drop second-order terms. An op of several outputs
    returns them as a tuple; an output no one used gets no gradient (None, not zeros)."""

    @staticmethod
    def forward(ctx: Any, state: tuple[Calling, Kernels], *args: Any) -> Any:  # type: ignore[override]
        calling, kernels = state
        count, outputs = calling.tensors, calling.outputs
        ctx.state, ctx.settings = state, args[count:]
        if calling.forward is not None:
            out = calling.forward(kernels, args)
        elif not calling.saves:
            ctx.save_for_backward(*args[:count])
            return kernels.forward(*args)
        else:
            out = kernels.forward(*args)
        tensors = args[:count]
        if calling.kept is not None:
            ctx.present = tuple(t is not None for t in tensors)
            tensors = tuple(t if keep else None for t, keep in zip(tensors, calling.kept))
        ctx.save_for_backward(*tensors, *out[outputs:])
        if outputs == 1:
            return out[0]
        ctx.set_materialize_grads(False)
        return tuple(out[:outputs])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:  # type: ignore[override]
        (calling, kernels), settings, count = ctx.state, ctx.settings, ctx.state[0].tensors
        grad_y = grads[0] if calling.outputs == 1 else grads
        kept = ctx.saved_tensors
        tensors, saved = kept[:count], kept[count:]
        present = ctx.present if calling.kept is not None else tuple(t is not None for t in tensors)
        needs = tuple(need and p for need, p in zip(ctx.needs_input_grad[1:], present))
        if torch.is_grad_enabled() and calling.differentiable_backward is not None:
            grads_in = calling.differentiable_backward(grad_y, tensors, saved, settings, needs)
        elif torch.is_grad_enabled():
            dtype = compute_dtype(tensors[0].dtype)
            differentiable = calling.differentiable
            assert differentiable is not None, "an op keeping every tensor gives its reference"

            def make_y() -> Tensor:
                cast = tuple(None if t is None else t.to(dtype) for t in tensors)
                return differentiable(cast, settings)

            grads_in = differentiable_grads(make_y, tensors, needs, grad_y)
        elif any(needs):
            grads_in = calling.backward(kernels, grad_y, tensors, saved, settings, needs)
        else:
            grads_in = (None,) * count
        return (None, *grads_in, *(None,) * len(settings))


def runner(
    calling: Calling, kernels: Kernels, call: Call, bind: Callable[..., Callable[[Any], Tensor]]
) -> Callable[[Any], Tensor]:
    """What calls like ``call`` run on ``kernels``, chosen once per decision: without autograd the
    kernels' inference; with it their forward, where torch's autograd differentiates it
    (``Kernels.autograd``), else forward and backward through ``KernelsFunction``.
    ``bind(run, kernels, draws)`` makes the function of one call object: it hands ``run`` the kernels'
    own arguments, drawing the spec's dropout rng where ``draws`` (spec masks on a dropout call)."""
    if not call.training:
        run = kernels.inference
    elif kernels.autograd(call.activation):
        run = _y_of(kernels.forward, calling.outputs) if calling.saves else kernels.forward
    else:
        run = _through_function(calling, kernels)
    return bind(run, kernels, kernels.masks == "spec" and call.dropout)


def _y_of(forward: Callable[..., tuple], outputs: int) -> Callable[..., Any]:
    """A forward's outputs without what it saves for backward: y, or a tuple of ``outputs``."""
    if outputs > 1:
        return lambda *args: tuple(forward(*args)[:outputs])

    def run(*args: Any) -> Tensor:
        return forward(*args)[0]

    return run


def _through_function(calling: Calling, kernels: Kernels) -> Callable[..., Tensor]:
    apply, state, flat = KernelsFunction.apply, (calling, kernels), calling.flat
    if flat is None:
        return functools.partial(apply, state)  # no Python frame between the call and the node

    def run_flat(*args: Any) -> Tensor:
        return apply(state, *flat(args))

    return run_flat


def custom_op(
    name: str, fake: Callable, backward: Callable, tensors: int, outputs: int = 1
) -> Callable[[Callable], Any]:  # fmt: skip
    """Decorates ``forward``: the torch.library op ``fusedispatch::<name>`` a compiled graph keeps, with
    torch's autograd over its backward op ``fusedispatch::<name>_backward``. Typed functions (torch
    reads the schemas off their annotations):

        forward(*tensors, *settings, backend: str, training: bool) -> y, or (y, *saved)
        fake: forward's shapes, without running it
        backward(grad_y, *tensors, *settings, backend, *saved, needs: list[bool]) -> list[Tensor]

    ``tensors`` counts the op's differentiable inputs, which lead its arguments; backward returns
    their gradients, an empty tensor for each one ``needs`` does not ask for. An op of several
    ``outputs`` returns (*outputs, *saved) and its backward takes a gradient for each output first
    (zeros for one unused); ``saved`` is everything forward returned past y, its other outputs too."""
    return lambda forward: _register(name, forward, fake, backward, tensors, outputs)


def _register(name: str, forward: Callable, fake: Callable, backward: Callable, tensors: int,
              outputs: int) -> Any:  # fmt: skip
    op = torch.library.custom_op(f"fusedispatch::{name}", forward, mutates_args=())
    op.register_fake(fake)
    grads = torch.library.custom_op(f"fusedispatch::{name}_backward", backward, mutates_args=())

    @grads.register_fake
    def _(grad_y: Tensor, *args: Any) -> list[Tensor]:
        needs, args = args[-1], args[outputs - 1 :]  # a flag per tensor: zip stops past the tensors
        return [t.new_empty(t.shape) if need else grad_y.new_empty((0,)) for t, need in zip(args, needs)]

    def setup(ctx: Any, inputs: tuple, output: Any) -> None:
        inputs = inputs[:-1]  # training: a backward always trains
        held = tuple(isinstance(v, Tensor) or v is None for v in inputs)
        saved = output[1:] if isinstance(output, tuple) else ()
        ctx.held, ctx.values, ctx.n_saved = held, [v for v, h in zip(inputs, held) if not h], len(saved)
        ctx.save_for_backward(*saved, *(v for v, h in zip(inputs, held) if h))

    def backward_of(ctx: Any, *grad_outs: Tensor) -> tuple:
        kept = ctx.saved_tensors
        saved, held, values = kept[: ctx.n_saved], iter(kept[ctx.n_saved :]), iter(ctx.values)
        inputs = [next(held) if h else next(values) for h in ctx.held]
        needs = [bool(ctx.needs_input_grad[i]) and inputs[i] is not None for i in range(tensors)]
        rest = (None,) * (len(inputs) + 1 - tensors)  # the settings, backend and training
        if not any(needs):
            return (None,) * tensors + rest
        found = grads(*grad_outs[:outputs], *inputs, *saved, needs)
        return (*(g if need else None for g, need in zip(found, needs)), *rest)

    op.register_autograd(backward_of, setup_context=setup)
    return op
