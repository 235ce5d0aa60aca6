"""add_norm: a residual add fused with the norm after it, h = x + residual, y = norm(h) * (weight +
offset) (+ bias), returning (y, h): y feeds the next sublayer, h is the new residual stream. The op's
one room: the call object and its checks, how its kernels take a call (``dispatch.contracts.running``
runs it: inference, torch's autograd, or one autograd node), the custom op a compiled graph keeps, the
spec with its calibration inputs, and the two public functions. Its math (the kernels' signatures, the
float64-capable reference, the baseline) is ``add_norm_math.py``.

Design:
- One op, two public functions. ``fused_add_rms_norm`` (LLaMA's RMSNorm) and ``fused_add_layer_norm``
  (with a bias) share the kernels, the saved statistics and the backward, and differ by one trait,
  ``norm`` ("rms" or "layer"): a call, explain() and a table entry carry it, and the calibrator runs
  its series over it (``OpSpec.variant``), as over the other ops' activations.
- Two outputs: the op returns (y, h) through the shared runner and autograd node (``Calling.outputs``);
  either may carry a gradient, an unused one costs nothing in backward. The node keeps h, weight, bias
  and the kernels' row statistics, never x and residual (``Calling.kept``): a backward building a graph
  runs the reference's backward on that h, differentiable again.
- ``residual=None``: h is x itself (a plain RMSNorm / LayerNorm). ``offset``: the norm multiplies by
  (weight + offset), Gemma's (1 + w) at ``offset=1.0``, as its RMSNorm computes it (float32, one cast).
- The baseline, what the pytorch backend runs and the table measures against, is the composite a model
  writes: x + residual, then Hugging Face's LlamaRMSNorm (or GemmaRMSNorm with an offset) in torch ops,
  or ``F.layer_norm``. Bias presence, a residual's presence and the offset key nothing: the cost is
  the same rows read and written.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from dispatch import ops
from dispatch.contracts import checks, running
from dispatch.contracts.backend import Call, Kernels, new_call
from dispatch.contracts.op import Case, Grid, Inputs, OpCall, OpSpec
from dispatch.ops.add_norm_math import BASELINE_KERNELS, NORMS, REFERENCE_KERNELS, baseline, reference

__all__ = ["NORMS", "AddNormCall", "baseline", "fused_add_layer_norm", "fused_add_rms_norm", "reference"]

NAME = "add_norm"
TRAITS = ("norm",)  # a call's, past its sizes and dtype: what decisions key on
EPS = {"rms": 1e-6, "layer": 1e-5}  # the defaults: LLaMA's RMSNorm, nn.LayerNorm
_grad_enabled = torch.is_grad_enabled


class AddNormCall(OpCall):
    __slots__ = ("x", "residual", "weight", "bias", "eps", "norm", "offset", "shape", "flat")

    def __init__(self, call: Call, x: Tensor, residual: Optional[Tensor], weight: Tensor,
                 bias: Optional[Tensor], eps: float, norm: str, offset: float) -> None:  # fmt: skip
        super().__init__(call)
        self.x, self.residual, self.weight, self.bias = x, residual, weight, bias  # x, residual (..., N)
        self.eps, self.norm, self.offset = eps, norm, offset
        self.shape = x.shape  # the caller's, y's and h's
        self.flat = len(x.shape) == 2  # x is (M, N) itself: kernels take it as it is


def _number(name: str, value: object, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise ValueError(f"{name} must be a real number, got {value!r} ({checks.type_name(value)})")
    if positive and not value > 0:
        raise ValueError(f"{name} must be a number above 0, got {value!r}")
    return float(value)


def parse(x: object, residual: object, weight: object, bias: object, eps: object, norm: str,
          offset: object = 0.0) -> AddNormCall:  # fmt: skip
    """The checked call of either public function; the errors name the first bad argument."""
    x = checks.check_tensor("x", x)
    m, n = checks.rows_of(x.shape)
    device, dtype = x.device, x.dtype
    if residual is not None:
        residual = checks.check_like("residual", residual, dtype, device)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    weight = checks.check_like("weight", weight, dtype, device)
    if weight.shape != (n,):
        raise ValueError(f"weight must have shape ({n},) to match x's last dim, got {tuple(weight.shape)}")
    bias = checks.check_bias("bias", bias, n, dtype, device)
    eps, offset = _number("eps", eps, positive=True), _number("offset", offset)
    grad = _grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight, bias))
    call = new_call((NAME, device, dtype, (m, n), grad, TRAITS, (norm,)))
    return AddNormCall(call, x, residual, weight, bias, eps, norm, offset)


def module_call(x: Tensor, norm: str, grad: bool) -> Call:
    """The decision key ``parse`` would make for a norm module's call on x (..., N) whose parameters are
    known to fit it (``dispatch.nn.FusedRMSNorm``'s, ``FusedLayerNorm``'s): the key alone, unchecked."""
    m, n = checks.rows_of(x.shape)
    return new_call((NAME, x.device, x.dtype, (m, n), grad, TRAITS, (norm,)))


# ----------------------------------------------------------------------------- running on kernels

# The kernels' arguments are the tensors (x, residual, weight, bias), then the settings (eps, norm,
# offset); forward returns (y, h, rstd, mean), of which the node keeps h and the statistics.
def _forward(kernels: Kernels, args: tuple) -> tuple:
    y, h, rstd, mean = kernels.forward(*args)
    return y, h, h, rstd, mean  # the outputs, then what backward reads: h again, the statistics


def _backward(kernels: Kernels, grads: tuple, tensors: tuple, saved: tuple, settings: tuple,
              needs: tuple) -> tuple:  # fmt: skip
    """The kernels' backward, its gradient of h given to x and residual both."""
    (dy, dh), (h, rstd, mean), (need_x, need_r, need_w, need_b) = grads, saved, needs
    dh_in, dw, db = kernels.backward(
        dy, dh, h, rstd, mean, tensors[2], tensors[3], *settings, (need_x or need_r, need_w, need_b)
    )
    return (dh_in if need_x else None), (dh_in if need_r else None), dw, db


