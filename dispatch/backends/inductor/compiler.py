"""torch.compile (inductor) of the eager functions: one graph per kind of call, dynamic in the token
dimension.

A kind of call is everything dynamo specializes on apart from the token count M: the function, the
activation, p, which inputs are None, which gradients, the feature sizes, dtypes, devices and strides.
Its first call compiles with dim 0 of x (and grad_y, the saved pre-activation) marked dynamic, so any
later M >= 2 runs the same graph; M = 1 is its own kind, since dynamo specializes sizes 0 and 1.

Recompile limits for these functions only: dynamo counts graphs per code object against
``recompile_limit`` (8), so each kind compiles its own copy of the eager function (same code, new code
object) and holds one graph, whatever mix of activations and dtypes a model uses; no global setting
changes. The first call of a kind also runs with ``suppress_errors=False`` and
``fail_on_recompile_limit_hit=True``, so a failed compile raises instead of quietly running eager code.

Everything but M is static, p above all. Dynamo's automatic dynamic shapes remember each frame input
per ``CodeId`` (file, first line, *name* of the code), not per code object, so copies of one function
shared that memory: the second kind's compile saw p differ from the first kind's and traced p as a
symbol. Inductor (torch 2.13) then baked the threshold T(p) into the kernel from the symbol's example
value (32768 for p = 0.5) while computing the scale from p at run time, and its FX graph cache gave
that kernel to every later kind whose graph differed only in p: p = 0.9 dropped half the elements,
scaled by 1 / (1 - 0.9). So each copy gets its own code name, hence its own automatic-dynamic memory,
and the first call compiles with automatic dynamic off and floats specialized: p, the activation and
the flags are constants of the graph, guarded by value, as the kind says.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from dispatch.contracts.compiled import CacheInfo, CompiledCache

CACHE_LIMIT = 256  # kinds of call kept compiled
_FIRST_CALL_SETTINGS = {
    "suppress_errors": False,
    "fail_on_recompile_limit_hit": True,
    # every frame input static unless marked dynamic (M): a kind is one value of each of them
    "automatic_dynamic_shapes": False,
    "assume_static_by_default": True,
    "specialize_float": True,
}

# A kind's first call compiles under dynamo's compile lock (dispatch.contracts.compiled says why)
_compiled = CompiledCache(lambda: CACHE_LIMIT)


def _own_code(fn: Callable[..., Any], serial: int) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object, hence its own dynamo cache and recompile count, and
    its own code name (``forward_kind3``), hence its own automatic-dynamic memory (keyed by name)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_kind{serial}")
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@contextlib.contextmanager
def _first_call() -> Iterator[None]:
    settings = {k: v for k, v in _FIRST_CALL_SETTINGS.items() if hasattr(torch._dynamo.config, k)}
    # Compiling imports TorchScript-era modules that warn of their deprecation (torch.utils.mkldnn
    # and others): warnings about torch's insides, not about the user's code.
    with torch._dynamo.config.patch(**settings), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _kind(arg: Any, rows: bool) -> Any:
    """What one argument contributes to the kind of call."""
    if not isinstance(arg, Tensor):
        return arg  # activation, p, need_x, ...: each value is its own graph
    shape = tuple(arg.shape)
    if rows and shape[0] >= 2:
        shape = ("M",) + shape[1:]
    layout = "contiguous" if arg.is_contiguous() else tuple(arg.stride())
    big = arg.numel() >= 2**31  # inductor indexes in int32 below
    return (shape, layout, arg.dtype, arg.device, arg.requires_grad, big)


def _marked(t: Tensor) -> Tensor:
    """An alias of ``t`` with dim 0 marked dynamic (the caller's tensor stays unmarked)."""
    alias = t.detach().requires_grad_(t.requires_grad)  # dynamo guards on requires_grad
    torch._dynamo.mark_dynamic(alias, 0)
    return alias


def run(fn: Callable[..., Any], args: tuple, rows: tuple[int, ...]) -> Any:
    """``fn(*args)`` compiled by inductor, with dim 0 of ``args[i]`` dynamic for each i in ``rows``.

    Runs without autograd: forward and backward are compiled as separate functions.
    """
    kind = (fn, *(_kind(a, i in rows) for i, a in enumerate(args)))
    return _compiled.run(kind, args, lambda: _compile_and_run(fn, args, rows))


def _compile_and_run(
    fn: Callable[..., Any], args: tuple, rows: tuple[int, ...]
) -> tuple[Callable[..., Any], Any]:
    """A kind's first call, under the compile lock: (the compiled function, its output)."""
    args = tuple(  # mark_dynamic costs ~14 us: only when compiling
        _marked(a) if i in rows and a is not None and a.shape[0] >= 2 else a for i, a in enumerate(args)
    )
    # dynamic=None, not False: False would patch dynamo's config around every call, not just this
    # one; _first_call's settings make the compile as static as False would, M aside
    compiled = torch.compile(_own_code(fn, _compiled.compiles), fullgraph=True, dynamic=None)
    with torch.no_grad(), _first_call():
        return compiled, compiled(*args)


def cache_info() -> CacheInfo:
    return _compiled.info()


def clear_cache() -> None:
    _compiled.clear()
