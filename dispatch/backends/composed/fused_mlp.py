"""fused_mlp as the package's two other ops chained the way a model would call them, each sub-call
dispatched on its own by the table (``ops.dispatcher().run_by_table``), differentiated by torch's
autograd through the sub-ops (each regenerates its own mask in backward):

    a = fused_linear(x, W_in, b_in, act)                        the activation in the GEMM's epilogue
        or, for a gate, fused_linear(x, W_gate, b_gate, act) * fused_linear(x, W_up, b_up)
    a = fused_bias_act_dropout(a, None, "identity", p)          mask hidden: the spec's, M*F elements
    y = fused_linear(a, W_out, b_out)
    y = fused_bias_act_dropout(y, None, "identity", p_out)      mask out: the spec's, M*H_out elements

A stacked [gate; up] weight is used as its two row halves (views, never copied), so both layouts run
the same calls, as LLaMA's ``act(gate_proj(x)) * up_proj(x)``. Each dropout sub-call draws its rng from
the caller's generator, hidden then output, with ``draw_for`` over its own (M, F) or (M, H_out) input:
the draws the op's reference makes, so the masks are the spec's masks of every other backend.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dispatch import ops
from dispatch.contracts.activations import GATES
from dispatch.contracts.backend import Kernels
from dispatch.ops import bias_act_dropout as bias_act_dropout_spec
from dispatch.ops import fused_linear as linear_spec
from dispatch.ops.fused_mlp_math import MLPOperands, gate_halves


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    return ops.dispatcher().run_by_table(linear_spec.SPEC, linear_spec.parse(x, weight, bias, activation))


def _dropout(t: Tensor, p: float, generator: Optional[torch.Generator]) -> Tensor:
    if p == 0.0:
        return t
    c = bias_act_dropout_spec.parse(t, None, "identity", p, True, generator=generator)
    return ops.dispatcher().run_by_table(bias_act_dropout_spec.SPEC, c)


def _hidden(b: MLPOperands) -> Tensor:
    """act(x @ W_in^T + b_in), or act(gate) * up: (M, F)."""
    w, w_up, bias, bias_up = gate_halves(b)
    if w_up is None:
        return _linear(b.x, w, bias, b.activation)
    return _linear(b.x, w, bias, GATES[b.activation]) * _linear(b.x, w_up, bias_up, "identity")


def forward(b: MLPOperands, rngs: tuple) -> tuple[Tensor, tuple]:
    generator = rngs[0]  # masks "generator": (the caller's generator or None, None)
    a = _dropout(_hidden(b), b.p, generator)  # (M, F)
    y = _dropout(_linear(a, b.w_out, b.b_out, "identity"), b.p_out, generator)  # (M, H_out)
    return y, ()


def inference(b: MLPOperands, rngs: tuple) -> Tensor:
    return forward(b, rngs)[0]


def backward(grad_y: Tensor, b: MLPOperands, rngs: tuple, saved: tuple, needs: tuple) -> tuple:
    raise RuntimeError("composed runs under torch's autograd through its sub-calls: it has no backward")


def _autograd(activation: str) -> bool:
    return True


KERNELS = Kernels(
    forward=forward, backward=backward, inference=inference, autograd=_autograd, masks="generator"
)
