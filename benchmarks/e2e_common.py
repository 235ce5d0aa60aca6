"""What the end-to-end training benchmarks share: the Markov-chain data, one training step, the duel
statistics, the configs' names and backends, the loss plot and the targets table (bench_e2e for GPT-2,
bench_e2e_llama for a LLaMA-style model).

A config's name says what runs: ``eager`` (the model as built), ``patched`` (``dispatch.patch(model)``,
the dispatcher picking each call's backend, or ``--backend``'s), ``patched-triton`` (the same model
with every fused call forced onto triton, ``use_backend("triton")``), and ``compile`` / ``compile+...``
(torch.compile of the one after the ``+``)."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import common
import torch
import torch.nn.functional as F

CHAIN_VOCAB, CHAIN_FANOUT, SEED = 1024, 8, 20261130
PARITY_TAIL, PARITY_TOL, SPEEDUP_TARGET = 20, 0.01, 1.1
GPT2_TITLE = "GPT-2 training, bf16 autocast, dropout 0.1: eager vs dispatch.patch vs torch.compile"


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
        "step_ms": [sorted(m)[len(m) // 2] for m in (first_ms, second_ms)],
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


def _moving_mean(values: list[float], k: int) -> list[float]:
    return [sum(values[i - k : i]) / k for i in range(k, len(values) + 1)]


def plot(rows, entropy, path, title: str = GPT2_TITLE) -> bool:
    """Left: the loss curves overlaid. Right: each config's moving mean relative to eager's, in %."""
    if not common.have_matplotlib():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    eager = next((r for r in ok if r["config"] == "eager"), None)
    fig, (curves, rel) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ok:
        curves.plot(r["losses"], label=r["config"], lw=1)
        if eager is not None and r is not eager:
            k = min(PARITY_TAIL, len(r["losses"]))
            mine, base = _moving_mean(r["losses"], k), _moving_mean(eager["losses"], k)
            diff = [100 * (a / b - 1) for a, b in zip(mine, base)]
            rel.plot(range(k - 1, len(r["losses"])), diff, label=r["config"], lw=1)
    curves.axhline(entropy, color="gray", ls=":", lw=1, label="chain entropy (the floor)")
    curves.set(yscale="log", xlabel="step", ylabel="training loss", title="loss, same weights and batches")
    for bound in (-100 * PARITY_TOL, 100 * PARITY_TOL):
        rel.axhline(bound, color="gray", ls=":", lw=1)
    rel.set(xlabel="step", ylabel="% vs eager", title=f"{PARITY_TAIL}-step moving mean relative to eager")
    for ax in (curves, rel):
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def targets(
    rows, duels=(), speedup: float = SPEEDUP_TARGET, compile_speedup: float = 1.0, memory_cut: float = 0.0
) -> list[list[str]]:
    """[target, measured, PASS/MISS] for each target the rows (separate runs, or one duel's steps) and
    the duels (alternating steps) can answer: each patched config against eager (``speedup``; peak
    memory lower, by at least ``memory_cut`` of eager's; loss parity), each compile+... config against
    compile (``compile_speedup``). A duel passes where its 95% interval clears the target; against
    compile at 1.0 the claim is "not slower", which holds unless the interval says so."""
    by = {r["config"]: r for r in rows if r["status"] == "ok"}
    out = []

    def add(target: str, measured: str, ok: Optional[bool]) -> None:
        out.append([target, measured, "-" if ok is None else "PASS" if ok else "MISS"])

    e = by.get("eager")
    for name, p in by.items():
        if e is None or not is_patched(name) or is_compiled(name):
            continue
        x = p["tokens_per_s"] / e["tokens_per_s"]
        add(f"{name} >= {speedup}x eager tokens/s", f"{x:.3f}x", x >= speedup)
        if e.get("peak_gib") is not None and p.get("peak_gib") is not None:
            cut = 1.0 - p["peak_gib"] / e["peak_gib"]
            peaks = f"{p['peak_gib']:.2f} vs {e['peak_gib']:.2f} GiB ({-100 * cut:+.1f}%)"
            if memory_cut:
                add(f"{name} peak memory >= {100 * memory_cut:.0f}% below eager's", peaks, cut >= memory_cut)
            else:
                add(f"{name} peak memory < eager", peaks, cut > 0)
        rel = abs(p["final_loss"] - e["final_loss"]) / e["final_loss"]
        add(
            f"{name} loss parity, mean of last {PARITY_TAIL} steps, <= 1%",
            f"{100 * rel:.2f}%",
            rel <= PARITY_TOL,
        )
    for name, p in by.items():
        if is_compiled(name) and name != "compile" and "compile" in by:
            ratio = p["tokens_per_s"] / by["compile"]["tokens_per_s"]
            add(f"{name} >= {compile_speedup}x compile tokens/s (separate runs)", f"{ratio:.4f}x",
                ratio >= compile_speedup)  # fmt: skip
    for d in duels:
        out.append(_duel_target(d, speedup, compile_speedup))
    return out


def _duel_target(d: dict, speedup: float, compile_speedup: float) -> list[str]:
    first, second = d["pair"]
    x = 1.0 / d["ratio"]  # tokens/s of the second over the first
    lo, hi = 1.0 / d["ratio_95"][1], 1.0 / d["ratio_95"][0]
    share = d["second_faster"]
    if is_patched(first) and not is_patched(second):  # stepped patched-first: read it the other way
        first, second = second, first
        x, lo, hi, share = d["ratio"], d["ratio_95"][0], d["ratio_95"][1], 1.0 - share
    measured = f"{x:.4f}x (95%: {lo:.4f}-{hi:.4f}), faster in {100 * share:.0f}% of pairs"
    if first == second:
        return [f"control: two builds of {first} (no target)", measured, "-"]
    if first == "eager":
        return [
            f"duel: {second} >= {speedup}x {first} tokens/s",
            measured,
            "PASS" if lo >= speedup else "MISS",
        ]
    if compile_speedup > 1.0:
        target, ok = f"duel: {second} >= {compile_speedup}x {first} tokens/s", lo >= compile_speedup
    else:  # the same graphs by design
        target, ok = f"duel: {second} not slower than {first} (95% interval reaches 1)", hi >= 1.0
    return [target, measured, "PASS" if ok else "MISS"]
