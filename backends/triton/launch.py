"""Low-overhead launches of ``@triton.jit`` kernels on CUDA.

``kernel[grid](...)`` costs ~20-25 us of host time per call in triton 3.6 (measured on the H200 host,
benchmarks/NOTES.md): binding the arguments, building the specialization key, reading knobs. Small
(decode) shapes are bound by that, not by the GPU. ``Launcher`` keeps the ``CompiledKernel`` that the
first ``kernel[grid](...)`` returns, under a key at least as fine as Triton's own specialization
(each tensor's dtype and 16-byte alignment, each int's 32/64-bit range, ``== 1`` and ``% 16 == 0``,
every constexpr and launch option), and later calls hand the arguments straight to its launcher.
A key finer than Triton's can only cost an extra cache entry, never reuse a kernel compiled under
assumptions the new arguments break.

Under Triton's interpreter (CPU tensors) and for argument types this key does not model, the call
goes through ``kernel[grid](...)`` unchanged.

First calls take ``_FIRST_CALL_LOCK``, one for every launcher: Triton's own first launch of a
specialization is not safe against a second thread's (``CompiledKernel._init_handles`` sets the
launcher before it loads the module, so the other thread can launch ``function`` None), and the
interpreter patches ``triton.language``'s globals for the length of each launch, restoring them at
the end, so every interpreted launch takes it. Cached kernels launch without it (past ``max_entries``
keys, a new key's launches all take it).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

try:  # triton >= 3.3
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton: no hooks to honour
    _knobs = None

_I32 = 2**31
_FIRST_CALL_LOCK = threading.RLock()


class Launcher:
    """``Launcher(kernel, tensors, descriptors)(grid, args, constexprs, num_warps, num_stages)``
    launches ``kernel[grid](*args, *constexprs, num_warps=num_warps, num_stages=num_stages)``. ``args``
    are the runtime arguments: the first ``descriptors`` of them host ``TensorDescriptor``s (TMA),
    the next ``tensors`` tensors, the rest Python ints and floats; ``constexprs`` the compile-time
    ones; both in the kernel's parameter order (constexprs after every runtime one). A descriptor is
    keyed by its dtype and block shape, all Triton specializes it on (triton 3.6 to 3.9); its
    cuTensorMap is still encoded at every launch, by Triton's launcher, from its base, shape and
    strides."""

    def __init__(self, kernel: Any, tensors: int, max_entries: int = 1024, descriptors: int = 0) -> None:
        self.kernel = kernel
        self.tensors = tensors
        self.descriptors = descriptors
        self.max_entries = max_entries
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

    def __call__(
        self, grid: tuple, args: tuple, constexprs: tuple, num_warps: int, num_stages: Optional[int] = None
    ) -> None:
        first = args[self.descriptors]  # the first tensor
        if not first.is_cuda:
            with _FIRST_CALL_LOCK:
                self._direct(grid, args, constexprs, num_warps, num_stages)
            return
        device = first.get_device()
        key = self._key(device, num_warps, constexprs, args, num_stages)
        compiled = self._compiled.get(key)
        if compiled is None:
            with _FIRST_CALL_LOCK:
                if self._compiled.get(key) is None:  # else another thread launched it first meanwhile
                    self._first_call(key, device, grid, args, constexprs, num_warps, num_stages)
                    return
            compiled = self._compiled[key]
        if device != torch.cuda.current_device():  # the compiled module belongs to one device's context
            with torch.cuda.device(device):
                self._direct(grid, args, constexprs, num_warps, num_stages)
            return
        stream = torch._C._cuda_getCurrentRawStream(device)
        full = args + constexprs
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
        """``kernel[grid](...)``: Triton's own path (first calls, the interpreter, other devices)."""
        if num_stages is None:
            return self.kernel[grid](*args, *constexprs, num_warps=num_warps)
        return self.kernel[grid](*args, *constexprs, num_warps=num_warps, num_stages=num_stages)
