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
"""

from __future__ import annotations

from typing import Any

import torch

try:  # triton >= 3.3
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older triton: no hooks to honour
    _knobs = None

_I32 = 2**31


class Launcher:
    """``Launcher(kernel, tensors)(grid, args, constexprs, num_warps)`` launches ``kernel[grid](*args,
    *constexprs, num_warps=num_warps)``. ``args`` are the runtime arguments, the first ``tensors`` of
    them tensors and the rest Python ints and floats; ``constexprs`` the compile-time ones; both in
    the kernel's parameter order (constexprs after every runtime one)."""

    def __init__(self, kernel: Any, tensors: int, max_entries: int = 1024) -> None:
        self.kernel = kernel
        self.tensors = tensors
        self.max_entries = max_entries
        self._compiled: dict = {}

    def _key(self, device: int, num_warps: int, constexprs: tuple, args: tuple) -> tuple:
        nt = self.tensors
        return (
            device,
            num_warps,
            constexprs,
            tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in args[:nt]]),
            # an int: 32 or 64 bits, == 1, % 16 == 0 (Triton's int specializations); a float: nothing
            tuple([None if a.__class__ is float else (-_I32 <= a < _I32, a == 1, a % 16 == 0) for a in args[nt:]]),
        )

    def __call__(self, grid: tuple, args: tuple, constexprs: tuple, num_warps: int) -> None:
        first = args[0]
        if not first.is_cuda:
            self.kernel[grid](*args, *constexprs, num_warps=num_warps)
            return
        device = first.get_device()
        if device != torch.cuda.current_device():  # the compiled module belongs to one device's context
            with torch.cuda.device(device):
                self.kernel[grid](*args, *constexprs, num_warps=num_warps)
            return
        key = self._key(device, num_warps, constexprs, args)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, *constexprs, num_warps=num_warps)
            if len(self._compiled) < self.max_entries and compiled is not None:
                self._compiled[key] = compiled
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
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, metadata, enter, exit_, *full)
