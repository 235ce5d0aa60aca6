"""Where a training step's time goes, and what the block benchmark predicts of it (bench_e2e and
bench_e2e_llama).

- ``mlp_share``: stamps (CUDA events on the stream; perf_counter on the CPU) around every MLP block's
  forward and backward through module hooks, over a few steps: the blocks' milliseconds and their
  share of the step. The stream's clock: where the GPU waits on the host inside a block, that wait
  counts too. Compiled models have no module boundaries at run time: eager-mode configs only.
- ``block_alone``: the model's own MLP module against its FusedMLP at the model's shape (one fp32
  (batch, seq, hidden) input under bf16 autocast, forward and autograd.grad of the input and every
  parameter), timed as bench_mlp times blocks (``dispatch.timing.compare``: GPU time by CUDA graph and
  wall time, interleaved rounds), after an eval-mode check of their outputs against each other;
  ``against_eager`` runs it where eager's block and another were kept.
- ``amdahl``: the step speedup the two predict, 1 / (1 - s + s / b), s the blocks' share of the eager
  step and b the block's speedup alone; the duel measures the step's own. Agreement says the gain is
  the MLP's and nothing else moved; the in-situ prediction (eager's step less its blocks plus the
  patched blocks' in-situ time) separates "the block is slower in the model" from "the rest moved".
  ``print_prediction`` prints them, a line per profiled config.
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable, Optional, Sequence

import e2e_common
import torch
from tabulate import tabulate
from torch import nn

from dispatch import timing


class BlockClock:
    """Stamps around the forward and the backward of each of ``modules`` (forward pre/post hooks, full
    backward pre/post hooks); ``spans`` holds (pass, start, end) until read; ``remove`` takes the
    hooks off."""

    def __init__(self, modules: Sequence[nn.Module], device: torch.device) -> None:
        self.device, self.spans, self._open = device, [], {}
        self._handles = []
        for m in modules:
            self._handles += [
                m.register_forward_pre_hook(functools.partial(self._start, "forward")),
                m.register_forward_hook(functools.partial(self._end, "forward")),
                m.register_full_backward_pre_hook(functools.partial(self._start, "backward")),
                m.register_full_backward_hook(functools.partial(self._end, "backward")),
            ]

    def _start(self, kind: str, module: nn.Module, *_) -> None:
        self._open[(id(module), kind)] = timing.stamp(self.device)

    def _end(self, kind: str, module: nn.Module, *_) -> None:
        start = self._open.pop((id(module), kind), None)
        if start is not None:
            self.spans.append((kind, start, timing.stamp(self.device)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def mlp_share(model, opt, mlps: Sequence[nn.Module], batches, device, backend: Optional[str]) -> dict:
    """Trains ``model`` one step per batch with a ``BlockClock`` on ``mlps``: the medians over the steps
    of the step, the blocks' forward, backward and both (ms), and both's share of the step."""
    steps, clock = [], BlockClock(mlps, device)
    try:
        with e2e_common.dispatch_backend(backend):
            for x, y in batches:
                clock.spans = []
                start = timing.stamp(device)
                e2e_common.step(model, opt, x, y, device)
                steps.append((start, timing.stamp(device), clock.spans))
    finally:
        clock.remove()
    timing.synchronize(device)
    per = {"step_ms": [], "mlp_forward_ms": [], "mlp_backward_ms": [], "mlp_ms": []}
    for start, end, spans in steps:
        forward = sum(timing.elapsed_ms(a, b) for k, a, b in spans if k == "forward")
        backward = sum(timing.elapsed_ms(a, b) for k, a, b in spans if k == "backward")
        for key, v in zip(per, (timing.elapsed_ms(start, end), forward, backward, forward + backward)):
            per[key].append(v)
    out = {k: statistics.median(v) for k, v in per.items()}
    out["share"] = out["mlp_ms"] / out["step_ms"]
    out["steps"] = len(steps)
    out["spans_per_step"] = len(steps[-1][2]) if steps else 0  # 2 a block: a missing hook shows here
    return out


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def block_alone(
    entries: dict[str, tuple[nn.Module, Optional[str]]],
    shape: tuple[int, ...],
    device: torch.device,
    rounds: int = timing.ROUNDS,
    rep_ms: float = 60.0,
) -> dict[str, dict]:
    """Per entry name (module, backend), on one fp32 input of ``shape`` under bf16 autocast: the
    eval-mode output's relative error against the first entry's, and forward + backward (grads of the
    input and every parameter) in training mode on both clocks, ms."""
    torch.manual_seed(e2e_common.SEED)
    x = torch.randn(*shape, device=device, requires_grad=True)

    def forward(module: nn.Module, backend: Optional[str]) -> torch.Tensor:
        with e2e_common.dispatch_backend(backend), torch.autocast(device.type, dtype=torch.bfloat16):
            return module(x)

    out: dict[str, dict] = {}
    ref = None
    for name, (module, backend) in entries.items():
        module.eval()
        with torch.no_grad():
            y = forward(module, backend)
        ref = y if ref is None else ref
        out[name] = {"backend": backend, "rel_err_eval": _relative_error(y, ref)}
        module.train()
    gy = torch.randn_like(ref)  # (batch, seq, hidden) in autocast's dtype

    def run(module: nn.Module, backend: Optional[str]) -> Callable[[], object]:
        leaves = (x, *module.parameters())
        return lambda: torch.autograd.grad(forward(module, backend), leaves, gy)

    measured = timing.compare({n: run(*e) for n, e in entries.items()}, device, rounds=rounds, rep_ms=rep_ms)
    for name, m in measured.items():
        for clock, t in (("gpu", m.gpu), ("wall", m.wall)):
            out[name][f"{clock}_ms"] = None if t is None else t.ms
        if m.errors:
            out[name]["errors"] = dict(m.errors)
    return out


def against_eager(
    blocks: dict[str, tuple[nn.Module, Optional[str]]], shape: tuple[int, ...], device, smoke: bool
) -> dict[str, dict]:
    """``block_alone`` of ``blocks`` where eager's and another were kept, else nothing; 20 ms an entry
    and clock on a smoke run, 60 otherwise."""
    if "eager" not in blocks or len(blocks) < 2:
        return {}
    return block_alone(blocks, shape, device, rep_ms=20.0 if smoke else 60.0)


def amdahl(share: float, speedup: float) -> float:
    """The whole's speedup when a part taking ``share`` of the time runs ``speedup`` times faster."""
    return 1.0 / (1.0 - share + share / speedup)


