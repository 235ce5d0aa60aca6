"""Feature sizes of real models, shared by calibration, benchmarks and the choice tables."""

from __future__ import annotations

# model -> (hidden size, MLP intermediate size)
MODELS: dict[str, tuple[int, int]] = {
    "gpt2": (768, 3072),
    "gpt2-medium": (1024, 4096),
    "gpt2-large": (1280, 5120),
    "gpt2-xl": (1600, 6400),
    "bert-base": (768, 3072),
    "bert-large": (1024, 4096),
    "t5-base": (768, 3072),
    "t5-v1_1-xl": (2048, 5120),
    "vit-base": (768, 3072),
    "vit-large": (1024, 4096),
    "vit-huge": (1280, 5120),
    "llama-2-7b": (4096, 11008),
    "llama-2-13b": (5120, 13824),
    "llama-2-70b": (8192, 28672),
    "llama-3-8b": (4096, 14336),
    "llama-3-70b": (8192, 28672),
    "mistral-7b": (4096, 14336),
}

# Token counts M from decode (1) to long-context training batches.
TOKENS: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def feature_sizes() -> list[int]:
    """Every distinct N seen by bias_act_dropout (hidden and MLP sizes), sorted."""
    return sorted({n for pair in MODELS.values() for n in pair})


def linear_shapes() -> list[tuple[int, int]]:
    """Distinct (N, K) = (out_features, in_features) of the MLP up and down projections, sorted."""
    pairs = set()
    for hidden, mlp in MODELS.values():
        pairs.add((mlp, hidden))
        pairs.add((hidden, mlp))
    return sorted(pairs)
