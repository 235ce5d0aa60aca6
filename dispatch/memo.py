"""What a module of ``dispatch.nn`` keeps of its decisions: its last one (``Memo``); where plain PyTorch
is its only pick, the token with which it skips deciding (``plain_token``); where plain PyTorch is its
pick over a range of sizes, that range (``plain_span``)."""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from dispatch import heuristics, select
from dispatch.contracts.backend import Call
from dispatch.select import Decision, _requested


class Memo:
    """A module's last decision, for modules that run their own PyTorch where plain PyTorch is picked
    (``dispatch.nn``): ``plain(of_x, state, make_call)`` decides again only when ``of_x`` (x's shape,
    or shape, dtype and device), ``state`` (the rest of what the module's call key is made of: grad,
    mode, autocast), the ``use_backend`` request or the caches' generation (``select._plain_token``)
    changed. A decision for plain PyTorch keeps ``plain_token``'s token (``token``: the module skips
    the memo while plain PyTorch is its only pick) and ``plain_span``'s span (``span``: the module
    skips the memo for an x of that state whose size falls in the table segment the decision came
    from; ``spans`` tests it).
    Building a call's key and looking it up costs ~2.5 us a call on a 2-core CPU, a repeated probe
    ~0.5 us, the span's test ~0.2. The probe and its decision are one tuple, replaced whole (threads
    calling one module never pair a probe with another's decision). Copies and pickles start empty."""

    __slots__ = ("entry", "token", "span")

    def __init__(self) -> None:
        self.entry: Optional[tuple[tuple, Decision]] = None
        self.token: Optional[object] = None  # plain_token's, set where a decision is made
        self.span: Optional[tuple] = None  # plain_span's, set where a decision is made

    @property
    def found(self) -> Optional[Decision]:
        """The decision kept, if any."""
        return None if self.entry is None else self.entry[1]

    def spans(self, x: Tensor, state: tuple) -> bool:
        """Whether x of ``state`` falls in the span of the last plain decision, with no ``use_backend()``
        request: then the module runs plain PyTorch without deciding."""
        span = self.span
        return (span is not None and span[0] is select._plain_token and span[1] <= x.numel() < span[2]
                and span[3] == state and _requested.get() is None
                and not (span[4] and select.capturing()))  # fmt: skip

    def plain(self, of_x: tuple, state: tuple, make_call: Callable[[], Call]) -> bool:
        """Whether calls like ``make_call()``'s, with no backend argument, run on plain PyTorch (the
        pytorch backend) by the current request, table and capture state."""
        token = select._plain_token  # the caches' generation: a decision that empties them makes a new
        # one, and what was kept under the old one goes unused
        probe = (of_x, state, _requested.get(), token)
        entry = self.entry
        if entry is None or entry[0] != probe:
            call = make_call()
            entry = self.entry = (probe, select.decision(select.key(call, None)))
            select.prepare_capture(entry[1], call)
            plain = entry[1].backend.name == "pytorch"
            self.token = plain_token(call, token) if plain and entry[1].captured is None else None
            self.span = plain_span(call, state, token, entry[1]) if plain and probe[2] is None else None
        found = entry[1]
        if found.captured is not None and select.capturing():
            return found.captured.name == "pytorch"
        return found.backend.name == "pytorch"

    def __deepcopy__(self, memo: dict) -> "Memo":
        return Memo()

    def __reduce__(self) -> tuple:
        return (Memo, ())


def plain_token(call: Call, token: object) -> Optional[object]:
    """``token`` (``select._plain_token`` as the decision on ``call`` began), which a module may keep to run
    plain PyTorch with no decision per call, or None. It is given where nothing asks for a backend (no
    ``use_backend()``, ``DISPATCH_BACKEND`` or ``spec_masks()``) and every call of ``call``'s op and traits
    (its dropout aside) on its device is decided plain PyTorch whatever its shape, dtype, mode or dropout, in
    a CUDA graph too: no table serves the device, or every segment of its entries for them names pytorch by
    both clocks. A module keeps it while it is ``select._plain_token`` and no ``use_backend()`` is entered
    (two identity tests a call), and drops it when its parameters move (``_apply``). Plain PyTorch is the
    module's own forward, correct on every call: a token kept too long costs speed, never a result."""
    if select.env_backend() is not None or select._spec_masks or _requested.get() is not None:
        return None
    traits = tuple((n, v) for n, v in zip(call.traits, call.values) if n != "dropout")  # the mode's
    k = (call.op, call.device, traits)
    only = select._plain_only.get(k)
    if only is None:
        named = heuristics.backends_named(call.op, call.device, dict(traits))
        only = select._plain_only[k] = named <= {"pytorch"}
    return token if only else None


def plain_span(call: Call, state: tuple, token: object, found: Decision) -> tuple:
    """(token, lo, hi, state, captured): ``found``, a decision for plain PyTorch on ``call`` made with
    no ``use_backend()`` request, holds for every x of the same ``state`` with lo <= x.numel() < hi
    while ``token`` is ``select._plain_token`` (and, where ``captured`` says the decision names another
    backend for CUDA-graph capture, outside a capture): the table answers every token count of the
    segment ``call``'s came from (``heuristics.m_span``) from that segment, and x's rows hold
    call.shape[1] elements (a call's shape is (M, width of x, ...) for every module op). A module tests
    it before its memo: a size inside the span skips the call's key, and variable sequence lengths
    decide once a segment."""
    lo, hi = heuristics.m_span(call)
    row = call.shape[1]
    return token, lo * row, hi * row, state, found.captured is not None
