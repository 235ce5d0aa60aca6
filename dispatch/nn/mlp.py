"""``FusedMLP``: a whole MLP block in one ``fused_mlp`` call, over child linear layers it can adopt from
an existing block (``dispatch.patch``), running as that block's own module where plain PyTorch is
picked."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatch import select
from dispatch.api import fused_mlp
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS, GATED_NAMES, GATES
from dispatch.memo import Memo
from dispatch.nn.layers import FusedLinear, _autocast_dtype, _cast, _check_p, device_key, linear_layout
from dispatch.ops.fused_mlp import module_call

_compiling = torch.compiler.is_compiling
_requested = select._requested.get  # the use_backend() request, None outside one


def _features(layer: nn.Module, transposed: bool) -> tuple[int, int]:
    """(in, out) of a linear layer's weight."""
    rows, cols = layer.weight.shape
    return (rows, cols) if transposed else (cols, rows)


class FusedMLP(nn.Module):
    """Dropout_out(Dropout_p(act(x @ W_in.T + b_in)) @ W_out.T + b_out): an MLP block in one
    ``fused_mlp`` call.

    Equivalent PyTorch::

        nn.Sequential(nn.Linear(in_features, hidden_features, bias), act, nn.Dropout(p),
                      nn.Linear(hidden_features, out_features, bias), nn.Dropout(p_out))

    ``activation``: a name of ``dispatch.ACTIVATION_NAMES`` or a gate (swiglu, geglu, geglu_tanh,
    reglu: act(gate) * up, both (hidden,)). The projections are child modules with ``weight`` and
    ``bias``: ``fc1`` and ``fc2``, where for a gate ``fc1`` stacks [gate; up], gate rows first, in one
    (2 * hidden, in) weight (``gate_layout="stacked"``, Phi-3's gate_up_proj); or ``gate_proj``,
    ``up_proj`` and ``down_proj`` (``gate_layout="pair"``, LLaMA's). Fresh ones are ``nn.Linear``s with
    its initialization; with ``transposed=True`` ``FusedLinear(transposed=True)``s, weights stored
    (in, out) as Hugging Face's Conv1D stores them. ``from_linears`` builds the block over existing
    layers instead, adopting them by reference under their own names: the state_dict keeps its keys and
    loads both ways, which is how ``dispatch.patch`` rewrites GPT-2's, ViT's and LLaMA's MLPs.

    Dropout runs in training mode only (``module.training``), with ``fused_mlp``'s masks (by
    ``dispatch.contracts.rng``'s spec, regenerated in backward; the pytorch backend's are torch's).

    Where the dispatcher picks plain PyTorch (no table for this GPU, no cell for the call, or the table's
    pick), the block runs as its own module did: its layers called in the module's order (their hooks
    and autocast apply), the activation module it was built from (``activation_module``: the block's
    own, which ``dispatch.patch`` keeps) or the table's torch function, ``F.dropout``: the same kernels
    and saved tensors as the unpatched model, for the cost of one cached decision. ``explain(x)`` says
    which backend a call runs on and why.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: Optional[int] = None,
        activation: str = "gelu",
        p: float = 0.0,
        p_out: float = 0.0,
        bias: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        gate_layout: str = "stacked",
        transposed: bool = False,
    ) -> None:
        super().__init__()
        gated = _check_mlp_activation(activation)
        if gate_layout not in ("stacked", "pair"):
            raise ValueError(f"gate_layout must be 'stacked' or 'pair', got {gate_layout!r}")
        if type(transposed) is not bool:
            raise TypeError(f"transposed must be a bool, got {transposed!r}")
        out_features = in_features if out_features is None else out_features
        factory = {"bias": bias, "device": device, "dtype": dtype}

        def linear(n_in: int, n_out: int) -> nn.Module:
            if transposed:
                return FusedLinear(n_in, n_out, transposed=True, **factory)
            return nn.Linear(n_in, n_out, **factory)

        if gate_layout == "pair":
            if not gated:
                raise ValueError(f"gate_layout='pair' needs a gated activation ({', '.join(GATED_NAMES)}), "
                                 f"got {activation!r}")  # fmt: skip
            layers = {"gate_proj": linear(in_features, hidden_features),
                      "up_proj": linear(in_features, hidden_features),
                      "down_proj": linear(hidden_features, out_features)}  # fmt: skip
        else:
            f_in = 2 * hidden_features if gated else hidden_features
            layers = {"fc1": linear(in_features, f_in), "fc2": linear(hidden_features, out_features)}
        self._adopt(layers, activation, p, p_out)

    @classmethod
    def from_linears(
        cls,
        fc1: nn.Module | tuple[nn.Module, nn.Module],
        activation: str,
        fc2: nn.Module,
        p: float = 0.0,
        p_out: float = 0.0,
        *,
        names: Optional[Sequence[str]] = None,
        activation_module: Optional[nn.Module] = None,
    ) -> FusedMLP:
        """The block over existing linear layers (``nn.Linear``, Hugging Face's ``Conv1D``, a
        ``FusedLinear`` without activation or dropout), adopted by reference: the same modules, hence
        the same Parameters, registered under ``names`` in that order (default fc1, fc2; for a (gate,
        up) pair gate_proj, up_proj, down_proj), so ``<name>.weight`` keeps its key. ``fc1`` is one
        layer or, for a gated activation, a (gate, up) pair; all store their weights one way.
        ``activation_module``: the block's own activation (of the gate, for a gated one), which the
        block runs on plain PyTorch instead of the table's torch function; held, not registered."""
        gated = _check_mlp_activation(activation)
        inner = tuple(fc1) if isinstance(fc1, (tuple, list)) else (fc1,)
        if len(inner) == 2 and not gated:
            raise ValueError(f"fc1 may be a (gate, up) pair only for a gated activation, not {activation!r}")
        if len(inner) not in (1, 2):
            raise ValueError(f"fc1 must be a linear layer or a (gate, up) pair, got {len(inner)} layers")
        default = ("gate_proj", "up_proj", "down_proj") if len(inner) == 2 else ("fc1", "fc2")
        names = tuple(default if names is None else names)
        if len(names) != len(inner) + 1 or len(set(names)) != len(names):
            raise ValueError(f"names must be {len(inner) + 1} distinct child names, got {names!r}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._adopt(dict(zip(names, (*inner, fc2))), activation, p, p_out)
        if activation_module is not None:
            if not callable(activation_module):
                raise TypeError(f"activation_module must be a callable module, got {activation_module!r}")
            object.__setattr__(module, "_act_fn", activation_module)  # not a child: state_dict unchanged
        return module

    def _adopt(self, layers: dict[str, nn.Module], activation: str, p: float, p_out: float) -> None:
        """Registers ``layers`` (the input projection(s), then the output one) and the block's settings."""
        names = list(layers)
        layouts = {name: linear_layout(layer) for name, layer in layers.items()}
        for name, layout in layouts.items():
            if layout is None:
                raise TypeError(f"{name} must be an nn.Linear, a Conv1D or a FusedLinear without activation "
                                f"or dropout, got {type(layers[name]).__name__}")  # fmt: skip
        if len(set(layouts.values())) != 1:
            raise ValueError(f"the layers must store weights one way, (out, in) or (in, out): {layouts}")
        transposed = layouts[names[0]]
        n_in, f_in = _features(layers[names[0]], transposed)
        f, n_out = _features(layers[names[-1]], transposed)
        if len(layers) == 3:
            gate, up = (layers[n] for n in names[:2])
            if gate.weight.shape != up.weight.shape or (gate.bias is None) != (up.bias is None):
                raise ValueError(f"{names[0]} and {names[1]} must have one shape, and biases both or neither")
        elif activation in GATES:
            if f_in % 2:
                raise ValueError(f"{names[0]} must stack [gate; up] for {activation!r}: got {f_in} outputs")
            f_in //= 2
        if f_in != f:
            raise ValueError(f"{names[-1]} takes {f} features; the activation gives {f_in}")
        self.in_features, self.hidden_features, self.out_features = n_in, f, n_out
        self.activation = activation
        self.p, self.p_out = _check_p("p", p), _check_p("p_out", p_out)
        self.transposed = transposed
        self.gate_layout = "pair" if len(layers) == 3 else "stacked"
        self._in_names, self._out_name = tuple(names[:-1]), names[-1]
        for name, layer in layers.items():
            self.add_module(name, layer)
        object.__setattr__(self, "_act_fn", None)  # the table's torch function (a lambda: not kept, for pickle)
        object.__setattr__(self, "_memo", Memo())  # the last call's decision

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001  (nn.Module's signature)
        """Moving or casting the parameters drops the memo's plain token and span: the next call decides
        again."""
        self._memo.token = self._memo.span = None
        return super()._apply(fn, recurse)

    def _operand(self, name: str, dtype: Optional[torch.dtype]) -> tuple[Tensor, Optional[Tensor]]:
        """A projection's (weight (out, in), bias), cast to ``dtype`` first when autocast gives one."""
        layer = getattr(self, name)
        weight, bias = layer.weight, layer.bias
        if dtype is not None:
            weight, bias = _cast(weight, dtype), _cast(bias, dtype)
        return (weight.t() if self.transposed else weight), bias  # transposed after the cast, as FusedLinear

    def _grad(self, x: Tensor) -> bool:
        """Whether a call on x records a backward: grad mode on, and x or a parameter needs one."""
        return torch.is_grad_enabled() and (x.requires_grad or any(
            t is not None and t.requires_grad
            for layer in map(self._modules.__getitem__, (*self._in_names, self._out_name))
            for t in (layer.weight, layer.bias)
        ))  # fmt: skip

    def _call(self, x: Tensor, dtype: Optional[torch.dtype], grad: Optional[bool] = None):
        """The decision key of ``fused_mlp`` on x, made from the module's own settings (no checks)."""
        grad = self._grad(x) if grad is None else grad
        dropout = self.training and (self.p > 0.0 or self.p_out > 0.0)
        return module_call(x, dtype or x.dtype, self.hidden_features, self.activation, dropout, grad)

    def _width(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"x's last dimension must be in_features={self.in_features} of this FusedMLP, "
                f"got x of shape {tuple(x.shape)}"
            )
        return x

    def forward(self, x: Tensor) -> Tensor:
        # With the memo's plain token (``memo.plain_token``: plain PyTorch is the only pick on this
        # device) the block runs its own forward after two identity tests; with x's size in the span of
        # its last plain decision (``memo.plain_span``) after the state's: x's dtype and device are not
        # in it, since they must be the weights' (fixed until ``_apply`` drops the span) unless autocast
        # gives the dtype; a decision with another backend for CUDA-graph capture asks the capture
        # question too. Else the width is checked where a call's key is made: a probe the memo holds
        # passed it; x of another width, dtype or device inside a span or the token gets the module's
        # own error. In a host-bound step every line here costs 3-5x its time alone (~1 us each on a
        # 2-core CPU; the span's path ~0.8 us in all, the memo's ~1.2).
        backend = None
        if _compiling():
            from dispatch import compiling  # imports torch._dynamo: under compile only, as dispatch.api

            self._width(x)
            dtype = _autocast_dtype(x)
            hidden_dropout = self.training and self.p > 0.0
            backend = compiling.opaque_mlp(x.device, dtype or x.dtype, self.activation, self.in_features,
                                           self.hidden_features, hidden_dropout)  # fmt: skip
        else:
            memo = self._memo
            if memo.token is select._plain_token and _requested() is None:
                return self.module_forward(x)
            dtype = _autocast_dtype(x)
            grad = self._grad(x)
            state = (dtype, grad, self.training, self.p, self.p_out)
            if memo.spans(x, state):
                return self.module_forward(x)
            of_x = (x.shape, x.dtype, device_key(x))
            if memo.plain(of_x, state, lambda: self._call(self._width(x), dtype, grad)):
                return self.module_forward(x)
        if dtype is not None:
            x = _cast(x, dtype)
        inner = [self._operand(name, dtype) for name in self._in_names]
        w_out, b_out = self._operand(self._out_name, dtype)
        if len(inner) == 1:
            (w_in, b_in), = inner
        else:
            (w_gate, b_gate), (w_up, b_up) = inner
            w_in, b_in = (w_gate, w_up), None if b_gate is None else (b_gate, b_up)
        return fused_mlp(x, w_in, b_in, w_out, b_out, self.activation, self.p, self.p_out, self.training,
                         backend=backend)

    def module_forward(self, x: Tensor) -> Tensor:
        """The block as a module runs it in plain PyTorch: its layers called in order, LLaMA's
        down(act(gate(x)) * up(x)) for a (gate, up) pair, Phi-3's chunked gate_up_proj for a stacked one,
        the activation module it was built from, ``F.dropout`` in training."""
        act, call = self._act_fn, self._modules.__getitem__
        if act is None:
            act = ACTIVATIONS[GATES.get(self.activation, self.activation)].forward
        if len(self._in_names) == 2:
            gate, up = map(call, self._in_names)
            a = act(gate(x)) * up(x)
        elif self.activation in GATES:
            gate, up = call(self._in_names[0])(x).chunk(2, dim=-1)
            a = up * act(gate)
        else:
            a = act(call(self._in_names[0])(x))
        if self.p and self.training:
            a = F.dropout(a, self.p, True)
        y = call(self._out_name)(a)
        return F.dropout(y, self.p_out, True) if self.p_out and self.training else y

    def explain(self, x: Tensor) -> select.Decision:
        """Which backend a call on ``x`` runs on, by which rule, and why each other backend was not
        chosen (print it); on plain PyTorch the block runs ``module_forward``."""
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"x's last dimension must be in_features={self.in_features}, got {tuple(x.shape)}")
        return select.explain_call(self._call(x, _autocast_dtype(x)), None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
            f"out_features={self.out_features}, activation={self.activation!r}"
            + (f", gate_layout={self.gate_layout!r}" if self.activation in GATES else "")
            + (f", p={self.p}" if self.p else "")
            + (f", p_out={self.p_out}" if self.p_out else "")
            + (", transposed=True" if self.transposed else "")
        )


def _check_mlp_activation(activation: object) -> bool:
    """Whether ``activation``, a name of the table or a gate, is a gate; a ValueError for other values."""
    if isinstance(activation, str) and activation in GATES:
        return True
    if not isinstance(activation, str) or activation not in ACTIVATION_NAMES:
        names = ", ".join((*ACTIVATION_NAMES, *GATED_NAMES))
        raise ValueError(f"activation must be one of {names}; got {activation!r}")
    return False
