"""bias_act_dropout: Dropout(Activation(x + bias)), the op's one room. In order: the call object and its
checks, the kernels' signatures, the reference and baseline math, how its kernels take a call
(``dispatch.contracts.running`` runs it: inference, torch's autograd, or one autograd node that
regenerates the mask in backward), the custom op a compiled graph keeps, the spec with its
calibration inputs, and the public function."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dispatch import ops
from dispatch.contracts import checks, running
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS
from dispatch.contracts.backend import Call, Kernels, composite_kernels, new_call
from dispatch.contracts.op import Case, Grid, Inputs, OpCall, OpSpec, torch_keep, torch_keep_scale
from dispatch.contracts.rng import Rng

NAME = "bias_act_dropout"
TRAITS = ("activation", "dropout")  # a call's, past its sizes and dtype: what decisions key on
_grad_enabled = torch.is_grad_enabled


class BiasActDropoutCall(OpCall):
    __slots__ = ("x", "bias", "activation", "p", "dropout", "generator", "shape", "flat")

    def __init__(self, call: Call, x: Tensor, bias: Optional[Tensor], activation: str, p: float,
                 dropout: bool, generator: Optional[torch.Generator], shape: torch.Size,
                 flat: bool) -> None:  # fmt: skip
        self.call = call
        self.special = dropout and p == 1.0  # every element dropped: SPEC.special
        self.x = x  # the caller's x, (..., N)
        self.bias = bias  # (N,) contiguous, or None
        self.activation = activation
        self.p = p  # 0.0 unless dropout
        self.dropout = dropout  # training and p > 0
        self.generator = generator
        self.shape = shape  # the caller's x shape, the output's
        self.flat = flat  # x is (M, N) itself: kernels take it as it is


def parse(
    x: object,
    bias: object = None,
    activation: object = "gelu",
    p: object = 0.0,
    training: object = True,
    *,
    generator: object = None,
) -> BiasActDropoutCall:
    """The checked call; the errors name the first bad argument in argument order."""
    x, bias, activation, p, dropout, shape, device, dtype = checks.bias_act_dropout_args(
        x, bias, activation, p, training, generator
    )
    grad = _grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    call = new_call((NAME, device, dtype, shape, grad, TRAITS, (activation, dropout and p < 1.0)))
    size = x.shape
    return BiasActDropoutCall(
        call, x, bias, activation, p if dropout else 0.0, dropout, generator, size, len(size) == 2
    )


def rows(c: BiasActDropoutCall) -> Tensor:
    """x as (M, N): a view where strides allow."""
    return c.x if c.flat else c.x.reshape(c.call.shape)


# ----------------------------------------------------------------------------- kernels


# A backend's ``Kernels`` (dispatch.contracts.backend) for this op. x (M, N) any strides, bias (N,)
# contiguous or None; ``rng`` the spec's (seed, offset) (dispatch.contracts.rng) for masks "spec", the
# caller's generator or None for masks "torch"; None without dropout. y is a new contiguous (M, N)
# tensor of x's dtype.
#   forward(x, bias, activation, p, rng) -> y              a call with autograd
#   inference(x, bias, activation, p, rng) -> y            a call without
#   backward(grad_y, x, bias, activation, p, rng, need_x, need_bias) -> (grad_x, grad_bias)
# backward is asked for at least one gradient, never for an absent bias's.


# ----------------------------------------------------------------------------- math


def reference(
    x: Tensor,
    bias: Optional[Tensor],
    activation: str,
    p: float = 0.0,
    rng: Optional[Rng] = None,
    upcast: bool = False,
    keep: Optional[Tensor] = None,
) -> Tensor:
    """The definition, differentiable, on (..., N) inputs; float64 when ``upcast``, else x's dtype.
    The mask is the spec's for ``rng`` (its scale), or ``keep``, torch's (F.dropout's 1 / (1 - p))."""
    n = x.shape[-1]
    dtype = torch.float64 if upcast else x.dtype
    z = x.reshape(-1, n).to(dtype)
    if bias is not None:
        z = z + bias.to(dtype)
    y = ACTIVATIONS[activation].forward(z)
    scale = dropout_rng.keep_scale(p) if keep is None else torch_keep_scale(p)  # the mask's own RNG's
    if keep is None and rng is not None:
        keep = dropout_rng.keep_mask(rng, z.shape[0], n, p, z.device)
    if keep is not None:
        # F.dropout's product: a dropped NaN or inf gives NaN, a dropped finite value 0
        y = y * keep.reshape(y.shape) * scale
    return y.reshape(x.shape)


def baseline(
    x: Tensor, bias: Optional[Tensor], activation: str, p: float, generator: Optional[torch.Generator] = None
) -> Tensor:
    """What a user writes: ``F.dropout(act(x + bias), p)``, torch's RNG; what torch.compile traces.
    With a ``generator`` the mask is drawn from it (F.dropout takes none): bernoulli, as F.dropout."""
    y = ACTIVATIONS[activation].forward(x if bias is None else x + bias)
    if p == 0.0:
        return y
    if generator is None:
        return F.dropout(y, p, training=True)
    return y * torch_keep(y.shape, y.dtype, y.device, p, generator) * (1.0 / (1.0 - p))


def _baseline_backward(grad_y: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float,
                       rng: Any, need_x: bool, need_bias: bool) -> tuple[Optional[Tensor], ...]:  # fmt: skip
    """The baseline's backward where it can be a separate call: without dropout (a torch-RNG mask
    is kept by autograd, never regenerated, so such calls run under torch's autograd only)."""
    if p != 0.0:
        raise RuntimeError("the pytorch backend's dropout mask is torch's: its backward is autograd's")
    leaves = [
        t.detach().requires_grad_(need) if t is not None else None
        for t, need in ((x, need_x), (bias, need_bias))
    ]
    with torch.enable_grad():
        y = baseline(leaves[0], leaves[1], activation, 0.0)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad(y, wanted, grad_y) if wanted else ())
    grad_x, grad_bias = (next(found) if t is not None and t.requires_grad else None for t in leaves)
    return grad_x, grad_bias