def _graph_backward(grads: tuple, tensors: tuple, saved: tuple, settings: tuple, needs: tuple) -> tuple:
    """A backward building a graph: the reference's, in torch ops on the h the node kept (an output of
    the node, so the graph reaches x and residual through it)."""
    return _backward(REFERENCE_KERNELS, grads, tensors, (saved[0], None, None), settings, needs)


CALLING = running.Calling(
    tensors=4, backward=_backward, forward=_forward, outputs=2, kept=(False, False, True, True),
    differentiable_backward=_graph_backward,
)  # fmt: skip


def _bind(run: Callable[..., Any], kernels: Kernels, draws: bool) -> Callable[[AddNormCall], Any]:
    """One call on ``run``: x and residual as rows unless the kernels take any shape."""
    if kernels.any_shape:
        return lambda c: run(c.x, c.residual, c.weight, c.bias, c.eps, c.norm, c.offset)

    def rows(c: AddNormCall) -> tuple[Tensor, Tensor]:
        if c.flat:
            return run(c.x, c.residual, c.weight, c.bias, c.eps, c.norm, c.offset)
        mn = c.call.shape
        r = None if c.residual is None else c.residual.reshape(mn)
        y, h = run(c.x.reshape(mn), r, c.weight, c.bias, c.eps, c.norm, c.offset)
        return y.view(c.shape), h.reshape(c.shape)

    return rows


# ----------------------------------------------------------------------------- torch.compile

_EMPTY = (0,)


def _kernels(x: Tensor, norm: str, training: bool, backend: str) -> Kernels:
    call = Call(NAME, x.device, x.dtype, tuple(x.shape), training, TRAITS, (norm,))
    return ops.dispatcher().kernels(call, backend or None)


