"""The LLaMA-style model bench_e2e_llama trains: the LlamaConfig its flags make, the initial weights
every config starts from, a config's model built from them with its optimizer and learning-rate warm-up
(patched for patched configs), its MLP blocks, the bytes a token keeps per decoder-layer part (measured
by ``e2e_memory``, and by bench_e2e_llama's formulas), and what the dispatcher picks for the patched
MLP's ``fused_mlp`` call."""

from __future__ import annotations

from typing import Optional

import e2e_common
import e2e_memory
import torch
import torch.nn.functional as F
from tabulate import tabulate

PARTS = {  # a decoder layer's module -> the part of the model its saved bytes count to
    "mlp": "mlp",
    "self_attn": "attention",
    "input_layernorm": "norms",
    "post_attention_layernorm": "norms",
}


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.seq), hidden_act="silu", attention_dropout=0.0,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip


def initial_state(config) -> dict:
    from transformers import LlamaForCausalLM

    return e2e_common.initial_state(LlamaForCausalLM, config)


def build(name: str, config, state: dict, args, device):
    """(model, optimizer, lr schedule, patch report or None): the weights of ``state``, patched for
    patched configs; built on the device (``e2e_common.from_state``)."""
    from transformers import LlamaForCausalLM

    import dispatch

    model = e2e_common.from_state(LlamaForCausalLM, config, state, device)
    report = dispatch.patch(model) if e2e_common.is_patched(name) else None
    opt = e2e_common.optimizer(model, args.lr, device)
    sched = e2e_common.schedule(opt, args.warmup + args.steps)
    return model, opt, sched, report


def mlps(model) -> list:
    return [layer.mlp for layer in model.model.layers]


# ----------------------------------------------------------------------------- what a token keeps


def saved_bytes(model, batch: int, args, device, backend: Optional[str]) -> dict[str, int]:
    """``e2e_memory.saved_bytes`` of one training forward and loss at ``batch``, by decoder-layer part."""
    parts = {getattr(layer, attr): part for layer in model.model.layers for attr, part in PARTS.items()}
    x = torch.randint(0, e2e_common.CHAIN_VOCAB, (batch, args.seq + 1), device=device)

    def forward() -> torch.Tensor:
        with e2e_common.dispatch_backend(backend), torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits  # (batch, seq, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())

    return e2e_memory.saved_bytes(model, parts, forward)


def per_token(model, args, device, backend: Optional[str]) -> dict[str, float]:
    """Bytes a token keeps, per layer for each of ``PARTS``' parts and once for "other"
    (``e2e_memory.per_token``)."""
    return e2e_memory.per_token(lambda b: saved_bytes(model, b, args, device, backend), args.seq, args.layers)


def analytic(args) -> dict[str, float]:
    """bench_e2e_llama's formulas: bytes a token keeps per layer (MLP, norms) and once (other)."""
    h, f = args.hidden, args.intermediate
    return {
        "mlp eager": 4 * h + 8 * f,
        "mlp fused": 2 * h + 4 * f,
        "norms": 16 * h + 8,
        "other": 8 * h + 4 * args.vocab,
    }


def print_saved(rows: list[dict], args) -> None:
    """Bytes a token keeps, per layer and part, measured per config, beside the formulas."""
    formulas = analytic(args)
    parts = ["mlp", "attention", "norms", "other"]
    lines = [
        [r["config"], *(r["saved_per_token"].get(p) for p in parts)] for r in rows if "saved_per_token" in r
    ]
    lines.append(["formula: eager / fused", f"{formulas['mlp eager']} / {formulas['mlp fused']}",
                  f"~{14 * args.hidden}", formulas["norms"], f"~{formulas['other']}"])  # fmt: skip
    sizes = f"H = {args.hidden}, F = {args.intermediate}"
    print(f"\nbytes a token keeps for backward, per layer (other: once), {sizes}")
    print(tabulate(lines, headers=["config", *parts], floatfmt=".0f", missingval="-"))


# ----------------------------------------------------------------------------- the dispatcher's pick


def decisions(config, args, device) -> dict:
    """What the dispatcher picks for the patched MLP's call at this size (bf16, training, the (gate,
    up) pair as dispatch.patch passes LLaMA's), per patched config's backend."""
    from dispatch import explain

    m, h, f = args.batch * args.seq, config.hidden_size, config.intermediate_size
    kw = {"device": device, "dtype": torch.bfloat16, "requires_grad": True}
    x, gate, up, down = (torch.randn(*s, **kw) for s in ((m, h), (f, h), (f, h), (h, f)))

    def call():
        return explain("fused_mlp", x, (gate, up), None, down, None, "swiglu")

    return e2e_common.explain_each(args.configs[1:], args.backend, call)
