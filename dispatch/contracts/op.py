"""What an op is, as the dispatcher, the backends, the calibrator and the tables agree on it.

An op is one ``OpSpec`` (``dispatch/ops/<op>.py``): its argument checks, which produce one typed call
object (an ``OpCall``), the traits its decisions and table key on, the reference math, the
plain-PyTorch baseline, how a call runs on a backend's kernels, and its calibration inputs. Backends
give each op they implement one kernels object; the spec says how to call it. Imports nothing of ours
but the other contracts.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from dispatch.contracts.backend import Call, Kernels

P_DROPOUT = 0.1  # the p of every calibrated dropout case: a cost does not depend on p, 0.1 is common


class OpCall:
    """One checked call of an op: what its decision keys on (``call``) and its arguments. Each op
    subclasses it with its own tensors and parameters. ``special``: a call no kernel should see
    (``OpSpec.special`` answers it)."""

    __slots__ = ("call", "special")

    def __init__(self, call: Call, special: bool = False) -> None:
        self.call = call
        self.special = special


@dataclass(frozen=True)
class Case:
    """One shape of one op as the calibrator and parity run it, with the values of the traits its op
    declares (``traits``, ``OpSpec.traits``): ``variant`` for the one the calibrator's series run over
    (``OpSpec.variant``: an activation; None for an op without one), ``dropout`` for the dropout trait
    (False for an op without it); ``features`` are the decision dims after M ((N,) or (N, K)); ``p`` the
    dropout probability of a dropout case. ``dispatch.cases.case`` makes one from the op's name."""

    op: str
    dtype: torch.dtype
    variant: Optional[str]
    training: bool  # forward + backward; inference is the forward under no_grad
    dropout: bool
    m: int
    features: tuple[int, ...]
    device: torch.device
    traits: tuple[str, ...]  # the op's (``OpSpec.traits``): what its call carries

    def call(self) -> Call:
        """The case as a call, holding the op's traits and no other."""
        values = tuple(self.dropout if t == "dropout" else self.variant for t in self.traits)
        shape = (self.m, *self.features)
        return Call(self.op, self.device, self.dtype, shape, self.training, self.traits, values)

    @property
    def activation(self) -> Optional[str]:
        """The case's activation, None where its op takes none."""
        return self.variant if "activation" in self.traits else None

    @property
    def p(self) -> float:
        return P_DROPOUT if self.dropout else 0.0

    @property
    def seed(self) -> int:
        import zlib

        return zlib.crc32(repr(self).encode())


@dataclass
class Inputs:
    """A case's random inputs: the op's tensors in argument order, the upstream gradient (a tuple of
    one per output for an op of several) and the seed of the dropout generator."""

    tensors: list[Tensor]
    grad_y: Tensor | tuple[Tensor, ...]
    seed: int

    @property
    def grads(self) -> tuple[Tensor, ...]:
        """The upstream gradients, one per output."""
        return self.grad_y if isinstance(self.grad_y, tuple) else (self.grad_y,)


