"""What the backends that compile eager's functions (inductor, nvfuser) share: the support that follows
from it (``backend``), dynamo's compile lock and a bounded cache of compiled functions whose first
call compiles under it. Imports nothing of ours but the other contracts; imported by those backends
only (torch._dynamo imports triton).

Compiling (a key's first call) runs under dynamo's own compile lock, the one every ``torch.compile``
takes: FX tracing, AOTAutograd and TorchScript keep global state (fx's ``CURRENT_PATCHER``, CPython's
ast recursion counter), and a first call may patch dynamo's config and the warnings filters,
process-wide, for its duration. So neither backend traces while the other, or the user's own
torch.compile, does. A key already compiled runs without it.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable, Hashable, Mapping, NamedTuple

import torch
import torch._dynamo.convert_frame

from dispatch.contracts.activations import ACTIVATION_NAMES
from dispatch.contracts.backend import Backend, Kernels

COMPILE_LOCK = getattr(torch._dynamo.convert_frame, "compile_lock", None) or threading.RLock()
NOTICE_S = 1.0  # a first call that compiles longer than this says so: a stall with no word looks like a hang


class CompileNotice(UserWarning):
    """A call compiled a new kind of call for more than ``NOTICE_S`` seconds (said once per kind)."""


def backend(
    name: str, kernels: Mapping[str, Kernels], activations: frozenset[str] = frozenset(ACTIVATION_NAMES),
    **declared: Any,
) -> Backend:  # fmt: skip
    """The declaration of a backend that compiles eager's functions: cpu and cuda; float16, bfloat16,
    float32; every activation (no gate unless ``activations`` names them); a compile per new kind of
    call. ``declared``: the rest of its ``Backend`` (deterministic, summary, its own refusals and
    label)."""
    return Backend(
        name=name,
        kernels=kernels,
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        activations=activations,
        compiles=True,
        **declared,
    )


def _notice(key: Hashable, seconds: float) -> None:
    if seconds > NOTICE_S:
        fn = key[0] if isinstance(key, tuple) and key and callable(key[0]) else None
        what = f" {getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}" if fn else ""
        warnings.warn(f"dispatch: a new kind of call compiled{what} in {seconds:.1f} s (once per kind; later "
                      "calls of it reuse the graph)", CompileNotice, stacklevel=4)  # fmt: skip


class CacheInfo(NamedTuple):
    size: int
    limit: int
    compiles: int


class CompiledCache:
    """Compiled functions by key, least recently used dropped past ``limit()`` (read at each new key,
    so a backend's ``CACHE_LIMIT`` may change at run time); ``compiles`` counts keys compiled."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._compiled: OrderedDict[Hashable, Callable[..., Any]] = OrderedDict()
        self.compiles = 0

    def run(
        self, key: Hashable, args: tuple, compile_and_run: Callable[[], tuple[Callable[..., Any], Any]]
    ) -> Any:
        """The function compiled for ``key`` on ``args``, without autograd. On the key's first call,
        ``compile_and_run()`` (under ``COMPILE_LOCK``) returns the compiled function and its output."""
        compiled = self._compiled.get(key)
        if compiled is None:
            with COMPILE_LOCK:
                compiled = self._compiled.get(key)  # another thread may have compiled it meanwhile
                if compiled is None:
                    start = time.monotonic()
                    compiled, out = compile_and_run()
                    self._add(key, compiled)
                    _notice(key, time.monotonic() - start)
                    return out
        try:
            self._compiled.move_to_end(key)
        except KeyError:  # just evicted by a thread compiling another key
            pass
        with torch.no_grad():
            return compiled(*args)

    def _add(self, key: Hashable, compiled: Callable[..., Any]) -> None:
        self.compiles += 1
        self._compiled[key] = compiled
        if len(self._compiled) > self._limit():
            self._compiled.popitem(last=False)

    def info(self) -> CacheInfo:
        return CacheInfo(len(self._compiled), self._limit(), self.compiles)

    def clear(self) -> None:
        self._compiled.clear()
