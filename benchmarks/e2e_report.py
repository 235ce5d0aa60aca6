"""What the end-to-end training benchmarks report (bench_e2e, bench_e2e_llama): a line per duel, the
loss curves (PNG, where matplotlib is present) and the targets table: each patched config against
eager (tokens/s, peak memory, loss parity), each compile+... config against compile, in separate runs
and in duels (``e2e_common.paired``)."""

from __future__ import annotations

from typing import Optional, Sequence

import report
from e2e_common import PARITY_TAIL, PARITY_TOL, SPEEDUP_TARGET, is_compiled, is_patched


def print_duels(duels: Sequence[dict], how: str) -> None:
    """A line a duel: its configs, steps and each one's median step; ``how`` says how they alternated."""
    for d in duels:
        print(f"duel {d['pair'][0]} vs {d['pair'][1]}, {d['steps']} {how}: step ms "
              f"{d['step_ms'][0]:.3f} vs {d['step_ms'][1]:.3f}")  # fmt: skip


def _moving_mean(values: list[float], k: int) -> list[float]:
    return [sum(values[i - k : i]) / k for i in range(k, len(values) + 1)]


def plot(rows, entropy, path, title: str) -> bool:
    """Left: the loss curves overlaid. Right: each config's moving mean relative to eager's, in %."""
    if not report.have_matplotlib():
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
