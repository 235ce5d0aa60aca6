"""fused_mlp on PyTorch ops: the spec's reference (``dispatch.ops.fused_mlp_math``) as a forward that keeps
only the first projection's output (the pre-activation) and a backward that regenerates both dropout
masks and the hidden activation from it. What a forward keeps for backward: x and pre (M x F, 2F for
a gate), where PyTorch's module keeps x, pre, the activation, its dropout mask and the output's mask.

    forward   pre = x @ W_in^T + b_in                      GEMM (bias in its epilogue)
              a = drop_p(act(pre))                          pointwise, mask from rng_hidden
              y = drop_out(a @ W_out^T + b_out)             GEMM, pointwise
    backward  g = drop_out'(grad_y), grad_b_out = sum(g)
              a recomputed from pre                         pointwise
              grad_W_out = g^T a, grad_a = g W_out          GEMMs
              grad_pre = drop_p'(grad_a) * act'(pre)        pointwise (both halves for a gate)
              grad_b_in = sum(grad_pre), grad_W_in = grad_pre^T x, grad_x = grad_pre W_in
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATIONS, GATES, composed_backward
from dispatch.contracts.backend import Kernels
from dispatch.contracts.op import compute_dtype
from dispatch.ops.fused_mlp_math import MLPOperands, activate, drop, project_in


def _keep(rng: Any, p: float, rows: int, cols: int, device: torch.device) -> Optional[Tensor]:
    """The spec's (rows, cols) keep mask of ``rng``, None without dropout."""
    return None if rng is None or p == 0.0 else dropout_rng.keep_mask(rng, rows, cols, p, device)


def _hidden(pre: Tensor, b: MLPOperands, keep: Optional[Tensor]) -> Tensor:
    """drop_p(act(pre)) in x's dtype, the math in float32 for half inputs."""
    return drop(activate(pre.to(compute_dtype(pre.dtype)), b.activation), b.p, None, keep).to(pre.dtype)


def forward(b: MLPOperands, rngs: tuple) -> tuple[Tensor, tuple[Tensor, ...]]:
    pre = project_in(b.x, b)  # (M, F) or (M, 2F)
    m, f = pre.shape[0], b.w_out.shape[1]
    y = F.linear(_hidden(pre, b, _keep(rngs[0], b.p, m, f, pre.device)), b.w_out, b.b_out)  # (M, H_out)
    if b.p_out > 0:
        y = drop(y.to(compute_dtype(y.dtype)), b.p_out, rngs[1]).to(y.dtype)
    return y, (pre,)


def inference(b: MLPOperands, rngs: tuple) -> Tensor:
    return forward(b, rngs)[0]


def _grad_pre(grad_a: Tensor, pre: Tensor, activation: str) -> Tensor:
    """grad_a * act'(pre) in float32; for a gate, (grad_a * up * act'(gate), grad_a * act(gate))."""
    if activation in GATES:
        gate, up = pre.chunk(2, dim=-1)
        act = ACTIVATIONS[GATES[activation]]
        return torch.cat([_through(act, grad_a * up, gate), grad_a * act.forward(gate)], dim=-1)
    return _through(ACTIVATIONS[activation], grad_a, pre)


def _through(act: Any, grad: Tensor, z: Tensor) -> Tensor:
    return act.backward(grad, z) if act.backward is not None else composed_backward(act, grad, z)


def backward(
    grad_y: Tensor, b: MLPOperands, rngs: tuple, saved: tuple, needs: tuple
) -> tuple[Optional[Tensor], ...]:
    (pre,) = saved
    need_x, need_w_in, need_w_up, need_b_in, need_b_up, need_w_out, need_b_out = needs
    dtype, math = b.x.dtype, compute_dtype(b.x.dtype)
    g = drop(grad_y.to(math), b.p_out, rngs[1]).to(dtype) if b.p_out > 0 else grad_y  # (M, H_out)
    grad_b_out = g.sum(0, dtype=math).to(dtype) if need_b_out and b.b_out is not None else None
    keep = _keep(rngs[0], b.p, pre.shape[0], b.w_out.shape[1], pre.device)  # regenerated once for both uses
    grad_w_out = g.t() @ _hidden(pre, b, keep) if need_w_out else None  # (H_out, F)
    if not (need_x or need_w_in or need_w_up or need_b_in or need_b_up):
        return None, None, None, None, None, grad_w_out, grad_b_out
    grad_a = drop((g @ b.w_out).to(math), b.p, None, keep)  # (M, F)
    grad_pre = _grad_pre(grad_a, pre.to(math), b.activation)  # (M, F) or (M, 2F), float32
    sums = grad_pre.sum(0)
    grad_pre = grad_pre.to(dtype)
    if b.w_up is None:
        grad_x = grad_pre @ b.w_in if need_x else None
        grad_w_in, grad_w_up = (grad_pre.t() @ b.x if need_w_in else None), None
        grad_b_in, grad_b_up = (sums.to(dtype) if need_b_in and b.b_in is not None else None), None
    else:  # a (gate, up) pair: the stacked gradient's halves
        f = b.w_in.shape[0]
        g_gate, g_up = grad_pre[:, :f], grad_pre[:, f:]
        grad_x = (g_gate @ b.w_in + g_up @ b.w_up) if need_x else None
        grad_w_in = g_gate.t() @ b.x if need_w_in else None
        grad_w_up = g_up.t() @ b.x if need_w_up else None
        grad_b_in = sums[:f].to(dtype) if need_b_in and b.b_in is not None else None
        grad_b_up = sums[f:].to(dtype) if need_b_up and b.b_up is not None else None
    return grad_x, grad_w_in, grad_w_up, grad_b_in, grad_b_up, grad_w_out, grad_b_out


KERNELS = Kernels(forward=forward, backward=backward, inference=inference)
