"""functorch's ``memory_efficient_fusion`` with a TorchScript compiler, one compiled function per call
signature, and a record of which TorchScript fuser actually fused the graphs.

AOTAutograd traces a function once, for the shapes, strides and dtypes of its first call, and then
reuses that graph for any input: so every distinct signature gets its own compiled function, kept in
a bounded LRU cache.

The TorchScript step is functorch's ``ts_compile`` minus freezing. Freezing folds constant tensors
into the graph: the Philox counters' ``arange(M * N / 8)`` would become an int64 constant of M * N
bytes per cached shape, and since AOTAutograd runs compilers under its fake-tensor mode, the folded
constant is a fake tensor that fails at run time with an empty RuntimeError (torch 2.13).

Compiling runs under dynamo's compile lock, the one the inductor backend and every ``torch.compile``
take: FX tracing keeps its patcher in a global (``torch.fx._symbolic_trace.CURRENT_PATCHER``) and
TorchScript parses source with CPython's ``ast``, whose recursion counter is process-wide, so two
threads compiling at once failed with ``CURRENT_PATCHER is None in finally block`` or ``AST
constructor recursion depth mismatch``. A signature already compiled runs without the lock.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from dispatch.contracts.compiled import CacheInfo, CompiledCache

CACHE_LIMIT = 64  # compiled functions kept; each one is a small TorchScript module

# TorchScript node kinds that mark a fused region, by the fuser that made it.
FUSION_GROUPS = {
    "prim::TensorExprGroup": "NNC",
    "prim::CudaFusionGroup": "nvFuser",
    "prim::FusionGroup": "legacy fuser",
    "prim::oneDNNFusionGroup": "oneDNN Graph",
}

_cache = CompiledCache(lambda: CACHE_LIMIT)
_graphs: Counter[str] = Counter()  # device type -> graphs run (warm-ups observed)
_fused: dict[str, Counter[str]] = {}  # device type -> fuser name -> graphs it fused


def _torchscript(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> torch.jit.ScriptModule:
    from torch._functorch.compile_utils import strip_overloads

    strip_overloads(gm)  # TorchScript resolves aten::op overloads itself
    for node in gm.graph.nodes:  # torch.device literals are not TorchScript; "cuda:1" strings are
        node.kwargs = {k: str(v) if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
    gm.recompile()
    return torch.jit.script(gm)


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    from functorch.compile import make_boxed_compiler, memory_efficient_fusion

    script = make_boxed_compiler(_torchscript)
    return memory_efficient_fusion(fn, fw_compiler=script, bw_compiler=script)


def signature(*tensors: Optional[Tensor]) -> tuple:
    """What a traced graph is specialized to: each tensor's shape, strides, dtype and device."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def run(key: tuple, fn: Callable[..., Any], *args: Optional[Tensor]) -> Any:
    """``fn(*args)`` through the function compiled for ``key``, compiling it on first use.

    ``key`` must determine everything ``fn`` specializes on: the caller includes ``signature(*args)``
    and every Python value ``fn`` closes over. Runs without autograd: forward and backward are
    compiled as separate functions.
    """
    return _cache.run(key, args, lambda: _compile_and_run(fn, args))


def _compile_and_run(fn: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], Any]:
    """A signature's first call, under the compile lock: compiles it and warms it up; (the compiled
    function, its output)."""
    compiled = _compile(fn)
    # TorchScript warns that it is deprecated at every script call; those warnings concern this
    # backend, not the user's code. The profiling executor records the first run and fuses on the
    # second, so two runs here leave the fused graph in place.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(*args)
        out = compiled(*args)
        _observe(next(a.device.type for a in args if a is not None))
    return compiled, out


def _observe(device_type: str) -> None:
    graph = torch.jit.last_executed_optimized_graph()
    _graphs[device_type] += 1
    fused = _fused.setdefault(device_type, Counter())
    for kind, fuser in FUSION_GROUPS.items():
        if graph.findAllNodes(kind):
            fused[fuser] += 1


def configured_fuser(device_type: str) -> str:
    """The fuser TorchScript is set to use on this device type: NNC (TensorExpr) or none.

    nvFuser left TorchScript in PyTorch 2.2; ``torch._C._jit_set_nvfuser_enabled`` is a no-op that
    only warns, so it is never called here.
    """
    if not torch._C._jit_texpr_fuser_enabled():
        return "none"
    if device_type == "cuda":
        return "NNC" if torch._C._jit_can_fuse_on_gpu() else "none"
    return "NNC" if torch._C._jit_can_fuse_on_cpu() else "none (NNC's CPU fusion is off)"


def observed_fusers(device_type: str) -> tuple[int, dict[str, int]]:
    """(graphs warmed up on this device type, {fuser: graphs it fused})."""
    return _graphs[device_type], dict(_fused.get(device_type, {}))


def fuser_summary(device_type: str) -> str:
    """``NNC (fused 5 of 6 graphs)`` once graphs ran on this device type, else the configured fuser."""
    graphs, fused = observed_fusers(device_type)
    if not graphs:
        return configured_fuser(device_type)
    if not fused:
        return f"none (0 of {graphs} graphs fused)"
    return ", ".join(f"{name} (fused {n} of {graphs} graphs)" for name, n in fused.items())


def cache_info() -> CacheInfo:
    return _cache.info()


def clear_cache() -> None:
    _cache.clear()
