"""``dispatch.patch(model)``: swap MLP blocks, Linear -> activation (-> dropout) runs and RMSNorms for fused
modules.

Four rewrites, each exactly the original function (dropout masks aside):

* A whole MLP block, Linear -> activation (or a gate) (-> Dropout) -> Linear (-> Dropout): one
  ``FusedMLP`` where the block was, over the block's own linear layers (``dispatch/patch_mlp.py``).
  Blocks: Hugging Face MLPs by class (GPT-2's, ViT's, the LLaMA family's gated ones, act(gate(x)) * up(x),
  as swiglu/geglu/geglu_tanh/reglu over the (gate, up) pair, Phi-3's stacked one, ...), and an
  ``nn.Sequential`` that is exactly Linear, activation, [Dropout], Linear, [Dropout]. Where the
  dispatcher picks plain PyTorch the block computes exactly as before (``FusedMLP.module_forward``).
* Linear + activation (+ Dropout), elsewhere: one ``FusedLinear(activation=..., dropout=p)`` where the
  Linear was, ``nn.Identity`` where the activation and the dropout were. Without dropout (or p = 0, or
  in eval mode) bias and activation are the matmul's epilogue; in training with p > 0 the GEMM runs
  without the bias, then bias, activation and dropout in one pass. Backward regenerates the mask instead
  of keeping nn.Dropout's (one byte per element) but keeps that pass's input, which stands in for the
  pre-activation autograd keeps anyway.
* Linear + Dropout(p > 0), no activation between (BERT's output): ``FusedLinear`` keeps the bias (the
  GEMM's epilogue), then ``FusedBiasActDropout(identity, p, bias=False)``; in bf16 it keeps one byte
  per element more than nn.Dropout's mask. Under ``torch.compile`` the graph is then the original's.
  ``patch(model, bias_in_linear=False)`` moves that bias into the dropout's pass instead, as for runs
  with an activation: one ``FusedLinear(identity, dropout=p)``.
* A Hugging Face RMSNorm (LLaMA's, Mistral's, Qwen2/3's, Gemma's): one ``FusedRMSNorm`` over its weight
  (``dispatch/patch_norm.py``), the norm alone: its residual add is in the decoder layer's forward.

Where it looks: Hugging Face blocks by class (``patch_mlp._HF_MLPS`` for whole blocks; ``_HF_BLOCKS``
for runs: BERT's intermediate and output blocks, whose MLP spans two modules, and GPT-2's and ViT's MLP
where the whole block cannot be fused), and every ``nn.Sequential`` (Linear, then a known activation
and/or ``nn.Dropout``). Hugging Face is never imported: blocks are recognized by class name and module.
Gated MLPs of other classes (T5's wi_0/wi_1/wo, a hand-written one with LLaMA's names) are listed in the
report as left alone: patch does not know their forward. The per-linear rewrites keep the modules'
attribute names (an ``nn.Sequential`` keeps its positions: the fused module where the Linear was,
``nn.Identity`` where it replaced one), so the blocks' own ``forward`` runs unchanged. Parameters are
reused, not copied (an optimizer built before patching still holds them): ``Conv1D`` weights, stored
(in, out), keep that layout (``transposed=True``), so the GEMMs read the original operands.

Each parameter keeps its name, so ``named_parameters()``, the state_dict and an optimizer's groups built
from names all call it what the original did (``0.bias``, ``mlp.c_fc.weight``), and checkpoints load both
ways with ``strict=True``: a FusedMLP holds the block's linear layers under their attribute names; a
FusedLinear holds its Linear's. Where the bias runs in the dropout's pass, a hook on the block also loads
a ``<dropout>.bias`` entry as ``<linear>.bias``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from torch import nn

from dispatch import patch_mlp, patch_norm
from dispatch.nn import FusedBiasActDropout, FusedLinear, FusedMLP, is_conv1d
from dispatch.patch_mlp import activation_name, describe_linear, features, is_activation_module, is_linear

# Hugging Face block class -> the (linear, activation, dropout) attribute runs its forward calls in order;
# for GPT2MLP and ViTMLP only where the whole block cannot be one FusedMLP (patch_mlp._HF_MLPS).
_HF_BLOCKS: dict[str, tuple[tuple[str, Optional[str], Optional[str]], ...]] = {
    "GPT2MLP": (("c_fc", "act", None), ("c_proj", None, "dropout")),
    "ViTMLP": (("fc1", "activation_fn", None),),
    "BertIntermediate": (("dense", "intermediate_act_fn", None),),
    "BertOutput": (("dense", None, "dropout"),),  # then LayerNorm(h + residual), left alone
}


@dataclass(frozen=True)
class Replacement:
    path: str  # the block's qualified name in the model
    block: str  # its class
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({self.block}): {self.before}  ->  {self.after}"


@dataclass
class PatchReport:
    """What ``patch`` replaced and where, and what it saw but left alone (with the reason)."""

    replaced: list[Replacement] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)

    def __len__(self) -> int:
        return len(self.replaced)

    def __str__(self) -> str:
        lines = [f"dispatch.patch: {len(self.replaced)} replaced, {len(self.skipped)} left alone"]
        lines += [f"  {r}" for r in self.replaced]
        lines += [f"  left alone {path or '<model>'}: {why}" for path, why in self.skipped]
        return "\n".join(lines)


class _Run(NamedTuple):
    """Child names of one run: a linear layer, then an optional activation, then an optional dropout."""

    linear: str
    act: Optional[str]
    drop: Optional[str]


def _why_not(parent: nn.Module, run: _Run) -> Optional[str]:
    """Why ``run`` cannot (or need not) be fused, or None when it can."""
    linear = getattr(parent, run.linear, None)
    if isinstance(linear, FusedLinear):
        return "already patched"
    if not is_linear(linear):
        return f"expected an nn.Linear or Conv1D, found {type(linear).__name__}"
    activation = "identity"
    if run.act is not None:
        activation = activation_name(getattr(parent, run.act))
        if activation is None:
            return patch_mlp.why_no_activation(getattr(parent, run.act))
    p = 0.0
    if run.drop is not None:
        drop = getattr(parent, run.drop)
        if type(drop) is not nn.Dropout:
            return f"expected nn.Dropout after it, found {type(drop).__name__}"
        p = drop.p
    if activation == "identity" and p == 0.0:
        return "nothing to fuse: no activation and no dropout"
    return None


def _load_dropout_bias(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
    *,
    linear: str,
    drop: str,
) -> None:
    """Load-state-dict pre-hook: a ``<drop>.bias`` entry loads as ``<linear>.bias``. ``state_dict`` is
    ``load_state_dict``'s own copy, so the caller's is unchanged."""
    old, key = f"{prefix}{drop}.bias", f"{prefix}{linear}.bias"
    if old in state_dict and key not in state_dict:
        state_dict[key] = state_dict.pop(old)


def _accept_dropout_bias_key(parent: nn.Module, linear: str, drop: str) -> None:
    # a partial of a module-level function, holding names only: a deepcopy or pickle of the model keeps
    # it working on the copy (a closure over the modules would point at the original's)
    parent.register_load_state_dict_pre_hook(functools.partial(_load_dropout_bias, linear=linear, drop=drop))


def _rewrite(parent: nn.Module, path: str, run: _Run, bias_in_linear: bool = True) -> Replacement:
    """Swaps the run's children for fused modules (a run ``_why_not`` accepted)."""
    linear = getattr(parent, run.linear)
    activation = "identity" if run.act is None else activation_name(getattr(parent, run.act))
    drop = None if run.drop is None else getattr(parent, run.drop)
    p = 0.0 if drop is None else float(drop.p)
    before = [f"{run.linear}={describe_linear(linear)}"]
    if run.act is not None:
        before.append(f"{run.act}={type(getattr(parent, run.act)).__name__}")
    if drop is not None:
        before.append(f"{run.drop}=Dropout(p={p})")

    weight, bias = linear.weight, linear.bias
    n_in, n_out = features(linear)
    has_bias = bias is not None
    meta = {"device": "meta", "dtype": weight.dtype}  # skips initialization: the parameters are set below
    transposed = is_conv1d(linear)  # a Conv1D's weight keeps its (in, out) layout
    if p > 0.0 and bias_in_linear and activation == "identity":  # the bias in the GEMM's epilogue
        fused = FusedLinear(n_in, n_out, has_bias, **meta, transposed=transposed)
        tail = FusedBiasActDropout(n_out, activation, p, bias=False, **meta).train(drop.training)
        after = f"{run.linear}=FusedLinear() + {run.drop}=FusedBiasActDropout(identity, p={p}, bias=False)"
    else:  # the bias in the GEMM's epilogue, or with p > 0 in training in the dropout's pass
        fused = FusedLinear(n_in, n_out, has_bias, activation, **meta, dropout=p, transposed=transposed)
        tail = nn.Identity()
        args = activation + (f", dropout={p}" if p > 0.0 else "")
        after = f"{run.linear}=FusedLinear({args})"
        if p > 0.0 and has_bias:
            _accept_dropout_bias_key(parent, run.linear, run.drop)
    fused.weight = weight
    if has_bias:
        fused.bias = bias
    setattr(parent, run.linear, fused.train((linear if drop is None else drop).training))
    if run.act is not None:
        setattr(parent, run.act, nn.Identity())
    if run.drop is not None:
        setattr(parent, run.drop, tail)
    return Replacement(path, type(parent).__name__, " + ".join(before), after)


