"""Which backend runs a call: the ``backend=`` argument > ``use_backend()`` > ``DISPATCH_BACKEND`` >
the heuristic table of this GPU > the first able backend in the backends' order (``Backend.order``:
plain PyTorch first) where no table answers or its pick cannot serve the call.

Decisions are cached per call signature (``key``), so the steady-state cost is one dictionary lookup.
``DISPATCH_BACKEND`` is read at import; after changing it in a running process, call ``clear_cache()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Union

import torch
from torch import Tensor

from dispatch import heuristics
from dispatch.contracts.backend import Kernels
from dispatch.contracts.op import OpCall, OpSpec
from dispatch.registry import Backend, Call, backends, get

ENV_VAR = "DISPATCH_BACKEND"
_ARGUMENT, _CONTEXT = "the backend= argument", "use_backend()"  # the other two sources of a request
_CACHE_LIMIT = 4096

_requested: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("dispatch_backend", default=None)


class Request(NamedTuple):
    """A call and what asked for a backend for it: the key of a decision that is not the table's (or
    ``DISPATCH_BACKEND``'s) alone."""

    call: Call
    argument: Optional[str]  # the backend= argument
    context: Optional[str]  # use_backend()'s backend, where no argument names one
    by_table: bool  # a call of a backend chaining the ops: the table alone decides (``table_key``)


# A decision's key: the call itself where nothing asked for a backend (``DISPATCH_BACKEND`` and
# ``spec_masks`` need no field: changing them empties the cache), else a Request.
Key = Union[Call, Request]
_new = tuple.__new__  # a Request without NamedTuple's __new__, one Python frame more
_cache: dict[Key, "Decision"] = {}
# The same keys -> what runs such calls: the spec's runner over the chosen backend's kernels.
_impls: dict[Key, object] = {}
# A call -> the kernels a compiled graph's custom op runs it on, where the decision's take no spec rng.
_spec_kernels: dict[Call, Kernels] = {}
# Read at import and by clear_cache(), not per call: os.environ.get of an unset variable costs ~1 us
# (a KeyError raised and caught inside os.environ).
_env_backend: Optional[str] = os.environ.get(ENV_VAR) or None