def measured_speedup(config: str, rows: Sequence[dict], duels: Sequence[dict]) -> tuple[Optional[float], str]:
    """``config``'s tokens/s over eager's: from the eager duel where there is one, else separate runs."""
    for d in duels:
        if d["pair"] == ["eager", config]:
            return 1.0 / d["ratio"], "duel"
    by = {r["config"]: r for r in rows if r.get("status") == "ok"}
    if "eager" in by and config in by:
        return by[config]["tokens_per_s"] / by["eager"]["tokens_per_s"], "separate runs"
    return None, ""


def prediction(
    profiles: dict[str, dict], block: dict[str, dict], rows, duels
) -> tuple[list[list], list[str]]:
    """One line per profiled config: its step and MLP ms in situ, the MLP's share, the block alone
    (GPU ms, speedup over the original module on the GPU clock), the step speedup predicted from eager's
    share and the block alone, the one predicted from the in-situ MLP times, and the measured one."""
    eager, first = profiles.get("eager"), block.get("eager", {})
    lines = []
    for name, p in profiles.items():
        alone = block.get(name, {})
        clock = "gpu_ms" if alone.get("gpu_ms") and first.get("gpu_ms") else "wall_ms"  # one clock for both
        t, base = alone.get(clock), first.get(clock)
        b = base / t if base and t else None
        line = [name, p["step_ms"], p["mlp_forward_ms"], p["mlp_backward_ms"], 100 * p["share"], t, b]
        predicted = in_situ = None
        if eager is not None and name != "eager":
            predicted = amdahl(eager["share"], b) if b else None
            in_situ = eager["step_ms"] / (eager["step_ms"] - eager["mlp_ms"] + p["mlp_ms"])
        x, how = measured_speedup(name, rows, duels) if name != "eager" else (None, "")
        lines.append(line + [predicted, in_situ, x, how])
    heads = ["config", "step ms", "MLP fwd ms", "MLP bwd ms", "MLP % of step", "block alone ms"]
    return lines, heads + ["block x", "predicted x", "in-situ x", "measured x", "measured by"]


def print_prediction(profile: dict, rows, duels, what: str) -> None:
    """``prediction``'s table under ``what`` (the steps and clock it timed), where anything was
    profiled; ``profile`` holds ``mlp_share`` and ``block_alone``."""
    if profile["mlp_share"]:
        lines, heads = prediction(profile["mlp_share"], profile["block_alone"], rows, duels)
        print(f"\n{what}; predicted x = 1 / (1 - eager's share + share / block x)")
        print(tabulate(lines, headers=heads, floatfmt=".4g", missingval="-"))
