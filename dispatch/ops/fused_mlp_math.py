"""fused_mlp's block and its math, the op's definition: the ``MLPOperands`` its kernels take, the signatures
they keep, the reference (float64 when asked) and the baseline a user writes, as kernels too.
``dispatch.ops.fused_mlp`` builds the op on them (checks, running, custom op, spec) and re-exports
``MLPOperands`` and ``reference``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATIONS, GATES
from dispatch.contracts.backend import Call, composite_kernels
from dispatch.contracts.op import torch_keep, torch_keep_scale

TENSORS = ("x", "w_in", "w_up", "b_in", "b_up", "w_out", "b_out")  # an MLPOperands' tensors, in order


class MLPOperands(NamedTuple):
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


# A backend's ``Kernels`` (dispatch.contracts.backend) for this op. ``rngs`` is (rng_hidden, rng_out),
# the spec's (seed, offset) of each mask for masks "spec" (None where its p is 0), or (generator, None)
# for masks "torch" and "generator". ``saved`` is what backward needs beyond the inputs, never a mask:
# for masks "spec" (pre,), the first projection's output (M, F) or (M, 2F), which the custom op a
# compiled graph keeps promises.
#   forward(block, rngs) -> (y, saved)                       a call with autograd
#   inference(block, rngs) -> y                              a call without
#   backward(grad_y, block, rngs, saved, needs) -> grads     needs and grads follow MLPOperands.tensors


def project_in(x: Tensor, b: MLPOperands, dtype: Optional[torch.dtype] = None) -> Tensor:
    """x @ W_in^T + b_in: (M, F), or (M, 2F) [gate; up] for a gate; in ``dtype`` if given."""
    cast = (lambda t: t) if dtype is None else (lambda t: None if t is None else t.to(dtype))  # noqa: E731
    pre = F.linear(cast(x), cast(b.w_in), cast(b.b_in))
    if b.w_up is None:
        return pre
    return torch.cat([pre, F.linear(cast(x), cast(b.w_up), cast(b.b_up))], dim=-1)


def gate_halves(b: MLPOperands) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(w, w_up, b, b_up) of the first projection: a gate's halves, views of the stacked [gate; up]
    weight and bias or the pair as given; (w_in, None, b_in, None) for a plain activation."""
    if b.activation not in GATES:
        return b.w_in, None, b.b_in, None
    if b.w_up is not None:
        return b.w_in, b.w_up, b.b_in, b.b_up
    f = b.w_in.shape[0] // 2
    bias = (None, None) if b.b_in is None else (b.b_in[:f], b.b_in[f:])
    return b.w_in[:f], b.w_in[f:], *bias


def activate(pre: Tensor, activation: str) -> Tensor:
    """act(pre), or act(gate) * up for a gate."""
    if activation in GATES:
        gate, up = pre.chunk(2, dim=-1)
        return ACTIVATIONS[GATES[activation]].forward(gate) * up
    return ACTIVATIONS[activation].forward(pre)


def reference(b: MLPOperands, rngs: tuple[Any, Any] = (None, None), upcast: bool = False,
              keeps: tuple[Optional[Tensor], Optional[Tensor]] = (None, None)) -> Tensor:  # fmt: skip
    """The definition, differentiable, on the block's (M, H) rows; float64 when ``upcast``. The masks
    are the spec's for ``rngs`` (its scale), or ``keeps``, torch's (F.dropout's 1 / (1 - p))."""
    dtype = torch.float64 if upcast else b.x.dtype
    a = activate(project_in(b.x, b, dtype), b.activation)
    a = drop(a, b.p, rngs[0]) if keeps[0] is None else a * keeps[0] * torch_keep_scale(b.p)
    y = F.linear(a, b.w_out.to(dtype), None if b.b_out is None else b.b_out.to(dtype))
    return drop(y, b.p_out, rngs[1]) if keeps[1] is None else y * keeps[1] * torch_keep_scale(b.p_out)