@dataclass(frozen=True)
class Decision:
    """Which backend serves ``call``, by which rule, and why the others could not."""

    call: Call
    backend: Backend
    rule: str
    reasons: Mapping[str, list[str]]  # every registered backend -> why it cannot serve ([] if it can)
    # what runs instead while the current CUDA stream is capturing a graph, and why (None: the same)
    captured: Optional[Backend] = None
    captured_rule: str = ""

    def __str__(self) -> str:
        lines = [f"{self.call}", f"  runs on: {self.backend.display_name()}", f"  because: {self.rule}"]
        if self.captured_rule:
            name = (self.captured or self.backend).display_name()
            lines.append(f"  while a CUDA graph is captured: {name}, {self.captured_rule}")
        if self.call.dropout:
            masks = (
                "torch's RNG (as nn.Dropout)" if self.backend.torch_masks else "dispatch.contracts.rng's spec"
            )
            lines.append(f"  dropout mask: {masks}")
        for name, why in self.reasons.items():
            if name != self.backend.name:
                lines.append(f"  {name}: {'; '.join(why) if why else 'could run, not chosen'}")
        return "\n".join(lines)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, every call goes to backend ``name`` (unless a call passes ``backend=``)."""
    get(name)
    token = _requested.set(name)
    try:
        yield
    finally:
        _requested.reset(token)


def key(call: Call, backend: Optional[str]) -> Key:
    """The cache key of a decision for ``call`` with the ``backend=`` argument ``backend``. The one
    place keys are made, with ``table_key``."""
    if backend is not None:
        return _new(Request, (call, backend, None, False))
    context = _requested.get()
    return call if context is None else _new(Request, (call, None, context, False))


def table_key(call: Call) -> Key:
    """The key of a call that a backend chaining the ops makes (composed's sub-calls): decided by the
    table alone, whatever ``use_backend()`` or ``DISPATCH_BACKEND`` name (they named that backend),
    dropout on the spec's masks whatever ``spec_masks()`` says."""
    return _new(Request, (call, None, None, True))


@dataclass(frozen=True)
class _ByCapture:
    """A key's two runners where the decision names another backend for CUDA-graph capture."""

    host: object
    captured: object


def runner(key: Key, spec: OpSpec) -> Callable[[OpCall], Tensor]:
    """What calls of ``key`` run: ``spec.runner`` of the chosen backend's kernels, made once per key.
    A dictionary lookup once decided; where the decision has a backend for capture, one more question
    (``capturing``)."""
    impl = _impls.get(key)
    if impl is None:
        found = decision(key)
        call = key.call if type(key) is Request else key
        impl = spec.runner(found.backend.kernels_for(call.op), call)
        if found.captured is not None:
            prepare_capture(found, call)
            impl = _ByCapture(impl, spec.runner(found.captured.kernels_for(call.op), call))
        _impls[key] = impl
    if type(impl) is _ByCapture:
        return impl.captured if capturing() else impl.host  # type: ignore
    return impl  # type: ignore[return-value]  # the value in hand: another thread may have cleared the caches


def prepare_capture(found: Decision, call: Call) -> None:
    """Where ``found`` names a backend for calls under CUDA-graph capture, what that backend does ahead
    for such calls (``Kernels.prepare``), called as the decision is first used: a warm-up's call is
    eager, where the capture's first call could not plan or allocate."""
    kernels = found.captured.kernels_for(call.op) if found.captured is not None else None
    if kernels is not None and kernels.prepare is not None:
        kernels.prepare(call)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph. CUDA captures only on a stream other than
    the legacy default one (id 0), so on that one the driver is not asked: its
    ``cudaStreamIsCapturing`` cost ~14 us of host time a call with kernels queued on the H200's host
    (0.5 us on the H100's)."""
    if _current_stream is None or _current_device is None:
        return False  # a CPU-only build: nothing to capture on
    try:
        if _current_stream(_current_device())[0] == 0:
            return False
    except RuntimeError:  # CUDA not initialized here: torch answers that too
        pass
    return torch.cuda.is_current_stream_capturing()


# (stream id, device index, device type) of the current stream; absent from CPU-only builds
_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def kernels(call: Call, backend: Optional[str]) -> Kernels:
    """The kernels that serve ``call`` as a custom op of a compiled graph runs it. The graph drew the
    spec's rngs and keeps the op's saved tensors, so where the decision names kernels that cannot
    take them (torch's masks, whose composite keeps nothing for a backward of its own; a chaining
    backend's, which take a generator) the first able backend in the backends' order whose kernels
    can serve it (the reference, eager)."""
    found = decision(key(call, backend)).backend.kernels_for(call.op)
    if found.masks == "spec":
        return found
    fallback = _spec_kernels.get(call)
    if fallback is None:
        able = (get(n).kernels_for(call.op) for n, why in _reasons(call, None, backends()).items() if not why)
        fallback = next((k for k in able if k is not None and k.masks == "spec"), None)
        if fallback is None:
            raise ValueError(f"no backend can run {call} on the spec's dropout masks")
        _spec_kernels[call] = fallback  # once per call signature, as decisions are
    return fallback


def decision(key: Key) -> Decision:
    """The cached decision for ``key`` (made by ``key()``); a miss decides."""
    found = _cache.get(key)
    if found is None:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
            _impls.clear()
            _spec_kernels.clear()
            _new_generation()
        if type(key) is not Request:
            found = decide(key, *_request(None, None))
        elif key.by_table:
            found = decide(key.call, None, spec_masks=True)
        else:
            found = decide(key.call, *_request(key.argument, key.context))
        _cache[key] = found
    return found


def _request(argument: Optional[str], context: Optional[str]) -> tuple[Optional[str], str]:
    """The backend asked for, and by what: the argument > use_backend() > DISPATCH_BACKEND."""
    if argument is not None:
        return argument, _ARGUMENT
    if context is not None:
        return context, _CONTEXT
    return _env_backend, ENV_VAR


def explain_call(call: Call, backend: Optional[str]) -> Decision:
    """The uncached decision for ``call`` with the ``backend=`` argument ``backend``."""
    return decide(call, *_request(backend, _requested.get()))


def clear_cache() -> None:
    """Forgets every cached decision and re-reads ``DISPATCH_BACKEND``."""
    global _env_backend
    _cache.clear()
    _impls.clear()
    _spec_kernels.clear()
    _new_generation()
    _env_backend = os.environ.get(ENV_VAR) or None


def _new_generation() -> None:
    """The caches were emptied: every ``Memo`` decides again, every armed module (``plain_token``) too."""
    global _plain_token
    _plain_token = object()
    _plain_only.clear()


# The caches' generation, replaced whenever they are emptied (clear_cache, spec_masks, a full cache):
# memos compare it, and a module armed with it (``memo.plain_token``) runs its own forward with no
# decision per call while it is this object.
_plain_token = object()
_plain_only: dict[tuple, bool] = {}  # (op, device, traits) -> whether plain PyTorch is the only pick


def cached_calls() -> list[Call]:
    """The calls decided (or given a runner) since the last ``clear_cache()``, each once."""
    keys = (*tuple(_cache), *tuple(_impls))  # copies: no lock
    return list(dict.fromkeys([*(k.call if type(k) is Request else k for k in keys), *tuple(_spec_kernels)]))


class spec_masks:  # noqa: N801  (a function to its callers, as use_backend)
    """Every dropout call then draws its mask by ``dispatch.contracts.rng``'s spec (identical on every
    backend, regenerated in backward, never stored): backends whose masks come from torch's RNG
    (pytorch) no longer serve dropout calls. Off by default: the spec costs eager's and the compiled
    backends' dropout a traced Philox. ``spec_masks()`` switches it on for the process (``spec_masks(False)``
    off); ``with spec_masks():`` for the block only, the setting before it restored at its end."""

    def __init__(self, required: bool = True) -> None:
        self.previous = _set_spec_masks(bool(required))

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _set_spec_masks(self.previous)


def _set_spec_masks(required: bool) -> bool:
    """Sets the switch (emptying the decision caches where it changes); returns the setting before."""
    global _spec_masks
    previous, _spec_masks = _spec_masks, required
    if previous != required:
        _cache.clear()
        _impls.clear()
        _new_generation()
    return previous


_spec_masks = False


def env_backend() -> Optional[str]:
    """The backend named by ``DISPATCH_BACKEND`` as last read (at import or by ``clear_cache()``)."""
    return _env_backend


_warned: set[tuple[str, str]] = set()
_warn_lock = threading.Lock()


def _warn_unknown(choice: "heuristics.Choice") -> None:
    """One warning per table and unknown backend name (a table from a newer or forked version)."""
    table = choice.description.split(":", 1)[0]  # "heuristics table <slug> (<path>)"
    with _warn_lock:
        if (table, choice.backend) in _warned:
            return
        _warned.add((table, choice.backend))
    warnings.warn(
        f"{table} names backend {choice.backend!r}, which is not registered here "
        f"({', '.join(backends())}); its calls run on the first able backend instead",
        heuristics.HeuristicsWarning,
        stacklevel=4,
    )


def capture_pick(
    choice: "heuristics.Choice", reasons: Mapping[str, list[str]]
) -> tuple[Optional[Backend], str]:
    """The backend for calls captured in a CUDA graph where the table's cell is host-bound and another
    backend wins on GPU time alone (a captured call's host cost is paid once, at capture), and the
    words explain() prints. None where that backend cannot serve the call or would compile inside the
    capture on its first call."""
    name = choice.gpu_backend
    if name is None:
        return None, ""
    found = backends().get(name)
    if found is None or reasons.get(name):
        return None, f"as outside it ({name}, faster by GPU time alone, cannot serve this call)"
    if found.compiles:
        return None, f"as outside it ({name}, faster by GPU time alone, would compile inside the capture)"
    return found, "the fastest by GPU time alone: a captured call's host cost is paid once, at capture"


def _first_able(reasons: Mapping[str, list[str]]) -> Optional[str]:
    """The first backend in the backends' order (``Backend.order``) that can serve the call: plain
    PyTorch, then the reference, then the fused kernels."""
    return next((name for name, why in reasons.items() if not why), None)


def _reasons(
    call: Call, requested: Optional[str], everyone: Mapping[str, Backend], spec_masks: bool = False
) -> dict[str, list[str]]:
    reasons = {
        name: b.not_supported_reasons(call, explicit=(name == requested)) for name, b in everyone.items()
    }
    if (_spec_masks or spec_masks) and call.dropout:
        for name, b in everyone.items():
            if b.torch_masks and not reasons[name]:
                reasons[name] = [
                    f"{name} draws dropout masks from torch's RNG; dispatch.spec_masks() asks for the spec's"
                ]
    return reasons


def decide(call: Call, requested: Optional[str], source: str = "", spec_masks: bool = False) -> Decision:
    """The uncached decision (``explain`` and cache misses); ``spec_masks``: as under ``spec_masks()``."""
    everyone = backends()
    if requested is not None and requested not in everyone:
        raise ValueError(f"backend must be one of {', '.join(everyone)}; got {requested!r} (from {source})")
    reasons = _reasons(call, requested, everyone, spec_masks)
    if requested is not None:
        if reasons[requested]:
            raise ValueError(
                f"backend {requested!r} (from {source}) cannot run {call}: {'; '.join(reasons[requested])}"
            )
        return Decision(call, everyone[requested], f"requested by {source}", reasons)
    first = _first_able(reasons)
    if first is None:
        listing = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in reasons.items())
        raise ValueError(f"no backend can run {call}:\n{listing}")
    if 0 in call.shape:
        return Decision(call, everyone[first], "empty input: the first able backend returns it", reasons)
    choice = heuristics.lookup(call)
    if choice is None:
        return Decision(
            call, everyone[first], f"{heuristics.why_no_choice(call)}; the first able backend: {first}", reasons
        )
    if choice.backend in everyone and not reasons[choice.backend]:
        # only a CUDA call can be captured (and a CPU-only torch cannot even be asked)
        captured, why = capture_pick(choice, reasons) if call.device.type == "cuda" else (None, "")
        return Decision(call, everyone[choice.backend], choice.description, reasons, captured, why)
    if choice.backend not in everyone:  # a newer or forked table
        _warn_unknown(choice)
        rule = f"table chose {choice.backend!r}, which is not a registered backend; default {first}"
    else:
        rule = f"table chose {choice.backend}, which cannot serve it; default {first}"
    return Decision(call, everyone[first], rule, reasons)
