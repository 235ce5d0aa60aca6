"""fused_linear: Activation(x @ W^T + b), the op's one room.

In order: the call object and its checks, the kernels' signatures, the reference and baseline math,
how its kernels take a call (``dispatch.contracts.running`` runs it: inference, torch's autograd, or
one autograd node), the torch.library custom op a compiled graph keeps, the spec with its calibration
inputs, and the public function.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch import ops
from dispatch.contracts import checks, running
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS
from dispatch.contracts.backend import Call, Kernels, composite_kernels, new_call
from dispatch.contracts.op import Case, Grid, Inputs, OpCall, OpSpec, compute_dtype

NAME = "fused_linear"
TRAITS = ("activation",)  # a call's, past its sizes and dtype: what decisions key on
_grad_enabled = torch.is_grad_enabled


class FusedLinearCall(OpCall):
    __slots__ = ("x", "weight", "bias", "activation", "flat")

    def __init__(self, call: Call, x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                 flat: bool) -> None:  # fmt: skip
        self.call = call
        self.special = False
        self.flat = flat  # x is (M, K) itself: kernels take it as it is
        self.x = x  # the caller's x, (..., K)
        self.weight = weight  # (N, K)
        self.bias = bias  # (N,) contiguous, or None
        self.activation = activation

    def out_shape(self) -> tuple[int, ...]:
        """(..., N): made only for an x that is not (M, K), whose rows' output is viewed back."""
        return (*self.x.shape[:-1], self.call.shape[1])


def parse(x: object, weight: object, bias: object = None, activation: object = "identity") -> FusedLinearCall:
    """The checked call; the errors name the first bad argument in argument order."""
    x, weight, bias, activation, shape, device, dtype, flat = checks.fused_linear_args(
        x, weight, bias, activation
    )
    grad = _grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    call = new_call((NAME, device, dtype, shape, grad, TRAITS, (activation,)))
    return FusedLinearCall(call, x, weight, bias, activation, flat)


def rows(c: FusedLinearCall) -> Tensor:
    """x as (M, K): a view where strides allow."""
    return c.x if c.flat else c.x.reshape(c.call.shape[0], c.call.shape[2])


# A backend's ``Kernels`` (dispatch.contracts.backend) for this op. x (M, K) and weight (N, K) any
# strides, bias (N,) contiguous or None; y a contiguous (M, N) tensor. ``saved`` is what backward
# needs beyond the inputs (the pre-activation x @ W^T + b in x's dtype, or for relu y itself, as
# torch.relu keeps it; None for identity); the two halves of a call always run on one backend.
#   forward(x, weight, bias, activation) -> (y, saved)      a call with autograd
#   inference(x, weight, bias, activation) -> y              a call without
#   backward(grad_y, x, weight, bias, saved, activation, (need_x, need_w, need_b)) -> (gx, gw, gb)
# backward is asked for at least one gradient, never for an absent bias's.
Needs = tuple[bool, bool, bool]
Grads = tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]


def inference_of(forward: Callable[..., tuple[Tensor, Any]]) -> Callable[..., Tensor]:
    """A kernels' inference that is its forward's y."""

    def inference(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
        return forward(x, weight, bias, activation)[0]

    return inference


def reference(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, upcast: bool = False
) -> Tensor:
    """The definition, differentiable, on (..., K) inputs; float64 when ``upcast``, else x's dtype."""
    dtype = torch.float64 if upcast else x.dtype
    b = None if bias is None else bias.to(dtype)
    return ACTIVATIONS[activation].forward(F.linear(x.to(dtype), weight.to(dtype), b))


def baseline(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    """What a user writes, ``act(F.linear(x, w, b))``, in x's dtype; what torch.compile traces."""
    return ACTIVATIONS[activation].forward(F.linear(x, weight, bias))


def backward_from_pre(
    grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], pre: Optional[Tensor], activation: str,
    needs: tuple[bool, bool, bool],
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """Every backend's backward over PyTorch kernels: grad_pre = grad_y * act'(pre) (PyTorch's backward
    kernel where it has one, else the table's derivative in float32), then grad_x = grad_pre W,
    grad_W = grad_pre^T x, grad_b its column sums. ``pre`` None: recomputed (one more GEMM)."""
    from dispatch.contracts.activations import composed_backward

    act = ACTIVATIONS[activation]
    if activation == "identity":
        grad_pre = grad_y
    else:
        pre = pre if pre is not None else F.linear(x, weight, bias)
        if act.backward is not None:
            grad_pre = act.backward(grad_y, pre)
        else:
            dtype = compute_dtype(x.dtype)
            grad_pre = composed_backward(act, grad_y.to(dtype), pre.to(dtype)).to(x.dtype)
    grad_x = grad_pre @ weight if needs[0] else None  # (M, K)
    grad_w = grad_pre.t() @ x if needs[1] else None  # (N, K)
    grad_b = None
    if needs[2] and bias is not None:
        grad_b = grad_pre.sum(0, dtype=compute_dtype(x.dtype)).to(bias.dtype)
    return grad_x, grad_w, grad_b


def _baseline_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str
) -> tuple[Tensor, None]:
    return baseline(x, weight, bias, activation), None


def _baseline_backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                       saved: Optional[Tensor], activation: str, needs: Needs) -> Grads:  # fmt: skip
    return backward_from_pre(grad_y, x, weight, bias, None, activation, needs)


