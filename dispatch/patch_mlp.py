"""What ``dispatch.patch`` recognizes in an MLP (activation modules, linear layers, whole blocks), and its
whole-block rewrite: an MLP block -> one ``FusedMLP`` over the block's own linear layers.

Whole blocks are Hugging Face classes whose forward is known (``_HF_MLPS``: the MLPs of GPT-2, GPT-J,
GPT-NeoX, BigCode, ViT, SigLIP, CLIP, Phi-3, and the LLaMA family's gated ones: Mistral, Qwen2/3, Gemma 1-3,
Granite, OLMo, Cohere, StableLM) and ``nn.Sequential``s whose children are exactly Linear, activation,
[Dropout], Linear, [Dropout]. The ``FusedMLP`` takes the block's place in every parent that holds it and
adopts the block's linear layers (the same modules and Parameters) under their attribute names (``c_fc``,
``gate_proj``, ``0``, ...) in the block's order, so ``named_parameters()`` and the state_dict keep their keys
and order and checkpoints load both ways with ``strict=True``; the dropout modules, which hold no
parameters, go, and the activation module is held (not registered) for the block's plain-PyTorch forward
(``FusedMLP.module_forward``: the block's own computation, which runs where the dispatcher picks plain
PyTorch). The block's own forward no longer runs, which is why only blocks whose forward is known are
rewritten. A block that is the model itself has no parent to take a FusedMLP: ``patch`` falls back to its
per-linear rewrite there, as it does for MLP runs inside a longer ``nn.Sequential`` (a FusedMLP in its place
would rename the run's parameters), and for BERT, whose MLP spans two blocks (``BertIntermediate``, then
``BertOutput``'s dense, dropout and LayerNorm over the residual).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from torch import nn

from dispatch.contracts.activations import GATES, LEAKY_RELU_SLOPE
from dispatch.nn import FusedMLP, is_conv1d

# Hugging Face activation classes (transformers.activations) -> our activation names.
_HF_ACTIVATIONS = {
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",  # the same tanh formula, factored differently
    "ReLUSquaredActivation": "squared_relu",
    "SiLUActivation": "silu",
    "LinearActivation": "identity",
}

# Hugging Face activations that compute gelu_tanh by its formula in Python, seven or more kernels a call
# (GPT-2's gelu_new): a patched block runs torch's one-kernel gelu_tanh in their place, the same function
# within rounding, which is what the calibration times as plain PyTorch.
_FORMULAS = ("NewGELUActivation", "FastGELUActivation")

_GATE_OF = {act: gate for gate, act in GATES.items()}  # a gate's activation -> the gated name: silu -> swiglu

# Gated MLPs down(act(gate(x)) * up(x)), by the (gate, up, down) attribute names of their linear layers.
_GATED_NAMES = (("gate_proj", "up_proj", "down_proj"), ("wi_0", "wi_1", "wo"))


class Block(NamedTuple):
    """Child names of a whole MLP block, in the order its forward calls them."""

    inner: tuple[str, ...]  # the input projection, or (gate, up)
    act: str
    drop: Optional[str]  # dropout on the hidden activation
    out: str
    drop_out: Optional[str]  # dropout on the output
    gated: bool = False  # one input projection stacking [gate; up] (Phi-3's gate_up_proj)


_LLAMA = Block(("gate_proj", "up_proj"), "act_fn", None, "down_proj", None)  # down(act(gate(x)) * up(x))
_FC = Block(("fc1",), "activation_fn", None, "fc2", None)  # fc2(act(fc1(x)))
_C_FC = Block(("c_fc",), "act", None, "c_proj", "dropout")  # dropout(c_proj(act(c_fc(x))))
_DENSE = Block(("dense_h_to_4h",), "act", None, "dense_4h_to_h", None)

# Hugging Face MLP block class -> its children; each forward is exactly the block, nothing else (each
# class's forward is checked against its FusedMLP in tests/test_patch_hf_blocks.py).
_HF_MLPS: dict[str, Block] = {
    "GPT2MLP": _C_FC,
    "GPTBigCodeMLP": _C_FC,
    "GPTJMLP": Block(("fc_in",), "act", None, "fc_out", "dropout"),
    "GPTNeoXMLP": _DENSE,
    "ViTMLP": _FC,
    "SiglipMLP": _FC,
    "CLIPMLP": _FC,
    "Phi3MLP": Block(("gate_up_proj",), "activation_fn", None, "down_proj", None, gated=True),
    **dict.fromkeys(
        ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP",
         "GraniteMLP", "OlmoMLP", "Olmo2MLP", "CohereMLP", "StableLmMLP"),
        _LLAMA,
    ),
}  # fmt: skip


def activation_name(module: nn.Module) -> Optional[str]:
    """Our name for an activation module (torch or Hugging Face), or None when we have no equivalent."""
    kind = type(module)
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if kind is nn.LeakyReLU:
        return "leaky_relu" if module.negative_slope == LEAKY_RELU_SLOPE else None
    simple = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Identity: "identity"}.get(kind)
    if simple is not None:
        return simple
    if kind.__module__.startswith("transformers."):
        return _HF_ACTIVATIONS.get(kind.__name__)
    return None


def why_no_activation(module: nn.Module) -> str:
    """Why an activation module ``activation_name`` gave no name for has no fused equivalent."""
    if type(module) is nn.LeakyReLU:
        return f"LeakyReLU(negative_slope={module.negative_slope}): only slope {LEAKY_RELU_SLOPE} is fused"
    return f"activation {type(module).__name__} has no fused equivalent"


def is_activation_module(module: nn.Module) -> bool:
    mod = type(module).__module__
    return mod == "torch.nn.modules.activation" or mod.startswith("transformers.activations")


def is_linear(module: object) -> bool:
    """An nn.Linear or Hugging Face's Conv1D (a linear layer whose weight is stored (in, out))."""
    return type(module) is nn.Linear or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) of an nn.Linear (weight (out, in)) or a Conv1D (weight (in, out))."""
    w = module.weight
    return (w.shape[0], w.shape[1]) if is_conv1d(module) else (w.shape[1], w.shape[0])


def describe_linear(module: nn.Module) -> str:
    n_in, n_out = features(module)
    return f"{type(module).__name__}({n_in}->{n_out})"


def gated_left_alone(module: nn.Module) -> Optional[str]:
    """Why ``module``, a gated MLP block by its attribute names but not a class of ``_HF_MLPS``, is left
    alone, or None when it is not one: patch does not know its forward."""
    for names in _GATED_NAMES:
        if all(is_linear(getattr(module, name, None)) for name in names):
            acts = [f"{n}={type(m).__name__}" for n, m in module.named_children() if is_activation_module(m)]
            return (f"gated MLP ({', '.join([*names, *acts])}): patch does not know the forward of "
                    f"{type(module).__name__} (FusedMLP.from_linears fuses it)")  # fmt: skip
    return None


def hf_block(module: nn.Module) -> Optional[Block]:
    kind = type(module)
    return _HF_MLPS.get(kind.__name__) if kind.__module__.startswith("transformers.") else None


def sequential_block(seq: nn.Sequential) -> Optional[Block]:
    """The Sequential as one block, when its children are exactly Linear, activation, [Dropout], Linear,
    [Dropout]."""
    items = list(seq._modules.items())  # not named_children(): it drops repeated instances
    code = "".join(
        "L" if is_linear(m) else "A" if is_activation_module(m) else "D" if type(m) is nn.Dropout else "."
        for _, m in items
    )
    if re.fullmatch("LAD?LD?", code) is None:
        return None
    names = [name for name, _ in items]
    drop = names[2] if code[2] == "D" else None
    out = 3 if drop else 2
    return Block((names[0],), names[1], drop, names[out], names[out + 1] if out + 1 < len(names) else None)


def build(block: nn.Module, spec: Block) -> FusedMLP | str:
    """A ``FusedMLP`` over ``block``'s layers, in its training mode, or why there is none."""
    layers = [getattr(block, name) for name in (*spec.inner, spec.out)]
    for name, layer in zip((*spec.inner, spec.out), layers):
        if not is_linear(layer):
            return f"{name}: expected an nn.Linear or Conv1D, found {type(layer).__name__}"
    act = getattr(block, spec.act)
    activation = activation_name(act)
    if activation is None:
        return why_no_activation(act)
    if len(spec.inner) == 2 or spec.gated:
        if activation not in _GATE_OF:
            return f"{spec.act}={type(act).__name__}: gates are fused for {', '.join(_GATE_OF)} only"
        activation = _GATE_OF[activation]
    drops = [None if name is None else getattr(block, name) for name in (spec.drop, spec.drop_out)]
    for name, drop in zip((spec.drop, spec.drop_out), drops):
        if drop is not None and type(drop) is not nn.Dropout:
            return f"{name}: expected nn.Dropout, found {type(drop).__name__}"
    kinds = {(p.dtype, p.device) for layer in layers for p in layer.parameters()}
    if len(kinds) > 1:
        return f"its parameters differ in dtype or device, {sorted(map(str, kinds))}: one op needs one"
    p, p_out = (0.0 if drop is None else float(drop.p) for drop in drops)
    fc1 = layers[0] if len(layers) == 2 else tuple(layers[:2])
    try:
        fused = FusedMLP.from_linears(
            fc1, activation, layers[-1], p, p_out, names=(*spec.inner, spec.out),
            activation_module=None if type(act).__name__ in _FORMULAS else act,
        )  # fmt: skip
    except ValueError as error:  # layers whose shapes do not chain
        return str(error)
    return fused.train(block.training)


