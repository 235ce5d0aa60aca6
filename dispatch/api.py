"""The two public ops: validate once, decide (cached), run the chosen backend."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from dispatch import native
from dispatch import rng as dropout_rng
from dispatch.activations import ACTIVATIONS
from dispatch.checks import FLOAT_DTYPES, bias_act_dropout_args, check_backend, fused_linear_args
from dispatch.registry import Call, fused_linear_inference, trusted
from dispatch.select import ENV_VAR, Decision, _impls, _requested, decide, env_backend, request_key, select

# The fast path takes x, bias and weight of these exact types only. Any Tensor subclass takes the full
# path: a user's subclass, and the FakeTensors of torch.export's non-strict tracing, which the full
# path routes by torch.compiler.is_compiling(). A set lookup of the type: isinstance() of a Parameter
# goes through its metaclass, 0.11 us against 0.04 on the H200's host (benchmarks/probes/probe_hot_path.py).
_FAST_TYPES = frozenset({Tensor, torch.nn.Parameter})
# ...which leaves dynamo's tracing, where tensors are plain: dynamo folds this to True. One Python frame,
# 0.05 us, where torch.compiler.is_compiling() runs two (it calls torch.jit.is_scripting()), 0.15 us.
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_is_grad_enabled = torch.is_grad_enabled
_requested_get = _requested.get
_draw_cuda = dropout_rng.draw_cuda
_impls_get = _impls.get  # the decision cache's lookup, bound: a function around it costs a call, ~0.1 us
_STRIDED = torch.strided  # dense: sparse and nested tensors take the full checks, which refuse them


# ----------------------------------------------------------------------------- the fast path's reads
# The steady-state path reads its tensors through these two functions: the C++ module of
# dispatch.native once it is loaded (one call, where these make 10-16 attribute reads of ~0.1 us
# each), these Python twins until then or where it cannot be built. Both return the same tuple for the
# common valid call (exact types, dense, floating, on x's device, CPU or CUDA, matching shapes) and
# None for anything else, which then takes the full checks. Devices as ints: -1 for CPU, the CUDA
# index (x.device builds a torch.device per read).


def _bias_act_signature_py(x: object, bias: object) -> Optional[tuple]:
    """(device, dtype, M, N, grad, bias_contiguous, x.ndim) or None; see above."""
    if (
        type(x) in _FAST_TYPES
        and x.layout is _STRIDED  # sparse tensors have shapes and devices too
        and not x.is_nested  # strided layout, and its .shape raises
        and (dtype := x.dtype) in FLOAT_DTYPES
        and (shape := x.shape)  # a 0-d tensor's shape is empty
        and ((on_cuda := x.is_cuda) or x.is_cpu)
        and ((device := x.get_device() if on_cuda else -1) >= -1)  # always true: binds device
        and (
            bias is None
            or (
                type(bias) in _FAST_TYPES
                and bias.layout is _STRIDED
                and not bias.is_nested
                and bias.dtype is dtype
                and bias.shape == (shape[-1],)  # ~0.14 us: bias.size() or ndim and numel cost more
                and ((bias.is_cuda and bias.get_device() == device) if on_cuda else bias.is_cpu)
            )
        )
    ):
        ndim = len(shape)
        m = shape[0] if ndim == 2 else shape[0] * shape[1] if ndim == 3 else math.prod(shape[:-1])
        # requires_grad first: calls without autograd skip the grad-mode call (~0.1 us)
        grad = (x.requires_grad or (bias is not None and bias.requires_grad)) and _is_grad_enabled()
        contiguous = bias is None or bias.is_contiguous()
        return device, dtype, m, shape[-1], grad, contiguous, ndim
    return None


def _linear_signature_py(x: object, weight: object, bias: object) -> Optional[tuple]:
    """(device, dtype, M, N, K, grad, bias_contiguous, x.ndim) or None; see above."""
    if (
        type(x) in _FAST_TYPES
        and x.layout is _STRIDED
        and not x.is_nested
        and (dtype := x.dtype) in FLOAT_DTYPES
        and (shape := x.shape)
        and ((on_cuda := x.is_cuda) or x.is_cpu)
        and ((device := x.get_device() if on_cuda else -1) >= -1)  # always true: binds device
        and type(weight) in _FAST_TYPES
        and weight.layout is _STRIDED
        and not weight.is_nested
        and weight.dtype is dtype
        and ((weight.is_cuda and weight.get_device() == device) if on_cuda else weight.is_cpu)
        and len(wshape := weight.shape) == 2
        and wshape[1] == shape[-1]
        and (
            bias is None
            or (
                type(bias) in _FAST_TYPES
                and bias.layout is _STRIDED
                and not bias.is_nested
                and bias.dtype is dtype
                and ((bias.is_cuda and bias.get_device() == device) if on_cuda else bias.is_cpu)
                and bias.shape == (wshape[0],)
            )
        )
    ):
        ndim = len(shape)
        m = shape[0] if ndim == 2 else shape[0] * shape[1] if ndim == 3 else math.prod(shape[:-1])
        grad = (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ) and _is_grad_enabled()
        contiguous = bias is None or bias.is_contiguous()
        return device, dtype, m, wshape[0], wshape[1], grad, contiguous, ndim
    return None


_bias_act_signature = _bias_act_signature_py
_linear_signature = _linear_signature_py


def _use_native(module: Any) -> None:
    """dispatch.native's hand-over of the built C++ module (from its build thread: each swap is one
    atomic store of a module global)."""
    global _bias_act_signature, _linear_signature
    _bias_act_signature = module.bias_act_signature
    _linear_signature = module.linear_signature


native.start(_use_native)


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(<generator>): this runs on every call
            if t is not None and t.requires_grad:
                return True
    return False


# ----------------------------------------------------------------------------- autograd glue


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


class _BiasActDropout(torch.autograd.Function):
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
            from backends.eager.bias_act_dropout import reference

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


class _FusedLinear(torch.autograd.Function):
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
            # create_graph=True: as in _BiasActDropout. ``saved`` (the forward's pre-activation) has
            # no graph: a backward built on it misses every second-order term through x and weight.
            from backends.eager.fused_linear import reference

            activation = ctx.activation
            dtype = _compute_dtype(x.dtype)

            def make_y() -> Tensor:
                b = None if bias is None else bias.to(dtype)
                return reference(x.to(dtype), weight.to(dtype), b, activation)

            grads = _differentiable_grads(make_y, (x, weight, bias), needs, grad_y)
        else:
            grads = ctx.impl.backward(grad_y, x, weight, bias, saved, ctx.activation, needs)
        return (*grads, None, None)


# ----------------------------------------------------------------------------- decide and run


def _device_key(x: Tensor) -> object:
    """The device part of a decision's cache key: an int for CPU (-1) and CUDA (the index), the
    torch.device otherwise. Ints because building x.device costs more than the rest of a cached call."""
    return x.get_device() if x.is_cuda or x.is_cpu else x.device


def _bias_act_dropout_impl(key: tuple, x: Tensor) -> object:
    """A cache miss: decide, cache, return the op as the hot path calls it (``registry.trusted``: the
    call is validated here). ``key``: the full call signature (dispatch.select.request_key)."""
    _, _, dtype, m, n, activation, dropout, grad = key[:8]
    call = lambda: Call("bias_act_dropout", x.device, dtype, (m, n), activation, dropout, grad)  # noqa: E731
    return select(key, call, trusted)[1]


def fused_linear_training(
    impl: Any, activation: str
) -> Callable[[Tensor, Tensor, Optional[Tensor], str], Tensor]:
    """How a fused_linear call with autograd runs on the op module ``impl``: its ``differentiable``
    function where it offers one for ``activation`` (ops that torch's autograd differentiates, no Python
    Function around them), else ``impl.forward``/``impl.backward`` in ``_FusedLinear``."""
    native = getattr(impl, "differentiable", None)
    fn = native(activation) if native is not None else None
    if fn is not None:
        return fn
    apply = _FusedLinear.apply

    def with_function(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
        return apply(x, weight, bias, impl, activation)

    return with_function


def _fused_linear_impl(key: tuple, x: Tensor) -> object:
    """A cache miss: decide, cache, return the function that runs such calls, resolved once per decision:
    ``fused_linear_training`` for calls with autograd, ``registry.fused_linear_inference`` (infer or
    forward's y) for the others. Both take (x, weight, bias, activation)."""
    _, _, dtype, m, n, k, activation, grad = key[:8]
    return select(
        key,
        lambda: Call("fused_linear", x.device, dtype, (m, n, k), activation, False, grad),
        (lambda impl: fused_linear_training(impl, activation)) if grad else fused_linear_inference,
    )[1]


# ----------------------------------------------------------------------------- the ops


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
    Dropout follows ``dispatch.rng``'s spec: a 16-bit threshold, so the realized drop probability is
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
    # The steady-state path: common valid arguments on CPU or CUDA (_bias_act_signature), with no
    # Python function of ours between here and the backend but that one (a call costs ~0.1 us).
    # Anything else, and torch.compile, takes the full checks below, which raise each error in
    # argument order.
    try:  # free until it raises (Python 3.11); a type(activation) test first would cost ~0.04 us a call
        fast = (
            not _is_dynamo_compiling()
            and (signature := _bias_act_signature(x, bias)) is not None
            and activation in ACTIVATIONS
            and type(p) is float
            and 0.0 <= p < 1.0  # p == 1 needs no backend: the full path
            and type(training) is bool
            and generator is None
            and (backend is None or type(backend) is str)
        )
    except TypeError:  # an unhashable activation (a list, a dict): the full checks name it
        fast = False
    if fast:
        device, dtype, m, n, grad, bias_contiguous, ndim = signature
        if not bias_contiguous:
            bias = bias.contiguous()
        x2d = x if ndim == 2 else x.reshape(m, n)  # (M, N), a view if strides allow
        dropout = training and p > 0
        if dropout:  # draw_for(x), with x's device and size in hand on CUDA
            rng = _draw_cuda(device, m * n) if device >= 0 else dropout_rng.draw_for(x)
        else:
            rng, p = None, 0.0
        # The full call signature, flat (one hash): dispatch.select.request_key inlined
        key = ("bias_act_dropout", device, dtype, m, n, activation, dropout, grad, backend,
               None if backend is not None else _requested_get())
    else:
        x, bias, activation, p, dropout = bias_act_dropout_args(x, bias, activation, p, training, generator)
        check_backend(backend)
        if dropout and p == 1.0:
            # Every element dropped. Not for the backends: the rng spec's 16-bit threshold stops at
            # 65535/65536 and 1/(1-p) is infinite. As F.dropout does, the activation times zero: zeros
            # and zero gradients, NaN and inf (0 * inf) giving NaN; no random numbers drawn.
            return fused_bias_act_dropout(x, bias, activation, 0.0, False, backend=backend).mul(0.0)
        n = x.shape[-1]
        p = p if dropout else 0.0
        x2d = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), n)  # (M, N), a view if strides allow
        if torch.compiler.is_compiling():
            from dispatch import library

            # no backend requested (and no generator of the caller's): plain math that inductor fuses with
            # its neighbours, dropout included (inductor's mask, as for nn.Dropout; an opaque op here cost
            # GPT-2 a pass over each MLP output and its host time: compile+patched 0.996x compile)
            if library.inline(backend) and (generator is None or not dropout):
                from backends.eager.bias_act_dropout import traced

                return traced(x, bias, activation, p)
            rng = dropout_rng.draw(x.device, generator) if dropout else None  # a traced op: a tensor

            grad = _needs_grad(x, bias)
            return library.bias_act_dropout(x2d, bias, activation, p, rng, backend or "", grad).view(x.shape)
        rng = dropout_rng.draw_for(x, generator) if dropout else None
        grad = _needs_grad(x, bias)
        key = (
            "bias_act_dropout", _device_key(x), x.dtype, x2d.shape[0], n, activation, dropout, grad,
            *request_key(backend),
        )  # fmt: skip
    impl = _impls_get(key)
    if impl is None:
        impl = _bias_act_dropout_impl(key, x)
    if grad:
        y = _BiasActDropout.apply(x2d, bias, impl, activation, p, rng)
    else:
        y = impl.forward(x2d, bias, activation, p, rng)
    return y if x2d is x else y.view_as(x)  # view_as: view(x.shape) parses a torch.Size, ~2 us


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
    # The steady-state path, as in fused_bias_act_dropout.
    try:
        fast = (
            not _is_dynamo_compiling()
            and (signature := _linear_signature(x, weight, bias)) is not None
            and activation in ACTIVATIONS
            and (backend is None or type(backend) is str)
        )
    except TypeError:  # an unhashable activation
        fast = False
    if fast:
        device, dtype, m, n, k, grad, bias_contiguous, ndim = signature
        if not bias_contiguous:
            bias = bias.contiguous()
        x2d = x if ndim == 2 else x.reshape(m, k)  # (M, K)
        key = ("fused_linear", device, dtype, m, n, k, activation, grad, backend,
               None if backend is not None else _requested_get())
    else:
        x, weight, bias, activation = fused_linear_args(x, weight, bias, activation)
        check_backend(backend)
        shape = x.shape
        k = shape[-1]
        n = weight.shape[0]
        x2d = x if x.dim() == 2 else x.reshape(math.prod(shape[:-1]), k)  # (M, K)
        grad = _needs_grad(x, weight, bias)
        if torch.compiler.is_compiling():
            from dispatch import library

            if library.inline(backend):  # inductor fuses bias and activation as for nn.Linear
                from backends.eager.fused_linear import traced

                return traced(x, weight, bias, activation)
            y = library.fused_linear(x2d, weight, bias, activation, backend or "", grad)
            return y.view(*x.shape[:-1], n)
        key = (
            "fused_linear", _device_key(x), x.dtype, x2d.shape[0], n, k, activation, grad,
            *request_key(backend),
        )  # fmt: skip
    run = _impls_get(key)  # with autograd or without, resolved per decision (_fused_linear_impl)
    if run is None:
        run = _fused_linear_impl(key, x)
    y = run(x2d, weight, bias, activation)
    if x2d is x:
        return y
    shape = x.shape  # integer arguments: view(*shape[:-1], n) slices a torch.Size first, ~0.7 us more
    return y.view(shape[0], shape[1], n) if len(shape) == 3 else y.view(*shape[:-1], n)

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
    source = "the backend= argument"
    if backend is None:
        backend, source = _requested.get(), "use_backend()"
    if backend is None:
        backend, source = env_backend(), ENV_VAR
    return decide(call, backend, source)


def _bias_act_dropout_call(
    x: Tensor,
    bias: Optional[Tensor] = None,
    activation: str = "gelu",
    p: float = 0.0,
    training: bool = True,
    *,
    generator: Optional[torch.Generator] = None,
) -> Call:
    x, bias, activation, p, dropout = bias_act_dropout_args(x, bias, activation, p, training, generator)
    dropout = dropout and p < 1.0  # p == 1 runs the op without dropout, times zero
    shape = (math.prod(x.shape[:-1]), x.shape[-1])
    return Call("bias_act_dropout", x.device, x.dtype, shape, activation, dropout, _needs_grad(x, bias))


def _fused_linear_call(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "identity"
) -> Call:
    x, weight, bias, activation = fused_linear_args(x, weight, bias, activation)
    shape = (math.prod(x.shape[:-1]), weight.shape[0], x.shape[-1])
    return Call("fused_linear", x.device, x.dtype, shape, activation, False, _needs_grad(x, weight, bias))