BASELINE_KERNELS = composite_kernels(_baseline_forward, _baseline_backward, baseline, any_shape=True)


# ----------------------------------------------------------------------------- running on kernels

# The kernels' arguments are the tensors (x, weight, bias), then the setting (activation); forward
# returns (y, saved), saved one tensor or None.
CALLING = running.Calling(
    tensors=3,
    backward=lambda kernels, grad_y, tensors, saved, settings, needs: kernels.backward(
        grad_y, *tensors, saved[0], *settings, needs
    ),
    differentiable=lambda tensors, settings: reference(*tensors, *settings),
)


def _bind(run: Callable[..., Tensor], kernels: Kernels, draws: bool) -> Callable[[FusedLinearCall], Tensor]:
    """One call on ``run``: x as rows unless the kernels take any shape."""
    if kernels.any_shape:

        def shaped(c: FusedLinearCall) -> Tensor:
            return run(c.x, c.weight, c.bias, c.activation)

        return shaped

    def plain(c: FusedLinearCall) -> Tensor:
        if c.flat:
            return run(c.x, c.weight, c.bias, c.activation)
        return run(rows(c), c.weight, c.bias, c.activation).view(c.out_shape())

    return plain


def runner(kernels: Kernels, call: Call) -> Callable[[FusedLinearCall], Tensor]:
    """How calls like ``call`` run on ``kernels`` (``running.runner``). The baseline runs as a user
    writes it, its activation looked up once: no frames between the call and torch's ops (training
    calls of 50 us spent 1.2x the composite's wall time through the generic path on a CPU)."""
    if kernels is BASELINE_KERNELS:
        act, linear = ACTIVATIONS[call.activation].forward, F.linear

        def composite(c: FusedLinearCall) -> Tensor:
            return act(linear(c.x, c.weight, c.bias))

        return composite
    return running.runner(CALLING, kernels, call, _bind)


# ----------------------------------------------------------------------------- torch.compile

_EMPTY = (0,)


def _kernels(x: Tensor, weight: Tensor, activation: str, training: bool, backend: str) -> Kernels:
    shape = (x.shape[0], weight.shape[0], x.shape[1])
    call = Call(NAME, x.device, x.dtype, shape, training, TRAITS, (activation,))
    return ops.dispatcher().kernels(call, backend or None)


def _fake(x, weight, bias, activation, backend, training):
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(_EMPTY if activation == "identity" or not training else shape)


def _backward(grad_y: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
              backend: str, saved: Tensor, needs: list[bool]) -> list[Tensor]:  # fmt: skip
    kept = None if saved.numel() == 0 and activation == "identity" else saved
    grads = _kernels(x, weight, activation, True, backend).backward(
        grad_y, x, weight, bias, kept, activation, tuple(needs)
    )
    return [x.new_empty(_EMPTY) if g is None else g for g in grads]