def _fuse(
    parent: nn.Module, path: str, run: _Run, report: PatchReport, bias_in_linear: bool, linear_dropout: bool
) -> None:
    why = _why_not(parent, run)
    if why is None and run.act is None and not linear_dropout:
        why = "Linear -> Dropout without an activation: left alone (linear_dropout=False)"
    if why is None:
        report.replaced.append(_rewrite(parent, path, run, bias_in_linear))
    else:
        report.skipped.append((f"{path}.{run.linear}" if path else run.linear, why))


def _sequential_runs(seq: nn.Sequential) -> list[_Run]:
    """A run for each Linear followed by an activation and/or a Dropout, in child order."""
    children = list(seq._modules.items())  # not named_children(): it drops repeated instances
    runs = []
    for i, (name, child) in enumerate(children):
        if not is_linear(child):
            continue
        rest = children[i + 1 : i + 3]
        act = rest[0][0] if rest and is_activation_module(rest[0][1]) else None
        rest = rest[1:] if act is not None else rest[:1]
        drop = rest[0][0] if rest and type(rest[0][1]) is nn.Dropout else None
        if act is not None or drop is not None:
            runs.append(_Run(name, act, drop))
    return runs


def patch(
    model: nn.Module, *, bias_in_linear: bool = True, linear_dropout: bool = True, mlp_blocks: bool = True,
    norms: bool = True,
) -> PatchReport:  # fmt: skip
    """Replaces, in place, ``model``'s MLP blocks with ``FusedMLP`` and its other Linear -> activation
    (-> dropout) runs with ``FusedLinear`` / ``FusedBiasActDropout``, and returns a report (print it) of
    what became what where.

    Recognized: Hugging Face MLP blocks by class (each one ``FusedMLP``: GPT-2's ``GPT2MLP``, ``ViTMLP``,
    ``LlamaMLP`` and its kin, ``Phi3MLP``, ...; ``dispatch.patch_mlp._HF_MLPS`` lists them), ``BertIntermediate``, ``BertOutput``, and any ``nn.Sequential`` holding Linear, then a
    known activation and/or ``nn.Dropout`` (one ``FusedMLP`` where the Sequential is exactly one MLP and
    not the model itself). Activations: nn.ReLU, nn.GELU (both approximations), nn.SiLU,
    nn.LeakyReLU(0.01), and Hugging Face's gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu2
    (squared_relu), silu; as a gate silu, gelu, gelu_tanh, relu. With dropout off (``model.eval()`` or
    p = 0) the patched model computes the same function as before, up to rounding in the model's dtype.
    Gated MLPs of other classes (T5's) and runs it cannot fuse are listed in the report as left alone,
    with the reason.

    ``bias_in_linear`` and ``linear_dropout`` apply to per-linear runs only. ``bias_in_linear`` (default
    True): a Linear -> Dropout run with no activation between (BERT's output) keeps its bias in the
    linear (a GEMM epilogue) and the dropout op gets none. Under torch.compile the patched graph then
    matches the original's: compiled GPT-2 with its c_proj -> dropout run patched this way ran at 1.000x
    and 1.0035x the compiled original, at 0.991-0.993x in four runs with the bias moved into the
    dropout's pass (``bias_in_linear=False``, where inductor adds it in a kernel of its own); in eager
    mode the two forms measured alike within the run-to-run spread.

    ``linear_dropout=False`` leaves such runs (Linear -> Dropout, no activation) alone: their fusion
    saves one small elementwise pass on the GPU but adds host time (two op dispatches for one
    native dropout) and, in bf16, keeps a byte per element more than nn.Dropout's mask.

    ``mlp_blocks=False`` rewrites no whole block: GPT-2's and ViT's MLPs and Sequential MLPs are fused
    per linear, gated MLPs are left alone.

    ``norms`` (default True): Hugging Face RMSNorms (``patch_norm._HF_NORMS``) become ``FusedRMSNorm``
    (the norm alone: the residual add before it is not a module); ``norms=False`` leaves them.

    Either way every parameter keeps the original's name, in ``named_parameters()`` and the state_dict
    (see the module docstring): checkpoints of the original load into the patched model and back, with
    ``strict=True``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    report = PatchReport()
    places = _places(model)
    for path, module in list(model.named_modules()):
        if isinstance(module, FusedMLP):
            continue
        if norms and patch_norm.offset_of(module) is not None:
            done = patch_norm.fuse(module, places.get(id(module), []))
            if isinstance(done, str):
                report.skipped.append((path, done))
            else:
                report.replaced.append(Replacement(path, type(module).__name__, *done))
            continue
        why = None  # why a whole MLP block was not made one FusedMLP
        block = patch_mlp.hf_block(module)
        if block is None and isinstance(module, nn.Sequential):
            block = patch_mlp.sequential_block(module)
        if block is not None:
            why = _fuse_block(module, path, block, places, report) if mlp_blocks else _NO_BLOCKS
            if why is None:
                continue
        kind = type(module)
        if kind.__name__ in _HF_BLOCKS and kind.__module__.startswith("transformers."):
            for run in _HF_BLOCKS[kind.__name__]:
                _fuse(module, path, _Run(*run), report, bias_in_linear, linear_dropout)
        elif isinstance(module, nn.Sequential):
            for run in _sequential_runs(module):
                _fuse(module, path, run, report, bias_in_linear, linear_dropout)
        elif why is not None or (why := patch_mlp.gated_left_alone(module)) is not None:
            report.skipped.append((path, why))
    return report


_NO_BLOCKS = "a whole MLP block: left alone (mlp_blocks=False)"


def _places(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(module) -> every (parent, attribute name) that holds it; the model itself has none."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                places.setdefault(id(child), []).append((parent, name))
    return places


def _fuse_block(
    module: nn.Module, path: str, block: patch_mlp.Block, places: dict, report: PatchReport
) -> Optional[str]:
    """Puts one FusedMLP over ``module``'s layers in its place, or says why not."""
    if id(module) not in places:
        return "the model is this MLP block: no parent to hold a FusedMLP (FusedMLP.from_linears builds one)"
    fused = patch_mlp.build(module, block)
    if isinstance(fused, str):
        return fused
    for parent, name in places[id(module)]:
        setattr(parent, name, fused)
    before, after = patch_mlp.describe(module, block, fused)
    report.replaced.append(Replacement(path, type(module).__name__, before, after))
    return None


__all__ = ["PatchReport", "Replacement", "activation_name", "patch"]
