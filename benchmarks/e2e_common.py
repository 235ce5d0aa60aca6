"""What the end-to-end training benchmarks share (bench_e2e for GPT-2, bench_e2e_llama for a LLaMA-style
model): the configs' names and backends, the Markov-chain data, a model built from the shared initial
weights, the optimizer and its warm-up, one training step, configs stepped in turn and the duel
statistics, the rows' speedups, and what the dispatcher picks per config. What they print and draw
(the duels' lines, the loss plot, the targets table) is ``e2e_report``'s.

A config's name says what runs: ``eager`` (the model as built), ``patched`` (``dispatch.patch(model)``,
the dispatcher picking each call's backend, or ``--backend``'s), ``patched-triton`` (the same model
with every fused call forced onto triton, ``use_backend("triton")``), and ``compile`` / ``compile+...``
(torch.compile of the one after the ``+``)."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Callable, Optional, Sequence

import common  # noqa: F401  (puts the repository on sys.path when run as a script)
import torch
import torch.nn.functional as F

from dispatch import timing

CHAIN_VOCAB, CHAIN_FANOUT, SEED = 1024, 8, 20261130
PARITY_TAIL, PARITY_TOL, SPEEDUP_TARGET = 20, 0.01, 1.1


def markov_corpus(n_seq: int, length: int) -> tuple[torch.Tensor, float]:
    """(n_seq, length) token ids from the fixed chain, and the chain's entropy in nats per token."""
    g = torch.Generator().manual_seed(SEED)
    successors = torch.randint(0, CHAIN_VOCAB, (CHAIN_VOCAB, CHAIN_FANOUT), generator=g)
    probs = 1.0 / torch.arange(1, CHAIN_FANOUT + 1, dtype=torch.float64)
    probs /= probs.sum()
    choice = torch.multinomial(probs, n_seq * length, replacement=True, generator=g).view(n_seq, length)
    tokens = torch.empty(n_seq, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, CHAIN_VOCAB, (n_seq,), generator=g)
    for t in range(1, length):
        tokens[:, t] = successors[tokens[:, t - 1], choice[:, t]]
    return tokens, float(-(probs * probs.log()).sum())


def chain_batches(steps: int, batch: int, seq: int, device) -> tuple[list, float]:
    """``steps`` (inputs, targets) pairs of ``batch`` x ``seq`` tokens from the chain, on ``device``, and
    the chain's entropy."""
    corpus, entropy = markov_corpus(steps * batch, seq + 1)
    corpus = corpus.to(device).view(steps, batch, seq + 1)
    return [(c[:, :-1], c[:, 1:]) for c in corpus], entropy


def initial_state(model_class, config) -> dict:
    """The weights every config starts from: a seeded ``model_class(config)``'s, on the host (out of
    the memory peaks)."""
    torch.manual_seed(SEED)
    return model_class(config).state_dict()


def from_state(model_class, config, state: dict, device) -> torch.nn.Module:
    """``model_class(config)`` with the weights of ``state``, in training mode; built on ``device`` (its
    random init then overwritten: faster than on the host)."""
    with torch.device(device):
        model = model_class(config)
    model.load_state_dict(state)
    model.train()
    return model


def optimizer(model, lr: float, device) -> torch.optim.Optimizer:
    """AdamW (betas 0.9 / 0.95, weight decay 0.1), fused on CUDA."""
    cuda = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)


