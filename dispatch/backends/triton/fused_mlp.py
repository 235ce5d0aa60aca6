"""Triton fused_mlp: Dropout_out(Dropout_p(act(x @ W_in^T + b_in)) @ W_out^T + b_out) (``KERNELS``),
the products on cuBLAS (``torch.addmm`` / ``torch.mm``, as fused_linear's training path) and the
pointwise work in one Triton pass each. Backward regenerates both masks from their rngs and the hidden
activation from pre: a forward keeps only pre, (M, F), or (M, 2F) [gate | up] for a gate.

    forward   pre = x @ W_in^T + b_in                         cuBLAS, bias in the product (a pair: two
                                                                products into pre's halves)
              a = drop_p(act(pre))                            one pass (mlp_hidden.py): read pre, write a
              y = a @ W_out^T + b_out                         cuBLAS
              y = drop_out(y)                                 one pass (bias_act_dropout's, identity)
    backward  g = drop_out'(grad_y), grad_b_out = sums(g)     one pass (bias_act_dropout's, identity)
              grad_a = g @ W_out                              cuBLAS
              grad_pre = drop_p'(grad_a) * act'(pre), a,      one pass (mlp_hidden.py): the hidden mask drawn
                grad_b_in = sums(grad_pre)                      once, float32 partial sums
              grad_W_out = g^T a                              cuBLAS
              grad_W_in = grad_pre^T x, grad_x = grad_pre W_in  cuBLAS (a pair: each half)
A forward keeps half the bytes the PyTorch module keeps for backward (48 vs 96 MiB at GPT-2's block,
8192 tokens, bf16).
The bias stays inside the first product, rounded with it once: a bias added after rounding x @ W^T
flips relu-like masks where |x @ W^T| >> |x @ W^T + b| (fused_linear.py's forward).

Variant "keep" (``options``) is "passes" whose forward keeps a, (M, F), beside pre: backward's pass
then writes grad_pre alone (one M x F write less: 50 MB at GPT-2's block, 8192 tokens, bf16, ~15 us
at 3.35 TB/s) for the bytes PyTorch's module keeps (96 vs 48 MiB there). Under torch.compile the
custom op keeps pre alone, and backward forms a again.

Variant "epilogues" (``options``; mlp_gemm.py) runs the products that carry pointwise work on Triton
with that work in their epilogues: pre and a from the first product (a gate's two halves from one
pass over x), y's bias and output dropout from the second, and grad_pre, a and the bias partials
from g @ W_out; the other products stay on cuBLAS. It ran 1.11-1.47x the time of "passes" (bf16
training steps of bench_mlp's six blocks), so "passes" is the default (but for "cublaslt"'s calls).

Variant "cublaslt", the default where it applies (gelu_tanh, no hidden dropout, one weight with a bias,
CUDA, float16/bfloat16, nvmath-python installed; else "passes"), runs the first product with cuBLASLt's
GELU_AUX_BIAS epilogue (``gelu_aux.py``): a and pre from the product, no forward pass, both kept
(the module's bytes) so backward is "keep"'s. GPT-2's block at 8192 tokens, bf16 training, H100: 439 us
against 473 for "passes", 464 for "keep" and 460 for torch.compile.

relu (no hidden dropout, one weight) and, without autograd on CUDA, gelu_tanh run in cuBLASLt's
epilogue of the first product (``torch._addmm_activation``): a is written by the product and the
forward pass goes (GPT-2's up projection forward at 8192 tokens, bf16, H200: 71 us against 96 for
addmm and the pass). relu's backward reads a for pre, kept once; gelu_tanh's needs pre, which the
epilogue does not return.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from dispatch.backends.triton import bias_act_dropout, fused_linear, gelu_aux, mlp_gemm, mlp_hidden
from dispatch.contracts.activations import GATES
from dispatch.contracts.backend import Call, Kernels
from dispatch.ops.fused_mlp_math import MLPOperands, gate_halves

VARIANTS = ("passes", "keep", "epilogues", "cublaslt")
# "cublaslt" where it applies, else "passes": "epilogues" ran 1.11-1.47x its time, "keep" holds
# twice its bytes
DEFAULT_VARIANT = "cublaslt"
_chosen: list[Optional[str]] = [None]


@contextlib.contextmanager
def options(variant: Optional[str] = None) -> Iterator[None]:
    """Forces a variant inside the block (benchmarks, tests)."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    saved, _chosen[0] = _chosen[0], variant
    try:
        yield
    finally:
        _chosen[0] = saved


def _current() -> str:
    """The variant in force: the one ``options`` forces, else the default."""
    return _chosen[0] or DEFAULT_VARIANT