def describe(block: nn.Module, spec: Block, fused: FusedMLP) -> tuple[str, str]:
    """The report's (before, after) for a block ``build`` rewrote."""
    before = []
    for name in (*spec.inner, spec.act, spec.drop, spec.out, spec.drop_out):
        child = None if name is None else getattr(block, name)
        if is_linear(child):
            before.append(f"{name}={describe_linear(child)}")
        elif type(child) is nn.Dropout:
            before.append(f"{name}=Dropout(p={child.p})")
        elif child is not None:
            before.append(f"{name}={type(child).__name__}")
    settings = [fused.activation] + [f"{k}={v}" for k, v in (("p", fused.p), ("p_out", fused.p_out)) if v]
    return " + ".join(before), f"FusedMLP({', '.join(settings)})"


def fuse(block: nn.Module) -> FusedMLP:
    """One ``FusedMLP`` over ``block``'s own layers, for a block that is no model's child (``patch``
    needs a parent to put it in): a Hugging Face MLP class ``patch`` knows, or a Sequential MLP. A
    ValueError says why a block cannot be one."""
    spec = hf_block(block) or (sequential_block(block) if isinstance(block, nn.Sequential) else None)
    if spec is None:
        raise ValueError(f"block must be a known MLP block ({', '.join(_HF_MLPS)} or a Sequential "
                         f"Linear, activation, [Dropout], Linear, [Dropout]), got {type(block).__name__}")  # fmt: skip
    fused = build(block, spec)
    if isinstance(fused, str):
        raise ValueError(f"{type(block).__name__} cannot be one FusedMLP: {fused}")
    return fused
