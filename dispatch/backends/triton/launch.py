"""Low-overhead launches of ``@triton.jit`` kernels on CUDA.

``kernel[grid](...)`` costs ~15-25 us of host time per call in triton 3.6: binding the
arguments, building the specialization key, reading knobs. Small (decode) shapes are bound by that,
not by the GPU. ``Launcher`` keeps the ``CompiledKernel`` that the first ``kernel[grid](...)`` returns,
under a key at least as fine as Triton's own specialization (each tensor's dtype and 16-byte
alignment, each int's 32/64-bit range, ``== 1`` and ``% 16 == 0``, every constexpr and launch
option), and later calls hand the arguments straight to its launcher: 15.4 -> 10.6 us a launch
(benchmarks/PERF.md). A key finer than Triton's can only cost an extra cache entry, never reuse a
kernel compiled under assumptions the new arguments break.

Launch sites pass the compile-time arguments by name, as a dict (``launcher(grid, args,
dict(BLOCK_M=64, ACTIVATION="gelu"), num_warps=4)``); the launcher puts them in the kernel's parameter
order, read once from the kernel, and refuses names that are not exactly the kernel's constexprs. A
dict, not ``**constexprs``: a stub launcher taking 8 constexprs costs 0.93 us a call as ``**``
keywords, 0.42 us as a dict, 0.09 us as a positional tuple (CPU, Python 3.11).

That fast path calls ``CompiledKernel.run`` with ``packed_metadata``: private to Triton, and their
signature and contents changed between releases. It is taken only on the Triton versions it was
tested with (``TESTED_TRITON``); on any other, and under Triton's interpreter (CPU tensors), every
launch goes through ``kernel[grid](...)``. ``DISPATCH_TRITON_FAST_LAUNCH=1`` / ``=0``, read when a
launcher is built (the op modules' import), forces the fast path on or off.

Launches through ``kernel[grid](...)`` and first calls take ``_FIRST_CALL_LOCK``, one for every
launcher: Triton's own first launch of a specialization is not safe against a second thread's
(``CompiledKernel._init_handles`` sets the launcher before it loads the module, so the other thread
can launch ``function`` None), and the interpreter patches ``triton.language``'s globals for the
length of each launch, restoring them at the end. Cached kernels launch without it (past
``max_entries`` keys, a new key's launches all take it).
"""

from __future__ import annotations

import inspect
import operator
import os
import re
import threading
from typing import Any, Callable, Optional

import torch
import triton

try:  # triton >= 3.3
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton: no hooks to honour
    _knobs = None

# (major, minor) releases whose CompiledKernel.run(gridX, gridY, gridZ, stream, function,
# packed_metadata, launch_metadata, enter_hook, exit_hook, *args) the fast path was tested against
TESTED_TRITON = ((3, 6),)
FAST_LAUNCH_ENV = "DISPATCH_TRITON_FAST_LAUNCH"
_I32 = 2**31
_FIRST_CALL_LOCK = threading.RLock()


