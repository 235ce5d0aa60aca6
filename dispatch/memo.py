"""What a module of ``dispatch.nn`` keeps of its decisions: its last one (``Memo``), and where plain PyTorch
is its only pick, the token with which it skips deciding (``plain_token``)."""

from __future__ import annotations

from typing import Callable, Optional

from dispatch import heuristics, select
from dispatch.contracts.backend import Call
from dispatch.select import Decision, _requested


class Memo:
    """A module's last decision, for modules that run their own PyTorch where plain PyTorch is picked
    (``dispatch.nn``): ``plain(probe, make_call)`` decides again only when ``probe`` (what the module's
    call key is made of: shape, dtype, device, grad, mode), the ``use_backend`` request or the caches'
    generation changed; a decision made keeps ``plain_token``'s token (``token``), with which the
    module skips the memo while plain PyTorch is its only pick. Building a call's key and looking it up
    costs ~2.5 us a call on a 2-core CPU, a repeated probe ~0.5 us. The probe and its decision are one
    tuple, replaced whole (threads calling one module never pair a probe with another's decision).
    Copies and pickles start empty."""

    __slots__ = ("entry", "token")

    def __init__(self) -> None:
        self.entry: Optional[tuple[tuple, Decision]] = None
        self.token: Optional[object] = None  # plain_token's, set where a decision is made

    @property
    def found(self) -> Optional[Decision]:
        """The decision kept, if any."""
        return None if self.entry is None else self.entry[1]

    def plain(self, probe: tuple, make_call: Callable[[], Call]) -> bool:
        """Whether calls like ``make_call()``'s, with no backend argument, run on plain PyTorch (the
        pytorch backend) by the current request, table and capture state."""
        probe = (probe, _requested.get(), select._generation)
        entry = self.entry
        if entry is None or entry[0] != probe:
            call = make_call()
            entry = self.entry = (probe, select.decision(select.key(call, None)))
            plain = entry[1].backend.name == "pytorch" and entry[1].captured is None
            self.token = plain_token(call) if plain else None
        found = entry[1]
        if found.captured is not None and select.capturing():
            return found.captured.name == "pytorch"
        return found.backend.name == "pytorch"

    def __deepcopy__(self, memo: dict) -> "Memo":
        return Memo()

    def __reduce__(self) -> tuple:
        return (Memo, ())


def plain_token(call: Call) -> Optional[object]:
    """The token (``_plain_token``) a module may keep to run plain PyTorch with no decision per call, or
    None. It is given where nothing asks for a backend (no ``use_backend()``, ``DISPATCH_BACKEND`` or
    ``spec_masks()``) and every call of ``call``'s op and traits (its dropout aside) on its device is
    decided plain PyTorch whatever its shape, dtype, mode or dropout, in a CUDA graph too: no table
    serves the device, or every segment of its entries for them names pytorch by both clocks. A module
    keeps it while it is ``select._plain_token`` and no ``use_backend()`` is entered (two identity
    tests a call), and drops it when its parameters move (``_apply``). Plain PyTorch is the module's
    own forward, correct on every call: a token kept too long costs speed, never a result."""
    if select.env_backend() is not None or select._spec_masks or _requested.get() is not None:
        return None
    token = select._plain_token  # the one the answer is made under, should another thread empty the caches
    traits = tuple((n, v) for n, v in zip(call.traits, call.values) if n != "dropout")  # the mode's
    k = (call.op, call.device, traits)
    only = select._plain_only.get(k)
    if only is None:
        named = heuristics.backends_named(call.op, call.device, dict(traits))
        only = select._plain_only[k] = named <= {"pytorch"}
    return token if only else None
