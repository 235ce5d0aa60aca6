"""add_norm's test helpers: inputs as trained norms see them, the public functions as one signature,
outputs with gradients, and the check of a backend against the op's float64 reference (within twice the
reference's own error in the same dtype, eager's math, plus the dtype's tolerance)."""

from __future__ import annotations

import torch

from dispatch import fused_add_layer_norm, fused_add_rms_norm
from dispatch.contracts.tolerances import check
from dispatch.ops import add_norm as spec

EPS = spec.EPS
NAMES = ("y", "h", "grad_x", "grad_residual", "grad_weight", "grad_bias")


def inputs(shape, dtype, device, norm, residual=True, offset=0.0):
    """(x, residual (or None), weight, bias (layer only)) and the upstream gradients (y's, h's), in
    ``dtype``: residual ~ N(0, 4) as a residual stream grows, weight around 1 - offset (a trained norm's
    unit scale)."""
    n = shape[-1]

    def randn(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, device=device) * scale + shift).to(dtype)

    x, r = randn(*shape), randn(*shape, scale=2.0) if residual else None
    w, b = randn(n, scale=0.3, shift=1.0 - offset), randn(n) if norm == "layer" else None
    return (x, r, w, b), (randn(*shape), randn(*shape))


def public(norm: str, backend, offset: float = 0.0):
    """The public function of ``norm`` as f(x, residual, weight, bias)."""
    if norm == "rms":
        return lambda x, r, w, b: fused_add_rms_norm(x, r, w, EPS[norm], offset=offset, backend=backend)
    return lambda x, r, w, b: fused_add_layer_norm(x, r, w, b, EPS[norm], offset=offset, backend=backend)


def outputs_and_grads(fn, tensors, upstream, dtype=None) -> list:
    """[y, h, *the gradients of the tensors] of ``fn`` on fresh leaves (in ``dtype`` if given), for the
    upstream gradients that are not None (zeros where a tensor is unused); None for an absent tensor."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
    y, h = fn(*leaves)
    used = [(o, g.to(o.dtype)) for o, g in zip((y, h), upstream) if g is not None]
    wanted = [t for t in leaves if t is not None]
    outs, ups = [o for o, _ in used], [g for _, g in used]
    found = iter(torch.autograd.grad(outs, wanted, ups, materialize_grads=True))
    return [y.detach(), h.detach(), *(None if t is None else next(found) for t in leaves)]


def references(norm, tensors, upstream, offset: float = 0.0) -> tuple[list, list]:
    """outputs_and_grads of the op's reference in float64 and in the tensors' dtype (eager's math)."""

    def reference(upcast):
        return lambda x, r, w, b: spec.reference(x, r, w, b, EPS[norm], norm, offset, upcast=upcast)

    wide = outputs_and_grads(reference(True), tensors, upstream, torch.float64)
    return wide, outputs_and_grads(reference(False), tensors, upstream)


def assert_matches(backend, norm, tensors, upstream, offset: float = 0.0) -> list:
    """The backend's outputs and gradients (returned) against the float64 reference."""
    got = outputs_and_grads(public(norm, backend, offset), tensors, upstream)
    ref, base = references(norm, tensors, upstream, offset)
    for name, out, want, eager in zip(NAMES, got, ref, base):
        if want is not None:
            assert out.dtype == tensors[0].dtype and out.shape == want.shape, name
            check(f"{backend} {name}", out, want, eager)
    return got