def outputs_of(out: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """An op's result as a tuple of its outputs (y alone, or y and the others)."""
    return out if isinstance(out, tuple) else (out,)


@dataclass(frozen=True)
class Grid:
    """What the calibrator measures of an op on one device class: feature sizes in priority order,
    the classes of its variant trait's values that share one timing, and the work cap of a point."""

    features: tuple[tuple[int, ...], ...]  # full runs, priority order
    quick: dict[str, tuple[tuple[int, ...], ...]]  # device type -> a quick run's sizes
    classes: tuple[tuple[str, ...], ...]  # the variant's values (activations) of a class share one timing
    gemm: bool  # a point's cap counts multiply-adds (M*N*K), else elements (M*N)
    check_work: int  # the largest M*prod(features) a parity check runs at (the float64 reference)
    families: tuple[tuple[str, bool], ...]  # (mode, dropout) in the scheduler's priority order
    # parity's shapes (M, *features) by device type, the first for --quick; odd sizes catch masking
    # bugs at block edges, CPU ones stay small for Triton's interpreter
    parity: dict[str, tuple[tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)
    # what a training run returns: the op's outputs (y, ...), then each input's gradient ("grad_...")
    outputs: tuple[str, ...] = ("y",)


class OpSpec:
    """One op. Subclasses fill the attributes and implement the methods; ``dispatch.ops.register``
    makes an instance known to the dispatcher, the calibrator and the tables."""

    name: str  # the op's name in tables, backends and explain()
    public_name: str  # the public function's name (the first, where the op has several)
    dims: tuple[str, ...]  # the decision shape's dims, M first: ("M", "N") or ("M", "N", "K")
    # What a call holds past its sizes, dtype and mode, which its decision and table entries key on
    # (a table entry's field each): "activation", "dropout" (p > 0 in training) or the op's own.
    traits: tuple[str, ...] = ()
    # Fields a table entry of the op holds past its traits, keying nothing: fused_linear's "dropout",
    # false in every entry, as tables were written before ops declared their traits.
    entry_extras: tuple[str, ...] = ()
    activations: tuple[str, ...] = ()  # the activations calls take (the calibrator's classes)
    grid: Grid

    @property
    def public_names(self) -> tuple[str, ...]:
        """The op's public functions' names: ``public_name``; an op with several lists them here (each a
        function of that name in its spec's module, its arguments checked by ``parse_for``)."""
        return (self.public_name,)

    @property
    def feature_dims(self) -> int:
        return len(self.dims) - 1

    @property
    def dropout(self) -> bool:
        """Whether calls may drop out: the op declares the dropout trait."""
        return "dropout" in self.traits

    @property
    def variant(self) -> Optional[str]:
        """The trait the calibrator's series and parity's cases run over, its values grouped by
        ``grid.classes``: the op's one trait past dropout (an activation), None for an op with none (one
        series a family). An op with two such traits could not be calibrated: a ValueError."""
        rest = [t for t in self.traits if t != "dropout"]
        if len(rest) > 1:
            raise ValueError(f"{self.name} declares the traits {rest}: calibration takes one, and dropout")
        return rest[0] if rest else None

    def variants(self) -> tuple[Optional[str], ...]:
        """The variant trait's values calls take (its activations for an activation; an op with another
        variant overrides this), (None,) for an op without a variant."""
        return (None,) if self.variant is None else self.activations

    def call(self, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], training: bool,
             **traits: Any) -> Call:  # fmt: skip
        """A call of this op, its traits by name: ``fused_linear``'s ``call(..., activation="gelu")``
        (a spec's own ``parse`` builds its calls without this frame: it runs every call)."""
        if traits.keys() != set(self.traits):
            raise ValueError(f"{self.name} calls take the traits {self.traits}, got {tuple(traits)}")
        values = tuple(traits[t] for t in self.traits)
        return Call(self.name, device, dtype, shape, training, self.traits, values)

    def function(self, public_name: Optional[str] = None) -> Callable[..., Any]:
        """The public function named ``public_name`` (default the first) in the spec's module."""
        return getattr(sys.modules[type(self).__module__], public_name or self.public_name)

    def parse(self, *args: Any, **kwargs: Any) -> OpCall:
        """The checked call: raises a clear error naming the first bad argument."""
        raise NotImplementedError

    def parse_for(self, public_name: str, *args: Any, **kwargs: Any) -> OpCall:
        """The checked call of the public function ``public_name``, on its arguments: ``parse`` where the
        op has one public function."""
        return self.parse(*args, **kwargs)

    def runner(self, kernels: Any, call: Call) -> Callable[[OpCall], Tensor]:
        """How calls like ``call`` run on ``kernels`` (resolved once per decision)."""
        raise NotImplementedError

    def special(self, c: OpCall, backend: Optional[str]) -> Optional[Tensor]:
        """The result of a call no kernel should see (bias_act_dropout's p == 1), else None."""
        return None

    def traced(self, c: OpCall, backend: Optional[str], inline: bool) -> Tensor:
        """The call under torch.compile: plain math inductor fuses (``inline``), or a custom op."""
        raise NotImplementedError

    def baseline_kernels(self) -> Kernels:
        """The baseline as kernels (the pytorch backend's): torch's autograd, torch's masks."""
        raise NotImplementedError

    def reference_kernels(self) -> Optional[Kernels]:
        """The reference as kernels, for the eager backend where it has no kernel file of this op."""
        return None

    # calibration and parity: one case's inputs, a run through the public op, the float64 reference

    def inputs(self, case: Case, seed: int) -> Inputs:
        raise NotImplementedError

    def run_case(
        self, case: Case, leaves: Sequence[Tensor], backend: Optional[str], seed: Optional[int]
    ) -> Tensor | tuple[Tensor, ...]:
        """The op on ``leaves`` through its public function (``backend=None``: the baseline composite),
        dropout from a generator seeded by ``seed`` (a parity run), or the default one (``seed`` None: a
        timed run, which a CUDA graph can capture; a generator built inside a capture cannot be)."""
        raise NotImplementedError

    def reference_case(
        self, case: Case, leaves: Sequence[Tensor], seed: int, torch_masks: bool = False
    ) -> Tensor | tuple[Tensor, ...]:
        """The reference on ``leaves`` with the mask the case's run drew from its seeded generator: the
        spec's, or with ``torch_masks`` torch's (replayed by ``torch_keep``)."""
        raise NotImplementedError


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The math dtype of PyTorch-op kernels: float32 for half inputs (PyTorch's opmath), else x's own."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def differentiable_grads(
    make_y: Callable[[], Tensor], inputs: tuple, needs: tuple, grad_y: Tensor
) -> tuple[Optional[Tensor], ...]:
    """A backward with ``create_graph=True``: the gradients of the reference ``make_y()`` in ``inputs``
    with a graph, so that they are differentiable again (a kernel's numbers would drop the
    second-order terms). None where an input is None or needs no gradient."""
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    if not wanted:
        return (None,) * len(inputs)
    y = make_y()
    found = iter(torch.autograd.grad(y, wanted, grad_y.to(y.dtype), create_graph=True, allow_unused=True))
    return tuple(next(found) if need and t is not None else None for t, need in zip(inputs, needs))


def torch_keep(shape: Sequence[int], dtype: torch.dtype, device: torch.device, p: float,
               generator: torch.Generator) -> Tensor:  # fmt: skip
    """The mask the baseline draws from a caller's generator: bernoulli(1 - p) in the output's dtype,
    in logical order whatever x's strides; a generator seeded alike replays it (parity checks do)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device).bernoulli_(1.0 - p, generator=generator)


def torch_keep_scale(p: float) -> float:
    """F.dropout's factor on the elements torch's mask keeps, 1 / (1 - p) (0 at p = 1: all dropped);
    the spec's is ``rng.keep_scale``, 65536 / (65536 - T), which differs by up to 2**-16 relative."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
