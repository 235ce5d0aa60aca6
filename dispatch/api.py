"""The two public ops: validate the call, decide its backend (cached per call signature), run it.

Each call reads its arguments once (``dispatch.checks``, which raise the clear errors), builds its
decision key (``dispatch.select.key``) and runs what the cache holds for that key: the chosen backend's
op, inside the op's autograd Function (``dispatch.autograd``) when a backward will be needed. Under
``torch.compile`` the ops trace as plain PyTorch, or as one custom op each when a backend is requested
(``dispatch.library``).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import Tensor

from dispatch.contracts import rng as dropout_rng
from dispatch import select
from dispatch.autograd import BiasActDropout, fused_linear_training
from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.checks import bias_act_dropout_args, check_backend, fused_linear_args
from dispatch.registry import Call, fused_linear_inference, trusted
from dispatch.select import Decision


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will want a backward of this call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def fused_bias_act_dropout(
    x: Tensor,
    bias: Optional[Tensor] = None,
    activation: str = "gelu",
    p: float = 0.0,
    training: bool = True,
    *,
    generator: Optional[torch.Generator] = None,
    backend: Optional[str] = None,
) -> Tensor:
    """Dropout(Activation(x + bias)) in one fused pass, forward and backward.

    x: (..., N) dense floating tensor; bias: (N,) or None, x's dtype and device. activation: one of
    ``dispatch.ACTIVATION_NAMES``. p: a real number in [0, 1]; training: a bool (numpy's too).
    Dropout follows ``dispatch.contracts.rng``'s spec: a 16-bit threshold, so the realized drop probability is
    within 1/131072 of p and kept values are scaled to preserve the mean exactly; the mask is
    regenerated in backward, never stored. ``p == 1`` in training drops everything as ``F.dropout``
    does: the activation times zero (zeros, zero gradients; NaN and inf inputs give NaN).
    ``training=False``, ``p == 0`` or ``p == 1`` draws no random numbers. ``backend`` forces a
    backend (see ``dispatch.explain``). Under ``torch.compile`` with no backend requested and no
    ``generator``, the op is traced as plain PyTorch (``torch.nn.functional.dropout`` for the mask) so
    that inductor fuses it with its neighbours.

    Differentiable twice: a backward with ``create_graph=True`` (a gradient penalty, say)
    differentiates the eager reference with the forward's mask, so its gradients are the reference's
    and carry their own graph, whatever the backend; without a graph, backward runs the backend.

    Equivalent PyTorch::

        F.dropout(act(x + bias), p, training)   # up to the choice of random bits
    """
    x, bias, activation, p, dropout, shape, device, dtype = bias_act_dropout_args(x, bias, activation, p, training, generator)
    if backend is not None:
        check_backend(backend)
    if dropout and p == 1.0:
        # Every element dropped. Not for the backends: the rng spec's 16-bit threshold stops at
        # 65535/65536 and 1/(1-p) is infinite. As F.dropout does, the activation times zero: zeros
        # and zero gradients, NaN and inf (0 * inf) giving NaN; no random numbers drawn.
        return fused_bias_act_dropout(x, bias, activation, 0.0, False, backend=backend).mul(0.0)
    if not dropout:
        p = 0.0
    rows = x if x.dim() == 2 else x.reshape(shape[0], shape[1])  # (M, N): a view where strides allow
    # whether autograd will want a backward (a plain or: this runs on every call)
    grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if torch.compiler.is_compiling():
        return _traced_bias_act_dropout(x, rows, bias, activation, p, dropout, generator, backend, grad)
    rng = dropout_rng.draw_for(x, generator) if dropout else None
    key = select.key("bias_act_dropout", device, dtype, shape, activation, dropout, grad, backend)
    impl = select.runner(key, trusted)  # validated above: the backend's own checks are skipped
    if grad:
        y = BiasActDropout.apply(rows, bias, impl, activation, p, rng)
    else:
        y = impl.forward(rows, bias, activation, p, rng)
    return y if rows is x else y.view_as(x)


def _traced_bias_act_dropout(x, rows, bias, activation, p, dropout, generator, backend, grad) -> Tensor:
    """Under torch.compile. No backend requested (and no generator of the caller's): plain math that
    inductor fuses with its neighbours, dropout included (inductor's mask, as for nn.Dropout; an opaque
    op here cost GPT-2 a pass over each MLP output and its host time: compile+patched 0.996x compile).
    Otherwise one custom op, with the rng spec's mask drawn by a traced op."""
    from dispatch import library

    if library.inline(backend) and (generator is None or not dropout):
        from dispatch.backends.eager.bias_act_dropout import traced

        return traced(x, bias, activation, p)
    rng = dropout_rng.draw(x.device, generator) if dropout else None
    return library.bias_act_dropout(rows, bias, activation, p, rng, backend or "", grad).view(x.shape)


def fused_linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: str = "identity",
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """Activation(x @ weight.T + bias) with bias and activation in the matmul's epilogue.

    Shapes as ``torch.nn.functional.linear``: x (..., K), weight (N, K), bias (N,) or None; all dense,
    of one floating dtype and device. Differentiable in every input that requires grad, and twice: a
    backward with ``create_graph=True`` differentiates the eager reference, so its gradients carry
    their own graph whatever the backend; without a graph, backward runs the backend.

    Equivalent PyTorch::

        act(F.linear(x, weight, bias))
    """
    x, weight, bias, activation, shape, device, dtype = fused_linear_args(x, weight, bias, activation)
    if backend is not None:
        check_backend(backend)
    m, n, k = shape
    rows = x if x.dim() == 2 else x.reshape(m, k)  # (M, K): a view where strides allow
    grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if torch.compiler.is_compiling():
        from dispatch import library

        if library.inline(backend):  # inductor fuses bias and activation as for nn.Linear
            from dispatch.backends.eager.fused_linear import traced

            return traced(x, weight, bias, activation)
        y = library.fused_linear(rows, weight, bias, activation, backend or "", grad)
        return y.view(*x.shape[:-1], n)
    key = select.key("fused_linear", device, dtype, shape, activation, False, grad, backend)
    # with autograd: the backend's differentiable function or its forward/backward in the Function;
    # without: its inference entry (registry.fused_linear_inference). Both take (x, weight, bias, act).
    run = select.runner(key, _TRAINING[activation] if grad else fused_linear_inference)
    y = run(rows, weight, bias, activation)
    return y if rows is x else y.view(*x.shape[:-1], n)


# what select.runner makes of a backend's op module for calls with autograd, one per activation
_TRAINING = {name: functools.partial(fused_linear_training, activation=name) for name in ACTIVATION_NAMES}


def explain(op_name: str, *args: Any, **kwargs: Any) -> Decision:
    """Which backend ``op_name`` (``"fused_bias_act_dropout"`` or ``"fused_linear"``) would use for
    these arguments, by which rule, and why each other backend was rejected. Print it to read it."""
    backend = check_backend(kwargs.pop("backend", None))
    if op_name in ("fused_bias_act_dropout", "bias_act_dropout"):
        call = _bias_act_dropout_call(*args, **kwargs)
    elif op_name == "fused_linear":
        call = _fused_linear_call(*args, **kwargs)
    else:
        raise ValueError(f"op_name must be 'fused_bias_act_dropout' or 'fused_linear', got {op_name!r}")
    return select.explain_call(call, backend)


def _bias_act_dropout_call(
    x: Tensor,
    bias: Optional[Tensor] = None,
    activation: str = "gelu",
    p: float = 0.0,
    training: bool = True,
    *,
    generator: Optional[torch.Generator] = None,
) -> Call:
    x, bias, activation, p, dropout, shape, device, dtype = bias_act_dropout_args(x, bias, activation, p, training, generator)
    dropout = dropout and p < 1.0  # p == 1 runs the op without dropout, times zero
    return Call("bias_act_dropout", device, dtype, shape, activation, dropout, _needs_grad(x, bias))


def _fused_linear_call(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "identity"
) -> Call:
    x, weight, bias, activation, shape, device, dtype = fused_linear_args(x, weight, bias, activation)
    return Call("fused_linear", device, dtype, shape, activation, False, _needs_grad(x, weight, bias))