BASELINE_KERNELS = composite_kernels(baseline, _baseline_backward, baseline, any_shape=True)


# ----------------------------------------------------------------------------- running on kernels

# The kernels' arguments are the tensors (x, bias), then the settings (activation, p, rng); forward
# returns y alone (backward needs only the inputs and the rng).
CALLING = running.Calling(
    tensors=2,
    backward=lambda kernels, grad_y, tensors, saved, settings, needs: kernels.backward(
        grad_y, *tensors, *settings, *needs
    ),
    differentiable=lambda tensors, settings: reference(*tensors, *settings),
    saves=False,
)


def _bind(
    run: Callable[..., Tensor], kernels: Kernels, draws: bool
) -> Callable[[BiasActDropoutCall], Tensor]:
    """One call on ``run``: x as rows (unless the kernels take any shape), the spec's rng drawn only
    where ``draws``, the caller's generator for kernels whose masks are torch's."""
    if draws:
        draw_for = dropout_rng.draw_for

        def drawing(c: BiasActDropoutCall) -> Tensor:
            if c.flat:
                return run(c.x, c.bias, c.activation, c.p, draw_for(c.x, c.generator))
            x = c.x.reshape(c.call.shape)
            return run(x, c.bias, c.activation, c.p, draw_for(x, c.generator)).view(c.shape)

        return drawing
    torch_masks = kernels.masks != "spec"
    if kernels.any_shape:

        def shaped(c: BiasActDropoutCall) -> Tensor:
            return run(c.x, c.bias, c.activation, c.p, c.generator if torch_masks else None)

        return shaped

    def plain(c: BiasActDropoutCall) -> Tensor:
        rng = c.generator if torch_masks else None
        if c.flat:
            return run(c.x, c.bias, c.activation, c.p, rng)
        return run(c.x.reshape(c.call.shape), c.bias, c.activation, c.p, rng).view(c.shape)

    return plain


# ----------------------------------------------------------------------------- torch.compile


def _kernels(x: Tensor, activation: str, dropout: bool, training: bool, backend: str) -> Any:
    call = Call(NAME, x.device, x.dtype, tuple(x.shape), training, TRAITS, (activation, dropout))
    return ops.dispatcher().kernels(call, backend or None)


def _fake(x, bias, activation, p, rng, backend, training):
    return x.new_empty(x.shape)


def _backward(grad_y: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, p: float,
              rng: Optional[Tensor], backend: str, needs: list[bool]) -> list[Tensor]:  # fmt: skip
    kernels = _kernels(x, activation, rng is not None, True, backend)
    grads = kernels.backward(grad_y, x, bias, activation, p, rng, *needs)
    return [x.new_empty((0,)) if g is None else g for g in grads]


@running.custom_op(NAME, _fake, _backward, tensors=2)
def _custom(x: Tensor, bias: Optional[Tensor], activation: str, p: float, rng: Optional[Tensor],
            backend: str, training: bool) -> Tensor:  # fmt: skip
    return _kernels(x, activation, rng is not None, training, backend).forward(x, bias, activation, p, rng)


# ----------------------------------------------------------------------------- the spec