def _variant(b: MLPOperands) -> bool:
    """Whether this call's products run with the epilogues: asked for, and operands they serve (no
    empty dims, a pair's weights of one layout; the spec's biases are contiguous); "passes" otherwise.
    ``options`` is process-wide (benchmarks, tests): a forward and its backward may run different
    variants, which give the same gradients."""
    if _current() != "epilogues":
        return False
    return min(*b.x.shape, *b.w_out.shape) > 0 and (b.w_up is None or b.w_up.stride() == b.w_in.stride())


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """x @ W^T + b on cuBLAS, into ``out`` if given (a view with unit column stride: written in place)."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _project_in(b: MLPOperands) -> Tensor:
    """pre = x @ W_in^T + b_in: (M, F), or (M, 2F) [gate | up] for a gate. A (gate, up) pair takes two
    products written into pre's halves, so the weights are never concatenated (copied) per call."""
    if b.w_up is None:
        return _linear(b.x, b.w_in, b.b_in)
    f = b.w_in.shape[0]
    pre = b.x.new_empty((b.x.shape[0], 2 * f))
    _linear(b.x, b.w_in, b.b_in, out=pre[:, :f])
    _linear(b.x, b.w_up, b.b_up, out=pre[:, f:])
    return pre


def _in_product(b: MLPOperands, training: bool) -> bool:
    """Whether the first product runs the activation in cuBLASLt's epilogue (``torch._addmm_activation``)
    and writes a itself, with no pass: relu, and gelu_tanh without autograd on CUDA (on the CPU the op's
    GELU is erf's); one weight, no hidden dropout. gelu_tanh's backward needs pre, which the epilogue
    does not return; relu's needs only where a > 0, where pre > 0."""
    if b.activation not in ("relu", "gelu_tanh") or b.p > 0 or b.w_up is not None:
        return False
    return b.activation == "relu" or not (training or b.b_in is None or not b.x.is_cuda)


def _gelu_aux(b: MLPOperands) -> Optional[tuple[Tensor, Tensor]]:
    """(a, pre) from the first product with cuBLASLt's GELU_AUX_BIAS epilogue, or None: variant
    "cublaslt" (the default), gelu_tanh, no hidden dropout, one weight with a bias, operands it takes."""
    if _current() != "cublaslt" or b.activation != "gelu_tanh" or b.p > 0:
        return None
    if b.w_up is not None or b.b_in is None:
        return None
    return gelu_aux.gelu_aux_bias(b.x, b.w_in, b.b_in)


def _activated(b: MLPOperands) -> Tensor:
    """a = act(x @ W_in^T + b_in) from one product, the activation in its epilogue (M, F, H > 1; else
    PyTorch runs the unfused GEMM and activation, the same function)."""
    if b.activation == "relu":  # fused_linear's relu forward: its y is a
        return fused_linear.forward(b.x, b.w_in, b.b_in, "relu")[0]
    return torch._addmm_activation(b.b_in, b.x, b.w_in.t(), use_gelu=True)


def _project_out(a: Tensor, b: MLPOperands, rngs: tuple) -> Tensor:
    y = _linear(a, b.w_out, b.b_out)  # (M, H_out)
    if b.p_out > 0:
        y = bias_act_dropout.KERNELS.forward(y, None, "identity", b.p_out, rngs[1])
    return y


def forward(b: MLPOperands, rngs: tuple) -> tuple[Tensor, tuple[Tensor, ...]]:
    if _variant(b):
        return _forward_epilogues(b, rngs, keep_pre=True)
    if _in_product(b, training=True):  # relu: a stands for pre (relu'(pre) = relu'(a)) and is kept
        a = _activated(b)
        return _project_out(a, b, rngs), (a, a)
    product = _gelu_aux(b)
    if product is not None:  # a and pre from the product, both kept: backward is "keep"'s
        a, pre = product
        return _project_out(a, b, rngs), (pre, a)
    return _forward_passes(b, rngs)


def _forward_passes(b: MLPOperands, rngs: tuple) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The products on cuBLAS, the hidden layer in one pass between them."""
    pre = _project_in(b)  # (M, F) or (M, 2F)
    a = mlp_hidden.forward(pre, b.activation, b.p, rngs[0] if b.p > 0 else None)  # (M, F)
    return _project_out(a, b, rngs), ((pre, a) if _chosen[0] == "keep" else (pre,))


def _forward_epilogues(b: MLPOperands, rngs: tuple, keep_pre: bool) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The products on Triton with the hidden layer's work (and the output dropout) in their epilogues."""
    w, w_up, bias, bias_up = gate_halves(b)
    m, f = b.x.shape[0], w.shape[0]
    pre = b.x.new_empty((m, 2 * f if w_up is not None else f)) if keep_pre else None
    a = b.x.new_empty((m, f))
    act = GATES.get(b.activation, b.activation)
    mlp_gemm.up(b.x, w, w_up, bias, bias_up, act, b.p, rngs[0] if b.p > 0 else None, a, pre)
    if b.p_out > 0:
        y = b.x.new_empty((m, b.w_out.shape[0]))
        mlp_gemm.up(a, b.w_out, None, b.b_out, None, "identity", b.p_out, rngs[1], y)
    else:
        y = _linear(a, b.w_out, b.b_out)
    return y, (() if pre is None else (pre,))


