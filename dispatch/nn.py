"""Drop-in modules over the fused ops: ``FusedLinear``, ``FusedBiasActDropout`` and ``FusedMLP``.

``FusedLinear`` is ``nn.Linear`` followed by an activation and, with ``dropout=p``, a dropout: same
parameters (``weight`` (out, in), ``bias`` (out,)), same initialization, so an ``nn.Linear`` state_dict
loads unchanged. With ``transposed=True`` it stores the weight (in, out) as Hugging Face's ``Conv1D``
does (whose state_dict then loads unchanged) and passes the op its transposed view: cuBLAS and the
Triton kernels read either layout in place, and under ``torch.compile`` the GEMMs are the Conv1D's own.
``FusedBiasActDropout`` owns a bias and computes Dropout(Activation(x + bias)) in one pass.
``FusedMLP`` is a whole MLP block, Linear -> activation (or a gate) -> Dropout -> Linear -> Dropout, in
one ``fused_mlp`` call; its projections are child modules it can adopt from an existing block.

Autocast: under ``torch.autocast`` for x's device type with a half dtype (float16, bfloat16), x,
weights and biases are cast to that dtype first, as ``nn.Linear`` does (float64 tensors are left alone,
as autocast leaves them); the output has that dtype. ``FusedBiasActDropout`` casts its bias to x's
dtype, whatever x is: the fused op needs one dtype, and x carries the precision the model chose.

torch.compile: the modules compile with ``fullgraph=True``; with no backend requested their ops are
traced as plain math that inductor fuses (dropout with inductor's mask), else each op is one
custom-op node (each op's ``torch.library`` registration in ``dispatch/ops/<op>.py``).

CUDA graphs: dropout draws its ``[seed, offset]`` pair from the device's default generator
(``dispatch/contracts/rng.py``). Under ``torch.cuda.graph`` capture torch registers that generator with
the graph and advances it on every replay, so each replay draws a new pair and gets a new mask; a
backward captured in the same graph regenerates its forward's mask from the same pair
(``tests/test_nn.py::test_cuda_graph_replays_draw_new_masks``). Nothing is read back to the host, so
capture never synchronizes. ``model.eval()`` (or p = 0) draws nothing and drops nothing.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatch import select
from dispatch.api import fused_bias_act_dropout, fused_linear, fused_mlp
from dispatch.contracts.activations import ACTIVATION_NAMES, ACTIVATIONS, GATED_NAMES, GATES, get_activation
from dispatch.ops.fused_mlp import module_call

_compiling = torch.compiler.is_compiling

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)  # autocast never casts float64


def _autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast would give a linear layer on x's device, or None outside autocast."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in _AUTOCAST_DTYPES else None


def _cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    if t is None or t.dtype == dtype or t.dtype not in _CASTABLE:
        return t
    return t.to(dtype)


def _check_p(name: str, p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {p!r}")
    return float(p)


class FusedLinear(nn.Module):
    """Activation(x @ weight.T + bias): ``nn.Linear`` plus an activation, fused in the matmul epilogue.

    Equivalent PyTorch::

        nn.Dropout(dropout)(act(nn.Linear(in_features, out_features, bias)(x)))

    ``dropout`` (default 0): in training mode with ``dropout > 0`` bias, activation and dropout run in
    one ``fused_bias_act_dropout`` pass after the GEMM (the mask regenerated in backward, never
    stored); otherwise, as with no dropout, bias and activation are the GEMM's epilogue.
    ``transposed``: ``weight`` is stored (in_features, out_features), Hugging Face ``Conv1D``'s layout
    (``dispatch.patch`` reuses a Conv1D's parameter this way); the function is the same.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "identity",
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        dropout: float = 0.0,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        get_activation(activation)
        if type(transposed) is not bool:
            raise TypeError(f"transposed must be a bool, got {transposed!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.dropout = _check_p("dropout", dropout)
        self.transposed = transposed
        factory = {"device": device, "dtype": dtype}
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization: weight U(-1/sqrt(in), 1/sqrt(in)) via kaiming_uniform(a=sqrt(5)),
        bias U(-1/sqrt(in), 1/sqrt(in))."""
        weight = self.weight.t() if self.transposed else self.weight  # (out, in): fan_in = in_features
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"x's last dimension must be in_features={self.in_features} of this FusedLinear, "
                f"got x of shape {tuple(x.shape)}"
            )
        weight, bias = self.weight, self.bias
        dtype = _autocast_dtype(x)
        if dtype is not None:
            x, weight, bias = _cast(x, dtype), _cast(weight, dtype), _cast(bias, dtype)
        if self.transposed:
            # after the cast, which then writes the stored layout: inductor lays a cast of the transposed
            # view out (out, in) and feeds the GEMM that copy, 48 extra transposing copy kernels a step
            # in compiled patched GPT-2 (H200, 2026-11-30; benchmarks/PERF.md)
            weight = weight.t()
        if not self.training or self.dropout == 0.0:
            return fused_linear(x, weight, bias, self.activation)
        y = fused_linear(x, weight, None)
        return fused_bias_act_dropout(y, bias, self.activation, self.dropout, True)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation!r}"
            + (f", dropout={self.dropout}" if self.dropout else "")
            + (", transposed=True" if self.transposed else "")
        )


class FusedBiasActDropout(nn.Module):
    """Dropout(Activation(x + bias)) in one pass; the module owns the bias (N,), initialized to zero.

    Dropout runs in training mode only (``module.training``) and follows ``dispatch.contracts.rng``'s
    spec: the mask is regenerated in backward, never stored.

    Equivalent PyTorch::

        nn.Dropout(p)(act(x + bias))   # up to the choice of random bits
    """

    def __init__(
        self,
        features: int,
        activation: str = "gelu",
        p: float = 0.0,
        bias: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        get_activation(activation)
        self.features = features
        self.activation = activation
        self.p = _check_p("p", p)
        if bias:
            self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return fused_bias_act_dropout(x, bias, self.activation, self.p, self.training)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"features={self.features}, activation={self.activation!r}, p={self.p}, bias={bias}"


def is_conv1d(module: object) -> bool:
    """Hugging Face's Conv1D, known by name (transformers is never imported): weight stored (in, out)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def linear_layout(module: object) -> Optional[bool]:
    """True for a linear layer storing its weight (in, out) (Hugging Face's Conv1D, FusedLinear with
    ``transposed=True``), False for (out, in) (nn.Linear, FusedLinear), None for anything else (a
    FusedLinear with an activation or dropout included)."""
    if type(module) is nn.Linear:
        return False
    if type(module) is FusedLinear and module.activation == "identity" and module.dropout == 0.0:
        return module.transposed
    return True if is_conv1d(module) else None


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

    def _operand(self, name: str, dtype: Optional[torch.dtype]) -> tuple[Tensor, Optional[Tensor]]:
        """A projection's (weight (out, in), bias), cast to ``dtype`` first when autocast gives one."""
        layer = getattr(self, name)
        weight, bias = layer.weight, layer.bias
        if dtype is not None:
            weight, bias = _cast(weight, dtype), _cast(bias, dtype)
        return (weight.t() if self.transposed else weight), bias  # transposed after the cast, as FusedLinear

    def _call(self, x: Tensor, dtype: Optional[torch.dtype]):
        """The decision key of ``fused_mlp`` on x, made from the module's own settings (no checks)."""
        grad = torch.is_grad_enabled() and (x.requires_grad or any(
            t is not None and t.requires_grad
            for layer in map(self._modules.__getitem__, (*self._in_names, self._out_name))
            for t in (layer.weight, layer.bias)
        ))  # fmt: skip
        dropout = self.training and (self.p > 0.0 or self.p_out > 0.0)
        return module_call(x, dtype or x.dtype, self.hidden_features, self.activation, dropout, grad)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"x's last dimension must be in_features={self.in_features} of this FusedMLP, "
                f"got x of shape {tuple(x.shape)}"
            )
        dtype = _autocast_dtype(x)
        if not _compiling() and select.plain_pytorch(self._call(x, dtype)):
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
        return fused_mlp(x, w_in, b_in, w_out, b_out, self.activation, self.p, self.p_out, self.training)

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