def major_minor(version: str) -> Optional[tuple[int, int]]:
    """(3, 6) for "3.6.0", "3.6.1+git1a2b3c"; None when the version string has no such prefix."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return None if found is None else (int(found[1]), int(found[2]))


TRITON_VERSION = major_minor(triton.__version__)


def fast_launch() -> bool:
    """Whether launches may call ``CompiledKernel.run`` directly: ``DISPATCH_TRITON_FAST_LAUNCH`` if it
    is 0 or 1, else whether the installed Triton's (major, minor) is in ``TESTED_TRITON``."""
    forced = os.environ.get(FAST_LAUNCH_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return TRITON_VERSION in TESTED_TRITON


def constexpr_names(kernel: Any) -> tuple[str, ...]:
    """The kernel's ``tl.constexpr`` parameters in order: ``JITFunction.params``, or for the
    interpreter's ``InterpretedFunction`` (no ``params``) its function's annotations, by Triton's own
    test (the annotation names ``constexpr``)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return tuple(p.name for p in params if p.is_constexpr)
    signature = inspect.signature(kernel.fn)
    return tuple(name for name, p in signature.parameters.items() if "constexpr" in str(p.annotation))


def _ordering(names: tuple[str, ...]) -> Callable[[dict], tuple]:
    """given -> (given[name] for name in names) as a tuple: from two names on one C call
    (itemgetter), ~0.4 us less host time than a list comprehension for 8 names (CPU)."""
    if len(names) >= 2:
        return operator.itemgetter(*names)
    return lambda given: tuple([given[name] for name in names])


class Launcher:
    """``Launcher(kernel, tensors, descriptors)(grid, args, constexprs, num_warps, num_stages)``
    launches ``kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)``.
    ``args`` are the runtime arguments in the kernel's parameter order: the first ``descriptors`` of
    them host ``TensorDescriptor``s (TMA), the next ``tensors`` tensors, the rest Python ints and
    floats; ``constexprs`` a dict of the compile-time ones by name (the kernel's last parameters). A
    descriptor is keyed by its dtype and block shape, all Triton specializes it on (triton 3.6 to
    3.9); its cuTensorMap is still encoded at every launch, by Triton's launcher, from its base, shape
    and strides."""

    def __init__(self, kernel: Any, tensors: int, max_entries: int = 1024, descriptors: int = 0) -> None:
        self.kernel = kernel
        self.tensors = tensors
        self.descriptors = descriptors
        self.max_entries = max_entries
        self.constexprs = () if kernel is None else constexpr_names(kernel)
        self._order = _ordering(self.constexprs)
        if kernel is not None:
            names = kernel.arg_names
            assert tuple(names[len(names) - len(self.constexprs) :]) == self.constexprs, (
                f"internal: {kernel.__name__}'s constexprs must be its last parameters"
            )
        self.fast = fast_launch()
        self._compiled: dict = {}

    def _key(
        self, device: int, num_warps: int, constexprs: tuple, args: tuple, num_stages: Optional[int] = None
    ) -> tuple:
        nd = self.descriptors
        nt = nd + self.tensors
        ints = args[nt:]
        return (
            device,
            num_warps,
            num_stages,
            constexprs,
            tuple([(d.base.dtype, tuple(d.block_shape)) for d in args[:nd]]),
            tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in args[nd:nt]]),
            # an int: 32 or 64 bits, == 1, % 16 == 0 (Triton's int specializations); a float: nothing
            tuple([None if a.__class__ is float else (-_I32 <= a < _I32, a == 1, a % 16 == 0) for a in ints]),
        )

    def _mismatch(self, given: Any) -> TypeError:
        if not isinstance(given, dict):
            return TypeError(f"constexprs must be a dict of name -> value, got {type(given).__name__}")
        expected, got = set(self.constexprs), set(given)
        return TypeError(
            f"{self.kernel.__name__} takes the constexprs {', '.join(self.constexprs)}; missing "
            f"{sorted(expected - got) or 'none'}, unexpected {sorted(got - expected) or 'none'}"
        )

    def __call__(
        self, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: Optional[int] = None
    ) -> None:
        if len(constexprs) != len(self.constexprs):
            raise self._mismatch(constexprs)
        try:
            values = self._order(constexprs)  # the kernel's parameter order
        except (KeyError, TypeError):
            raise self._mismatch(constexprs) from None
        first = args[self.descriptors]  # the first tensor
        if not (self.fast and first.is_cuda):  # every launch locked: no cache tells first calls apart
            with _FIRST_CALL_LOCK:
                self._direct(grid, args, values, num_warps, num_stages)
            return
        device = first.get_device()
        key = self._key(device, num_warps, values, args, num_stages)
        compiled = self._compiled.get(key)
        if compiled is None:
            with _FIRST_CALL_LOCK:
                if self._compiled.get(key) is None:  # else another thread launched it first meanwhile
                    self._first_call(key, device, grid, args, values, num_warps, num_stages)
                    return
            compiled = self._compiled[key]
        if device != torch.cuda.current_device():  # the compiled module belongs to one device's context
            with torch.cuda.device(device):
                self._direct(grid, args, values, num_warps, num_stages)
            return
        stream = torch._C._cuda_getCurrentRawStream(device)
        full = args + values
        enter = exit_ = None
        metadata = None
        if _knobs is not None:
            enter, exit_ = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
            if enter is not None and getattr(enter, "calls", True):  # a profiler is listening
                metadata = compiled.launch_metadata(grid, stream, *full)
        g = tuple(grid) + (1, 1)
        run, fn, packed = compiled.run, compiled.function, compiled.packed_metadata
        run(g[0], g[1], g[2], stream, fn, packed, metadata, enter, exit_, *full)

    def _first_call(
        self, key: tuple, device: int, grid: tuple, args: tuple, constexprs: tuple, num_warps: int,
        num_stages: Optional[int],
    ) -> None:
        """A key's first launch, under ``_FIRST_CALL_LOCK``: Triton compiles (or loads) the kernel and
        its module, and the kernel it returns is kept for the key's later launches."""
        if device != torch.cuda.current_device():
            with torch.cuda.device(device):
                compiled = self._direct(grid, args, constexprs, num_warps, num_stages)
        else:
            compiled = self._direct(grid, args, constexprs, num_warps, num_stages)
        if len(self._compiled) < self.max_entries and compiled is not None:
            self._compiled[key] = compiled

    def _direct(self, grid: tuple, args: tuple, constexprs: tuple, num_warps: int, num_stages: Optional[int]):
        """``kernel[grid](...)`` with the constexprs in parameter order: Triton's own path (first
        calls, the interpreter, other devices, untested Triton versions)."""
        if num_stages is None:
            return self.kernel[grid](*args, *constexprs, num_warps=num_warps)
        return self.kernel[grid](*args, *constexprs, num_warps=num_warps, num_stages=num_stages)