def inference(b: MLPOperands, rngs: tuple) -> Tensor:
    if _variant(b):
        return _forward_epilogues(b, rngs, keep_pre=False)[0]
    if _in_product(b, training=False):
        return _project_out(_activated(b), b, rngs)
    return _forward_passes(b, rngs)[0]


def backward(
    grad_y: Tensor, b: MLPOperands, rngs: tuple, saved: tuple, needs: tuple
) -> tuple[Optional[Tensor], ...]:
    pre, kept = saved[0], saved[1] if len(saved) > 1 else None  # kept: a, by the "keep" variant
    need_x, need_w_in, need_w_up, need_b_in, need_b_up, need_w_out, need_b_out = needs
    need_b_out = need_b_out and b.b_out is not None
    need_pre = need_x or need_w_in or need_w_up
    need_b = (need_b_in or need_b_up) and b.b_in is not None
    g, grad_b_out = grad_y, None  # (M, H_out)
    if b.p_out > 0 or need_b_out:  # g = grad_y * keep * scale and its column sums, one pass
        rng_out = rngs[1] if b.p_out > 0 else None
        dropped, grad_b_out = bias_act_dropout.backward_pass(
            grad_y, grad_y, None, "identity", b.p_out, rng_out, rng_out is not None, need_b_out
        )
        g = grad_y if dropped is None else dropped
    rng = rngs[0] if b.p > 0 else None
    grad_pre = a = grad_b = None
    if (need_pre or need_b) and _variant(b):  # g @ W_out with the pass in its epilogue
        gated = b.activation in GATES
        act = GATES.get(b.activation, b.activation)
        grad_pre, a, grad_b = mlp_gemm.grad_hidden(
            g, b.w_out, pre, act, gated, b.p, rng, need_pre, need_w_out, need_b
        )
    elif need_pre or need_b:
        grad_a = torch.mm(g, b.w_out)  # (M, F)
        grad_pre, a, grad_b = mlp_hidden.backward(
            grad_a, pre, b.activation, b.p, rng, need_pre, need_w_out and kept is None, need_b
        )
    elif need_w_out and kept is None:
        a = mlp_hidden.forward(pre, b.activation, b.p, rng)
    a = kept if kept is not None else a
    grad_w_out = torch.mm(g.t(), a) if need_w_out else None  # (H_out, F)
    if b.w_up is None:
        grad_x = torch.mm(grad_pre, b.w_in) if need_x else None  # (M, H)
        grad_w_in = torch.mm(grad_pre.t(), b.x) if need_w_in else None  # (F or 2F, H)
        grad_b_in = grad_b if need_b_in else None
        return grad_x, grad_w_in, None, grad_b_in, None, grad_w_out, grad_b_out
    f = b.w_in.shape[0]  # a (gate, up) pair: grad_pre's halves, column slices (no copies)
    g_gate, g_up = (None, None) if grad_pre is None else (grad_pre[:, :f], grad_pre[:, f:])
    grad_x = torch.mm(g_gate, b.w_in).addmm_(g_up, b.w_up) if need_x else None
    grad_w_in = torch.mm(g_gate.t(), b.x) if need_w_in else None
    grad_w_up = torch.mm(g_up.t(), b.x) if need_w_up else None
    grad_b_in = grad_b[:f] if need_b and need_b_in else None
    grad_b_up = grad_b[f:] if need_b and need_b_up else None
    return grad_x, grad_w_in, grad_w_up, grad_b_in, grad_b_up, grad_w_out, grad_b_out


def prepare(call: Call) -> None:
    """Plans gelu_tanh's cuBLASLt product for a training call of this kind (M, H, F) where the
    dispatcher runs triton under CUDA-graph capture alone: a benchmark's eager warm-up then runs plain
    PyTorch, and the capture's first call could not plan it (the passes would run: GPT-2's block 464
    against 442-455 us, H100)."""
    if call.activation == "gelu_tanh" and call.training and _current() == "cublaslt":
        gelu_aux.prepare(*call.shape, call.dtype, call.device)


KERNELS = Kernels(forward=forward, backward=backward, inference=inference, prepare=prepare)
