"""The GPT-2 model bench_e2e trains: the GPT2Config its flags make (GPT-2 small, 768 wide with 12 heads;
64 wide with 4 with ``--tiny``), the initial weights every config starts from, a config's model built
from them (patched as the flags say for patched configs), its MLP blocks, and what the dispatcher picks
for the patched block's ``fused_mlp`` call."""

from __future__ import annotations

import e2e_common
import torch

TITLE = "GPT-2 training, bf16 autocast, dropout 0.1: eager vs dispatch.patch vs torch.compile"


def gpt2_config(args):
    from transformers import GPT2Config

    width, heads = (64, 4) if args.tiny else (768, 12)
    drop = args.dropout
    return GPT2Config(
        n_layer=args.layers, n_embd=width, n_head=heads, vocab_size=args.vocab,
        n_positions=max(1024, args.seq), resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop,
        activation_function="gelu_new", use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def initial_state(config) -> dict:
    from transformers import GPT2LMHeadModel

    return e2e_common.initial_state(GPT2LMHeadModel, config)


def build(name: str, config, state, device, args):
    """The model of config ``name`` from ``state`` (patched for patched configs; not compiled), and
    the patch report or None."""
    from transformers import GPT2LMHeadModel

    import dispatch

    model = e2e_common.from_state(GPT2LMHeadModel, config, state, device)
    options = {
        "mlp_blocks": not args.mlp_blocks_off,
        "bias_in_linear": not args.bias_in_dropout,
        "linear_dropout": not args.no_linear_dropout,
    }
    report = dispatch.patch(model, **options) if e2e_common.is_patched(name) else None
    return model, report


def mlps(model) -> list:
    """The model's MLP blocks (a FusedMLP each once patched with whole blocks)."""
    return [block.mlp for block in model.transformer.h]


def decisions(config, args, device) -> dict:
    """What the dispatcher picks for the patched block's fused_mlp call at this size (bf16, training),
    as patch passes it (Conv1D weights (in, out) as transposed views), per patched backend."""
    from dispatch import explain

    m, d, h = args.batch * args.seq, config.n_embd, 4 * config.n_embd
    kw = {"device": device, "dtype": torch.bfloat16, "requires_grad": True}
    x, w1, b1 = torch.randn(m, d, **kw), torch.randn(d, h, **kw), torch.randn(h, **kw)
    w2, b2 = torch.randn(h, d, **kw), torch.randn(d, **kw)

    def call():
        return explain("fused_mlp", x, w1.t(), b1, w2.t(), b2, "gelu_tanh", 0.0, args.dropout, True)

    return e2e_common.explain_each(("patched", "patched-triton"), args.backend, call)