def drop(t: Tensor, p: float, rng: Any, keep: Optional[Tensor] = None) -> Tensor:
    """t * keep * scale (F.dropout's product), the mask ``keep`` or the spec's for ``rng``."""
    if keep is None and rng is not None and p > 0:
        keep = dropout_rng.keep_mask(rng, t.shape[0], t.shape[1], p, t.device)
    return t if keep is None else t * keep * dropout_rng.keep_scale(p)  # F.dropout's product


def baseline(b: MLPOperands, generator: Optional[torch.Generator] = None) -> Tensor:
    """The module a user writes, in x's dtype, dropout from torch's RNG (``generator``'s if given). A
    (gate, up) pair runs as LLaMA's MLP does, down(act(gate(x)) * up(x)): two products, no stacked copy."""
    if b.w_up is None:
        a = activate(F.linear(b.x, b.w_in, b.b_in), b.activation)
    else:
        act = ACTIVATIONS[GATES[b.activation]].forward
        a = act(F.linear(b.x, b.w_in, b.b_in)) * F.linear(b.x, b.w_up, b.b_up)
    return _torch_dropout(F.linear(_torch_dropout(a, b.p, generator), b.w_out, b.b_out), b.p_out, generator)


def _torch_dropout(t: Tensor, p: float, generator: Optional[torch.Generator]) -> Tensor:
    if p == 0.0:
        return t
    if generator is None:
        return F.dropout(t, p, training=True)
    return t * torch_keep(t.shape, t.dtype, t.device, p, generator) * (1.0 / (1.0 - p))


def composite_runner(call: Call) -> Callable[[Any], Tensor]:
    """The pytorch backend's runner: the baseline as a user writes it, no frames between the call and
    torch's ops (13.5 -> 10 us over a 24 us composite on a CPU); a generator takes ``baseline``."""
    gated = call.activation in GATES
    act = ACTIVATIONS[GATES.get(call.activation, call.activation)].forward
    linear, dropout = F.linear, F.dropout

    def composite(c: Any) -> Tensor:  # a FusedMLPCall
        b = c.block
        if c.generator is not None:
            y = baseline(b, c.generator)
        else:
            if b.w_up is not None:  # LLaMA's two products, as its module runs them
                a = act(linear(b.x, b.w_in, b.b_in)) * linear(b.x, b.w_up, b.b_up)
            elif gated:
                gate, up = linear(b.x, b.w_in, b.b_in).chunk(2, dim=-1)
                a = act(gate) * up
            else:
                a = act(linear(b.x, b.w_in, b.b_in))
            y = linear(dropout(a, b.p) if b.p else a, b.w_out, b.b_out)
            if b.p_out:
                y = dropout(y, b.p_out)
        return y if c.flat else y.view(c.out_shape)

    return composite


def _baseline_backward(grad_y: Tensor, b: MLPOperands, rngs: tuple, saved: tuple, needs: tuple) -> tuple:
    """Without dropout only: a torch-RNG mask is kept by autograd, never regenerated."""
    if b.p or b.p_out:
        raise RuntimeError("the pytorch backend's dropout masks are torch's: its backward is autograd's")
    return grads_of(lambda blk: baseline(blk), b, needs, grad_y)


def grads_of(fn: Callable[[MLPOperands], Tensor], b: MLPOperands, needs: tuple, grad_y: Tensor) -> tuple:
    """The gradients of ``fn(b)`` in the block's tensors where ``needs`` says (None elsewhere)."""
    leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(b.tensors, needs)]
    with torch.enable_grad():
        y = fn(MLPOperands(*leaves, *b[7:]))  # type: ignore[arg-type]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad(y, wanted, grad_y) if wanted else ())
    return tuple(next(found) if t is not None and t.requires_grad else None for t in leaves)


BASELINE_KERNELS = composite_kernels(
    lambda b, rngs: (baseline(b, rngs[0]), ()), _baseline_backward, lambda b, rngs: baseline(b, rngs[0])
)


def cast(b: MLPOperands, dtype: torch.dtype) -> MLPOperands:
    """The block with its tensors in ``dtype``."""
    tensors = (None if t is None else t.to(dtype) for t in b.tensors)
    return MLPOperands(*tensors, *b[7:])  # type: ignore[arg-type]
