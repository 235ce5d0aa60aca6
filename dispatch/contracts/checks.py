"""Argument checks the op specs share: each bad input raises one clear error naming the argument, what
was expected and what came. Every call of the public ops passes through here once."""

from __future__ import annotations

import math
import numbers
import sys
from typing import Optional

import torch
from torch import Tensor

from dispatch.contracts.activations import ACTIVATIONS, get_activation

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_STRIDED = torch.strided


def type_name(value: object) -> str:
    """The type of ``value`` as a reader finds it: builtins bare (``int``), others with their module
    (``numpy.bool``, ``torch.Tensor``): numpy 2 names its bool scalar type just ``bool``."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _is_numpy_bool(value: object) -> bool:
    numpy = sys.modules.get("numpy")  # a numpy bool implies numpy is imported: no import here
    return numpy is not None and isinstance(value, numpy.bool_)


def check_tensor(name: str, t: object) -> Tensor:
    # the common case in one test, each property read once; the errors below name what failed
    if isinstance(t, Tensor) and t.layout is _STRIDED and not t.is_nested and t.dtype in FLOAT_DTYPES:
        return t
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(t)}")
    # every backend indexes dense memory: sparse and nested tensors would fail inside PyTorch or a kernel
    if t.layout is not torch.strided or t.is_nested:  # a nested tensor's layout may read torch.strided
        what = f"a nested tensor (layout {t.layout})" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"{name} must be a dense (strided) torch.Tensor, got {what}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {t.dtype}"
        )
    return t


def check_like(name: str, t: object, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An operand that must match x: a dense tensor of x's dtype (a floating one, checked) and device."""
    if (
        isinstance(t, Tensor)
        and t.dtype is dtype
        and t.layout is _STRIDED
        and not t.is_nested
        and t.device == device
    ):  # the common case; the errors below name what failed
        return t
    if not isinstance(t, Tensor) or t.dtype is not dtype:
        check_tensor(name, t)  # names a non-tensor or a non-floating dtype first
        raise TypeError(f"{name} must have x's dtype {dtype}, got {t.dtype}")
    if t.layout is not torch.strided or t.is_nested:
        check_tensor(name, t)
    if t.device != device:
        raise ValueError(f"{name} must be on x's device {device}, got {t.device}")
    return t


def check_bias(name: str, bias: object, n: int, dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
    """A bias as the backends take it: None, or (n,) like x and unit-stride (a copy of n values if not)."""
    if bias is None:
        return None
    b = check_like(name, bias, dtype, device)
    if b.shape != (n,):
        raise ValueError(
            f"{name} must have shape ({n},) to match the output's last dimension, got {tuple(b.shape)}"
        )
    return b if b.is_contiguous() else b.contiguous()


def rows_of(shape: torch.Size) -> tuple[int, int]:
    """x's shape as the backends see it, (M, features), with M the product of the leading dims."""
    dims = len(shape)
    if dims == 2:
        return shape[0], shape[1]
    if dims == 3:  # (batch, tokens, features): the other common case, without math.prod's tuple
        return shape[0] * shape[1], shape[2]
    if not dims:
        raise ValueError("x must have at least one dimension (..., N), got a 0-d tensor")
    return math.prod(shape[:-1]), shape[-1]


def _check_activation(activation: object) -> str:
    # the type first: a list or dict is unhashable, and the membership test would raise a TypeError
    # that names nothing
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        get_activation(activation)  # raises with the list of names
    return activation  # type: ignore[return-value]


def check_backend(backend: object) -> Optional[str]:
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {type_name(backend)}")
    return backend


def check_p(p: object, name: str = "p") -> float:
    """p as a float in [0, 1]: any real number (numpy's included) but a bool, which is a number to
    Python but surely a mistake here. NaN fails the range test (every comparison with NaN is False)."""
    if type(p) is float and 0.0 <= p <= 1.0:  # the common case skips numbers.Real's ABC check
        return p
    if isinstance(p, bool) or _is_numpy_bool(p):
        raise ValueError(f"{name} must be a number in [0, 1], got {p!r} (a bool)")
    if not isinstance(p, numbers.Real):
        raise ValueError(f"{name} must be a number in [0, 1], got {p!r} ({type_name(p)})")
    value = float(p)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number in [0, 1], got {p!r} (not a number)")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {p!r}")
    return value


def check_generator(generator: object, device: torch.device) -> None:
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type_name(generator)}")
        if generator.device.type != device.type:
            raise ValueError(f"generator must be on x's device type {device.type}, got {generator.device}")


def check_training(training: object) -> bool:
    if type(training) is bool:
        return training
    if _is_numpy_bool(training):  # e.g. a flag read from an array: the same truth value
        return bool(training)
    raise TypeError(f"training must be a bool, got {type_name(training)}")


def bias_act_dropout_args(
    x: object, bias: object, activation: object, p: object, training: object, generator: object
) -> tuple[Tensor, Optional[Tensor], str, float, bool, tuple[int, int], torch.device, torch.dtype]:
    """The checked arguments, whether dropout applies, x's (M, N), device and dtype."""
    x = check_tensor("x", x)
    rows = rows_of(x.shape)
    device, dtype = x.device, x.dtype
    bias = check_bias("bias", bias, rows[1], dtype, device)
    # the common values take one test each; the checks that name a bad value run only for the rest
    if type(activation) is not str or activation not in ACTIVATIONS:
        activation = _check_activation(activation)
    if type(p) is not float or not 0.0 <= p <= 1.0:
        p = check_p(p)
    if type(training) is not bool:
        training = check_training(training)
    check_generator(generator, device)
    return x, bias, activation, p, training and p > 0, rows, device, dtype


def fused_linear_args(
    x: object, weight: object, bias: object, activation: object
) -> tuple[Tensor, Tensor, Optional[Tensor], str, tuple[int, int, int], torch.device, torch.dtype, bool]:
    """The checked arguments, the call's (M, N, K), x's device and dtype, and whether x is (M, K) itself."""
    x = check_tensor("x", x)
    shape = x.shape
    flat = len(shape) == 2
    m, k = shape if flat else rows_of(shape)
    device, dtype = x.device, x.dtype
    w = check_like("weight", weight, dtype, device)
    wshape = w.shape
    if len(wshape) != 2 or wshape[1] != k:
        raise ValueError(
            f"weight must have shape (out_features, {k}) to match x's last dimension, got {tuple(wshape)}"
        )
    n = wshape[0]
    if type(activation) is not str or activation not in ACTIVATIONS:
        activation = _check_activation(activation)
    return x, w, check_bias("bias", bias, n, dtype, device), activation, (m, n, k), device, dtype, flat