@running.custom_op(NAME, _fake, _backward, tensors=3)
def _custom(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str,
            training: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(y, saved): the pre-activation kept for backward ((M, N), as the fake promises; empty for
    identity or without autograd)."""
    kernels = _kernels(x, weight, activation, training, backend)
    if not training:
        return kernels.inference(x, weight, bias, activation), x.new_empty(_EMPTY)
    y, saved = kernels.forward(x, weight, bias, activation)
    if saved is None and activation != "identity":
        saved = F.linear(x, weight, bias)
    return y, x.new_empty(_EMPTY) if saved is None else saved


# ----------------------------------------------------------------------------- the spec


class FusedLinearSpec(OpSpec):
    name = NAME
    public_name = "fused_linear"
    dims = ("M", "N", "K")
    traits = TRAITS
    entry_extras = ("dropout",)  # false in every entry: tables held it before ops declared traits
    activations = ACTIVATION_NAMES
    grid = Grid(
        features=(
            (3072, 768),  # GPT-2 / BERT / ViT-B up
            (11008, 4096),  # LLaMA-2-7B up
            (768, 3072),  # GPT-2 / BERT / ViT-B down
            (4096, 14336),  # LLaMA-3-8B / Mistral-7B down
            (28672, 8192),  # LLaMA-2/3-70B up
            (1536, 384),  # MiniLM / DeiT-S up
            (512, 2048),  # T5-small down: the one N below 768
            (1024, 1024),  # N <= 1536 with K 576-2048: triton's GPU time won by 8-29% there off the grid
            (16384, 1024),  # wide, shallow: relu inference off the grid went to eager, cuBLASLt 24-32% faster
        ),
        quick={"cuda": ((3072, 768), (11008, 4096)), "cpu": ((3072, 768), (768, 3072))},
        # relu is a class of its own: triton and cublaslt keep its output and run it in cuBLASLt's
        # epilogue (234 vs 256 us keeping the pre-activation)
        classes=(("identity",), ("gelu_tanh", "gelu", "silu", "leaky_relu", "squared_relu"), ("relu",)),
        gemm=True,
        check_work=2**34,
        families=(("training", False), ("inference", False)),
        # the interpreter took ~3 s a call at 37x65x48 (forward + backward) on 2 cores
        parity={
            "cpu": ((5, 17, 9), (1, 7, 3), (37, 65, 48)),
            "cuda": ((1823, 781, 129), (1, 7, 3), (37, 300, 200), (2048, 4096, 1024)),
        },
        outputs=("y", "grad_x", "grad_w", "grad_bias"),
    )

    def parse(self, *args: Any, **kwargs: Any) -> FusedLinearCall:
        return parse(*args, **kwargs)

    def runner(self, kernels: Any, call: Call) -> Callable[[OpCall], Tensor]:
        return runner(kernels, call)  # type: ignore[return-value]

    def traced(self, c: OpCall, backend: Optional[str], inline: bool) -> Tensor:
        """Inline: ``nn.Linear`` + activation as a model writes them, which inductor fuses as for
        nn.Linear; otherwise one custom op."""
        assert isinstance(c, FusedLinearCall)
        if inline:
            return baseline(c.x, c.weight, c.bias, c.activation)
        return _custom(rows(c), c.weight, c.bias, c.activation, backend or "", c.call.training)[0].view(
            c.out_shape()
        )

    def baseline_kernels(self) -> Kernels:
        return BASELINE_KERNELS

    def inputs(self, case: Case, seed: int) -> Inputs:
        g = torch.Generator(device=case.device).manual_seed(seed)
        n, k = case.features

        def randn(*shape: int, scale: float = 1.0) -> Tensor:
            return (torch.randn(*shape, device=case.device, generator=g) * scale).to(case.dtype)

        weight = randn(n, k, scale=1.0 / math.sqrt(k))
        return Inputs([randn(case.m, k), weight, randn(n, scale=0.5)], randn(case.m, n), seed)

    def run_case(self, case: Case, leaves: Sequence[Tensor], backend: Optional[str], seed: int) -> Tensor:
        x, w, b = leaves
        if backend is None:
            return baseline(x, w, b, case.activation)
        return fused_linear(x, w, b, case.activation, backend=backend)

    def reference_case(self, case: Case, leaves: Sequence[Tensor], seed: int,
                       torch_masks: bool = False) -> Tensor:  # fmt: skip
        x, w, b = leaves
        return reference(x, w, b, case.activation, upcast=True)


SPEC = ops.register(FusedLinearSpec())


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
    backward with ``create_graph=True`` differentiates the reference, so its gradients carry their own
    graph whatever the backend.

    Equivalent PyTorch::

        act(F.linear(x, weight, bias))
    """
    return ops.dispatcher().run(SPEC, parse(x, weight, bias, activation), backend)
