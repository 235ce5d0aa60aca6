"""Every Hugging Face MLP class ``dispatch.patch`` rewrites (``patch_mlp._HF_MLPS``), built from a small
config of the installed transformers: where the dispatcher picks plain PyTorch (no table here) the patched
block is the module it replaced, to the bit, in training with dropout too, launching the same ops (the
profiler's list, forward and backward) and keeping the same tensors for backward; on the reference
backend it computes the same function within tolerance.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn

from dispatch import patch, use_backend
from dispatch.nn import FusedMLP
from dispatch.patch_mlp import _HF_MLPS
from patch_checks import NO_TRANSFORMERS, assert_same

transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)

H, F, TOKENS = 24, 40, (3, 5)
# class -> (model folder, config class, config overrides): each a small block of the real class
CONFIGS = {
    "GPT2MLP": ("gpt2", "GPT2Config", {"n_embd": H, "activation_function": "gelu_new", "resid_pdrop": 0.25}),
    "GPTBigCodeMLP": ("gpt_bigcode", "GPTBigCodeConfig", {"n_embd": H, "resid_pdrop": 0.25}),
    "GPTJMLP": ("gptj", "GPTJConfig", {"n_embd": H, "resid_pdrop": 0.25}),
    "GPTNeoXMLP": ("gpt_neox", "GPTNeoXConfig", {"hidden_size": H, "intermediate_size": F}),
    "ViTMLP": ("vit", "ViTConfig", {"hidden_size": H, "intermediate_size": F}),
    "SiglipMLP": ("siglip", "SiglipVisionConfig", {"hidden_size": H, "intermediate_size": F}),
    "CLIPMLP": ("clip", "CLIPVisionConfig", {"hidden_size": H, "intermediate_size": F, "hidden_act": "gelu"}),
    "Phi3MLP": ("phi3", "Phi3Config", {"hidden_size": H, "intermediate_size": F}),
    **{
        name: (folder, config, {"hidden_size": H, "intermediate_size": F})
        for name, folder, config in (
            ("LlamaMLP", "llama", "LlamaConfig"), ("MistralMLP", "mistral", "MistralConfig"),
            ("Qwen2MLP", "qwen2", "Qwen2Config"), ("Qwen2MoeMLP", "qwen2_moe", "Qwen2MoeConfig"),
            ("Qwen3MLP", "qwen3", "Qwen3Config"), ("GemmaMLP", "gemma", "GemmaConfig"),
            ("Gemma2MLP", "gemma2", "Gemma2Config"), ("Gemma3MLP", "gemma3", "Gemma3TextConfig"),
            ("GraniteMLP", "granite", "GraniteConfig"), ("OlmoMLP", "olmo", "OlmoConfig"),
            ("Olmo2MLP", "olmo2", "Olmo2Config"), ("CohereMLP", "cohere", "CohereConfig"),
            ("StableLmMLP", "stablelm", "StableLmConfig"),
        )
    },
}  # fmt: skip


def test_every_patched_class_is_checked_here():
    assert set(CONFIGS) == set(_HF_MLPS)


class Holder(nn.Module):
    """A parent for the block (patch puts the FusedMLP in its parent's place)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.mlp = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def build(name: str) -> nn.Module:
    """The real class from a small config, or a skip where this transformers lacks it."""
    folder, config_name, overrides = CONFIGS[name]
    try:
        config_mod = importlib.import_module(f"transformers.models.{folder}.configuration_{folder}")
        model_mod = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        heads = {"num_attention_heads": 4, "num_key_value_heads": 4, "n_head": 4, "head_dim": H // 4}
        config, cls = getattr(config_mod, config_name)(**heads, **overrides), getattr(model_mod, name)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"transformers {transformers.__version__} has no {name}: {exc}")
    takes_width = "intermediate_size" in inspect.signature(cls.__init__).parameters
    block = cls(F, config) if takes_width and name.startswith(("GPT2", "GPTBigCode", "GPTJ")) else cls(config)
    with torch.no_grad():
        for p in block.parameters():  # fresh values, biases too (some start at zero)
            p.normal_(std=0.3)
    return block


def patched_pair(name: str) -> tuple[nn.Module, nn.Module]:
    original = build(name)
    fused = Holder(build(name))
    fused.load_state_dict(Holder(original).state_dict())
    report = patch(fused)
    assert isinstance(fused.mlp, FusedMLP), str(report)
    return original, fused.mlp


def run(module: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """Output and the gradients of x and every parameter, dropout drawn from ``seed``."""
    torch.manual_seed(seed)
    y = module(x)
    grads = torch.autograd.grad(y, [x, *module.parameters()], torch.ones_like(y))
    return (y, *grads)


FORMULAS = ("GPT2MLP", "GPTJMLP")  # gelu_new, the tanh formula in seven ops: torch's gelu_tanh runs instead


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plain_pytorch_is_the_module_to_the_bit(name, seed):
    """To the bit, in training with dropout too; where the module computes gelu_tanh by its Python
    formula (gelu_new), torch's one-kernel gelu_tanh runs instead: the same function within rounding."""
    original, fused = patched_pair(name)
    assert "pytorch" in str(fused.explain(torch.randn(*TOKENS, H)).backend.name)
    for train in (True, False):
        original.train(train), fused.train(train)
        x = torch.randn(*TOKENS, H, requires_grad=True)
        for got, want in zip(run(fused, x, seed), run(original, x, seed)):
            if name in FORMULAS:
                assert_same(got, want)
            else:
                assert torch.equal(got, want)


def _ops(module: nn.Module, x: torch.Tensor) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = module(x)
        torch.autograd.grad(y, [x, *module.parameters()], torch.ones_like(y))
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


def _saved(module: nn.Module, x: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return kept


@pytest.mark.parametrize("name", ["GPT2MLP", "LlamaMLP", "Phi3MLP", "GemmaMLP"])
def test_plain_pytorch_launches_and_keeps_what_the_module_does(name):
    original, fused = patched_pair(name)
    original.train(), fused.train()
    x = torch.randn(*TOKENS, H, requires_grad=True)
    ops, theirs = _ops(fused, x), _ops(original, x)
    if name in FORMULAS:  # one gelu kernel forward, one backward, in place of the formula's ops
        assert ops.count("aten::gelu") == 1 and "aten::tanh" in theirs and "aten::tanh" not in ops
        assert len(ops) < len(theirs)
        return
    assert ops == theirs
    if fused.gate_layout == "pair":
        assert "aten::cat" not in ops  # no stacked copy of a (gate, up) pair
    assert _saved(fused, x) == _saved(original, x)


@pytest.mark.parametrize("name", ["GPT2MLP", "GPTNeoXMLP", "LlamaMLP", "Phi3MLP", "Gemma2MLP"])
def test_reference_backend_computes_the_same_block(name):
    original, fused = patched_pair(name)
    original.eval(), fused.eval()  # no dropout: masks differ between backends
    x = torch.randn(*TOKENS, H, requires_grad=True)
    want = run(original, x, 0)
    with use_backend("eager"):
        got = run(fused, x, 0)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_pair_on_the_pytorch_backend_stacks_nothing():
    """fused_mlp(backend="pytorch") with a (gate, up) pair runs two products, as LLaMA's module does."""
    from dispatch import fused_mlp

    gate, up, down = torch.randn(F, H), torch.randn(F, H), torch.randn(H, F)
    x = torch.randn(7, H, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = fused_mlp(x, (gate, up), None, down, None, "swiglu", backend="pytorch")
        y.sum().backward()
    names = [e.name for e in prof.events()]
    assert "aten::cat" not in names and names.count("aten::linear") == 3
    torch.testing.assert_close(y, (nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["GPTNeoXMLP", "LlamaMLP", "Phi3MLP"])
def test_plain_pytorch_launches_the_module_kernels_on_the_gpu(name):
    """The CUDA kernels of a training step, forward and backward, by name and order: the module's own."""
    original, fused = patched_pair(name)
    original, fused = original.cuda().to(torch.bfloat16).train(), fused.cuda().to(torch.bfloat16).train()
    x = torch.randn(64, 16, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def kernels(module: nn.Module) -> list[str]:
        run(module, x, 0)  # warm: cuBLAS picks its kernels once
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(module, x, 0)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    with use_backend("pytorch"):
        got = kernels(fused)
    want = kernels(original)
    assert got and got == want