def _fake(x, residual, weight, bias, eps, norm, offset, backend, training):
    return x.new_empty(x.shape), x.new_empty(_EMPTY if residual is None else x.shape)


def _custom_backward(grad_y: Tensor, grad_h: Tensor, x: Tensor, residual: Optional[Tensor], weight: Tensor,
                     bias: Optional[Tensor], eps: float, norm: str, offset: float, backend: str, h: Tensor,
                     needs: list[bool]) -> list[Tensor]:  # fmt: skip
    """The graph keeps h alone (the statistics are recomputed from it): without a residual, h is x."""
    kernels = _kernels(x, norm, True, backend)
    h, dh = (x, None) if residual is None else (h, grad_h)
    tensors, settings = (x, residual, weight, bias), (eps, norm, offset)
    gx, gr, gw, gb = _backward(kernels, (grad_y, dh), tensors, (h, None, None), settings, tuple(needs))
    gr = gr.clone() if gx is not None and gr is not None else gr  # outputs alias no other: x's is residual's
    return [x.new_empty(_EMPTY) if g is None else g for g in (gx, gr, gw, gb)]


@running.custom_op(NAME, _fake, _custom_backward, tensors=4, outputs=2)
def _custom(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], eps: float,
            norm: str, offset: float, backend: str, training: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(y, h), h empty without a residual (it is x, which an output may not alias)."""
    y, h = _kernels(x, norm, training, backend).inference(x, residual, weight, bias, eps, norm, offset)
    return y, x.new_empty(_EMPTY) if residual is None else h


# ----------------------------------------------------------------------------- the spec


class AddNormSpec(OpSpec):
    name = NAME
    public_name = "fused_add_rms_norm"
    public_names = ("fused_add_rms_norm", "fused_add_layer_norm")  # norm "rms", norm "layer"
    dims = ("M", "N")
    traits = TRAITS
    grid = Grid(
        # hidden widths: LLaMA-2-7B, Qwen2-0.5B, Qwen2-1.5B, Gemma-2B, Gemma-7B
        features=((4096,), (896,), (1536,), (2048,), (3072,)),
        quick={"cuda": ((4096,), (896,)), "cpu": ((896,), (4096,))},
        classes=(("rms",), ("layer",)),  # LayerNorm reads the bias and computes a mean more
        gemm=False,
        check_work=2**24,
        families=(("training", False), ("inference", False)),
        parity={"cpu": ((5, 33), (1, 7), (37, 130)), "cuda": ((1823, 781), (1, 7), (37, 1000), (4096, 4096))},
        outputs=("y", "h", "grad_x", "grad_residual", "grad_weight", "grad_bias"),
    )

    def variants(self) -> tuple[str, ...]:
        return NORMS

    def parse(self, *args: Any, **kwargs: Any) -> AddNormCall:
        return self.parse_for(self.public_name, *args, **kwargs)

    def parse_for(self, public_name: str, *args: Any, **kwargs: Any) -> AddNormCall:
        return _PARSERS[public_name](*args, **kwargs)

    def runner(self, kernels: Any, call: Call) -> Callable[[OpCall], Any]:
        return running.runner(CALLING, kernels, call, _bind)  # type: ignore[return-value]

    def traced(self, c: OpCall, backend: Optional[str], inline: bool) -> Any:
        """Inline: the baseline, which inductor fuses with its neighbours; otherwise one custom op."""
        assert isinstance(c, AddNormCall)
        if inline:
            return baseline(c.x, c.residual, c.weight, c.bias, c.eps, c.norm, c.offset)
        mn, r = c.call.shape, None if c.residual is None else c.residual.reshape(c.call.shape)
        args = (c.weight, c.bias, c.eps, c.norm, c.offset, backend or "", c.call.training)
        y, h = _custom(c.x.reshape(mn), r, *args)
        return y.view(c.shape), c.x if c.residual is None else h.view(c.shape)

    def baseline_kernels(self) -> Kernels:
        return BASELINE_KERNELS

    def reference_kernels(self) -> Kernels:
        return REFERENCE_KERNELS

    def inputs(self, case: Case, seed: int) -> Inputs:
        """x ~ N(0, 1), residual ~ N(0, 4) (a residual stream grows), weight ~ 1 + N(0, 0.09) as trained
        norms are, the bias (LayerNorm) ~ N(0, 0.25); upstream gradients on y and h."""
        g = torch.Generator(device=case.device).manual_seed(seed)
        n = case.features[0]

        def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
            return (torch.randn(*shape, device=case.device, generator=g) * scale + shift).to(case.dtype)

        tensors = [randn(case.m, n), randn(case.m, n, scale=2.0), randn(n, scale=0.3, shift=1.0)]
        tensors += [randn(n, scale=0.5)] if case.variant == "layer" else []
        return Inputs(tensors, (randn(case.m, n), randn(case.m, n)), seed)

    def run_case(
        self, case: Case, leaves: Sequence[Tensor], backend: Optional[str], seed: Optional[int]
    ) -> tuple[Tensor, Tensor]:
        x, r, w, *b = leaves
        norm, bias = case.variant, b[0] if b else None
        if backend is None:
            return baseline(x, r, w, bias, EPS[norm], norm)
        if norm == "rms":
            return fused_add_rms_norm(x, r, w, EPS[norm], backend=backend)
        return fused_add_layer_norm(x, r, w, bias, EPS[norm], backend=backend)

    def reference_case(
        self, case: Case, leaves: Sequence[Tensor], seed: int, torch_masks: bool = False
    ) -> tuple[Tensor, Tensor]:
        x, r, w, *b = leaves
        return reference(x, r, w, b[0] if b else None, EPS[case.variant], case.variant, upcast=True)


SPEC = ops.register(AddNormSpec())


def fused_add_rms_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Tensor,
    eps: float = EPS["rms"],
    *,
    offset: float = 0.0,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """(y, h): h = x + residual, y = RMSNorm(h) * (weight + offset), in one pass each way.

    x and residual: (..., N), one floating dtype and device; residual None: h is x (a plain RMSNorm).
    weight: (N,) like x. ``offset=1.0`` is Gemma's (1 + weight). y and h have x's shape and dtype; both
    are differentiable (h is the next residual stream), twice. ``backend`` forces a backend (see
    ``dispatch.explain``); under ``torch.compile`` with none requested the op traces as plain PyTorch.

    Equivalent PyTorch (Hugging Face's LlamaRMSNorm after the residual add)::

        h = x + residual
        hf = h.float()
        y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    """
    return ops.dispatcher().run(SPEC, parse(x, residual, weight, None, eps, "rms", offset), backend)


def fused_add_layer_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Tensor,
    bias: Optional[Tensor],
    eps: float = EPS["layer"],
    *,
    offset: float = 0.0,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """(y, h): h = x + residual, y = LayerNorm(h) * (weight + offset) + bias, in one pass each way.

    As ``fused_add_rms_norm``, with bias (N,) or None and the biased variance of ``nn.LayerNorm``.

    Equivalent PyTorch::

        h = x + residual
        y = F.layer_norm(h, (N,), weight, bias, eps)
    """
    return ops.dispatcher().run(SPEC, parse(x, residual, weight, bias, eps, "layer", offset), backend)


def _parse_rms(x: object, residual: object, weight: object, eps: object = EPS["rms"], *,
               offset: object = 0.0) -> AddNormCall:  # fmt: skip
    return parse(x, residual, weight, None, eps, "rms", offset)


def _parse_layer(x: object, residual: object, weight: object, bias: object, eps: object = EPS["layer"], *,
                 offset: object = 0.0) -> AddNormCall:  # fmt: skip
    return parse(x, residual, weight, bias, eps, "layer", offset)


_PARSERS = {"fused_add_rms_norm": _parse_rms, "fused_add_layer_norm": _parse_layer}