class BiasActDropoutSpec(OpSpec):
    name = NAME
    public_name = "fused_bias_act_dropout"
    dims = ("M", "N")
    traits = TRAITS
    activations = ACTIVATION_NAMES
    grid = Grid(
        features=((3072,), (768,), (4096,), (14336,), (28672,)),  # GPT-2 MLP and hidden, LLaMA
        quick={"cuda": ((3072,), (4096,), (14336,)), "cpu": ((3072,), (768,))},
        classes=(("gelu", "gelu_tanh", "silu"), ("relu", "identity", "leaky_relu", "squared_relu")),
        gemm=False,
        check_work=2**24,  # eager's dropout (int64 tensor ops) takes 95 ms a call at 65536 x 4096
        families=(("training", True), ("inference", False), ("training", False), ("inference", True)),
        parity={"cpu": ((5, 33), (1, 7), (37, 130)), "cuda": ((1823, 781), (1, 7), (37, 1000), (4096, 4096))},
        outputs=("y", "grad_x", "grad_bias"),
    )

    def parse(self, *args: Any, **kwargs: Any) -> BiasActDropoutCall:
        return parse(*args, **kwargs)

    def runner(self, kernels: Any, call: Call) -> Callable[[OpCall], Tensor]:
        return running.runner(CALLING, kernels, call, _bind)

    def special(self, c: BiasActDropoutCall, backend: Optional[str]) -> Optional[Tensor]:
        """p == 1 in training drops everything: the activation times zero, as F.dropout (zeros, NaN
        where 0 * inf); not for the kernels (the 16-bit threshold stops at 65535/65536)."""
        return fused_bias_act_dropout(c.x, c.bias, c.activation, 0.0, False, backend=backend).mul(0.0)

    def traced(self, c: OpCall, backend: Optional[str], inline: bool) -> Tensor:
        """Inline: the baseline math, so inductor fuses it with its neighbours and draws the mask with its
        own RNG (an opaque op cost compiled GPT-2 a pass over each MLP output), or the generator's as in
        eager mode. Otherwise (a backend requested) one custom op with the spec's mask."""
        assert isinstance(c, BiasActDropoutCall)
        if inline:
            return baseline(c.x, c.bias, c.activation, c.p, c.generator)
        rng = dropout_rng.draw(c.x.device, c.generator) if c.dropout else None
        return _custom(rows(c), c.bias, c.activation, c.p, rng, backend or "", c.call.training).view(c.shape)

    def baseline_kernels(self) -> Kernels:
        return BASELINE_KERNELS

    def inputs(self, case: Case, seed: int) -> Inputs:
        g = torch.Generator(device=case.device).manual_seed(seed)
        n = case.features[0]

        def randn(*shape: int, scale: float = 1.0) -> Tensor:
            return (torch.randn(*shape, device=case.device, generator=g) * scale).to(case.dtype)

        return Inputs([randn(case.m, n), randn(n, scale=0.5)], randn(case.m, n), seed)

    def run_case(self, case: Case, leaves: Sequence[Tensor], backend: Optional[str], seed: int) -> Tensor:
        x, b = leaves
        gen = None if seed is None else _generator(case, seed)
        if backend is None:
            return baseline(x, b, case.activation, case.p)
        return fused_bias_act_dropout(x, b, case.activation, case.p, True, generator=gen, backend=backend)

    def reference_case(self, case: Case, leaves: Sequence[Tensor], seed: int,
                       torch_masks: bool = False) -> Tensor:  # fmt: skip
        x, b = leaves
        gen = _generator(case, seed)
        if torch_masks and gen is not None:  # torch's mask: replayed from the run's generator
            keep = torch_keep(x.shape, case.dtype, x.device, case.p, gen)
            return reference(x, b, case.activation, case.p, upcast=True, keep=keep)
        rng = dropout_rng.draw_for(x, gen) if gen is not None else None  # as the op draws
        return reference(x, b, case.activation, case.p, rng, upcast=True)


def _generator(case: Case, seed: int) -> Optional[torch.Generator]:
    return torch.Generator(device=case.device).manual_seed(seed + 1) if case.dropout else None


SPEC = ops.register(BiasActDropoutSpec())


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
    Dropout follows ``dispatch.contracts.rng``'s spec (regenerated in backward, never stored) on every
    backend but ``pytorch``, whose mask is torch's, as ``nn.Dropout``'s (``dispatch.spec_masks()``
    keeps dropout calls off it). ``p == 1`` in training drops everything as ``F.dropout`` does.
    ``backend`` forces a backend (see ``dispatch.explain``). Under ``torch.compile`` with no backend
    requested the op traces as plain PyTorch, which inductor fuses with its neighbours.
    Differentiable twice: a backward with ``create_graph=True`` differentiates the reference.

    Equivalent PyTorch::

        F.dropout(act(x + bias), p, training)   # up to the choice of random bits
    """
    return ops.dispatcher().run(SPEC, parse(x, bias, activation, p, training, generator=generator), backend)