def schedule(opt, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up of the learning rate over the first fifteenth of ``steps``."""
    warm = max(1, steps // 15)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))


def release(device, compiled: bool = False) -> None:
    """Frees what the last model held: dynamo's caches (``compiled``), garbage, CUDA's cached blocks."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step(model, opt, x, y, device) -> torch.Tensor:
    """One training step (bf16 autocast, clipping, the optimizer); returns the loss, not synchronized."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(input_ids=x).logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def in_turn(steps: Sequence[Callable], batches, device, warm: int = 0) -> list[list[float]]:
    """Each of ``steps`` (``step(x, y)``: one training step) on each batch in turn, the order rotated
    each batch so that none always goes first: one GPU clock and host phase for all. Each one's step
    milliseconds (stamps on the device's stream: CUDA events, no host synchronization) after the first
    ``warm`` batches."""
    marks: list[list] = [[] for _ in steps]
    for i, (x, y) in enumerate(batches):
        shift = i % len(steps)
        for k in [*range(shift, len(steps)), *range(shift)]:
            start = timing.stamp(device)
            steps[k](x, y)
            if i >= warm:
                marks[k].append((start, timing.stamp(device)))
    timing.synchronize(device)
    return [[timing.elapsed_ms(a, b) for a, b in m] for m in marks]


def median(values: Sequence[float]) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def final_loss(losses: Sequence[float]) -> float:
    """The mean loss of the last ``PARITY_TAIL`` steps: what loss parity compares."""
    tail = losses[-PARITY_TAIL:]
    return sum(tail) / len(tail)


def paired(first_ms: list[float], second_ms: list[float]) -> dict:
    """Two configs' step milliseconds, stepped in turn: steps, each one's median, the median of the
    per-pair ratios (second / first: < 1 means the second is faster) with a distribution-free 95%
    interval (order statistics of the n ratios, ranks n/2 -+ 0.98 sqrt(n)), and how often the second
    was faster."""
    ratios = sorted(b / a for a, b in zip(first_ms, second_ms))
    n = len(ratios)
    half = 0.98 * n**0.5
    lo, hi = ratios[max(0, int(n / 2 - half))], ratios[min(n - 1, int(n / 2 + half))]
    return {
        "steps": n,
        "step_ms": [median(m) for m in (first_ms, second_ms)],
        "ratio": ratios[n // 2],
        "ratio_95": [lo, hi],
        "second_faster": sum(r < 1.0 for r in ratios) / n,
    }


def dispatch_backend(name: Optional[str]):
    if name is None:
        return contextlib.nullcontext()
    from dispatch import use_backend

    return use_backend(name)


def backend_of(config: str, default: Optional[str]) -> Optional[str]:
    """The dispatch backend a config runs under: triton for ``...-triton``, else ``default`` (None: the
    dispatcher picks)."""
    return "triton" if config.endswith("-triton") else default


def backend_label(config: str, default: Optional[str]) -> str:
    """A row's backend column: a patched config's backend (``backend_of``), ``dispatch`` where the
    dispatcher picks, ``-`` for unpatched configs."""
    return (backend_of(config, default) or "dispatch") if is_patched(config) else "-"


def explain_each(configs: Sequence[str], default: Optional[str], explain: Callable[[], object]) -> dict:
    """``str(explain())`` under each config's backend: what the dispatcher picks, or why the call
    cannot run there (e.g. triton on the CPU: the reason is the answer)."""
    out = {}
    for name in configs:
        with dispatch_backend(backend_of(name, default)):
            try:
                out[name] = str(explain())
            except Exception as exc:
                out[name] = timing.describe(exc)
    return out


def is_patched(config: str) -> bool:
    return "patched" in config


def is_compiled(config: str) -> bool:
    return config.startswith("compile")


def why_skipped(config: str, device) -> Optional[str]:
    """Why ``config`` cannot run on ``device``, or None: forced triton needs CUDA (or the interpreter)."""
    if (
        backend_of(config, None) == "triton"
        and device.type != "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        return f"{config}: triton needs a CUDA device (or TRITON_INTERPRET=1): skipped on the {device.type}"
    return None


def speedups(rows: Sequence[dict], bases: Sequence[str]) -> None:
    """``x_<base>`` in each row that ran: its tokens/s over the base config's, for each base that ran."""
    by = {r["config"]: r for r in rows if r["status"] == "ok"}
    for r in by.values():
        for base in bases:
            if base in by:
                r[f"x_{base}"] = r["tokens_per_s"] / by[base]["tokens_per_s"]
