"""fused_bias_act_dropout: every backend next to plain PyTorch, torch.compile and a device copy.

    python benchmarks/bench_bias_act_dropout.py [--out DIR] [--quick] [--modes forward,backward]

Inputs: real-model feature sizes N (dispatch.contracts.shapes) at token counts M from decode (1) to 65536,
bf16 / fp16 / fp32, gelu and relu, p = 0.1 and 0, the large and decode rows first; on a machine
without CUDA a few small float32 shapes (a smoke run of the script and the CPU backends).
Modes: forward (under no_grad), backward (autograd.grad of x and bias from a kept graph),
forward+backward. Entries:
  <backend>  each registered backend that serves the call, fused_bias_act_dropout(backend=...);
             the others are listed with the registry's reason (the pytorch backend's kernels are
             the pytorch entry's composite: timed once, as that entry)
  dispatch   the public op choosing for itself (its pick in the "picked" column)
  pytorch    F.dropout(act(x + b), p): the composite a user writes, under PyTorch's autograd, called
             directly (``dispatch.ops.bias_act_dropout.baseline``)
  compile    torch.compile(dynamic=True) of that composite
  copy       dst.copy_(x) of the same tensor in the same run: the bandwidth ceiling
Minimum bytes (s = itemsize): forward 2MNs (read x, write y), backward 3MNs (read grad_y and x,
write grad_x; the mask is regenerated), forward+backward 5MNs. Per entry: GPU time (CUDA graph) and
wall time (do_bench; perf_counter on the CPU), GB/s and % of the copy's (GPU time), speedups vs
pytorch and compile on both clocks. Outputs and gradients are checked against the eager backend's
before timing (same mask: every backend but pytorch follows dispatch.contracts.rng's spec; pytorch,
compile, and dispatch where it picks a backend with torch's masks draw their own, so they are checked
at p = 0 only). nvfuser compiles per shape: it runs on the FOCUS rows only unless --all-backends. A
time budget stops new rows once spent.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import common
import report
import torch

from dispatch import timing

NS = (768, 1024, 3072, 4096, 5120, 11008, 14336, 28672)
MS = (1, 32, 512, 4096, 16384, 65536)
MAX_ELEMENTS = 2**29  # the sweep's largest shapes (bf16: 1 GB a tensor)
BIG, DECODE = (65536, 4096), (1, 4096)
CPU_SHAPES = ((256, 1024), (1, 1024))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = common.MODES
BUDGET_S = (220.0, 50.0)  # seconds until no new row starts: full run, --quick
COPY_BYTES_PER_MS = 4.14e9  # H200 device copy, 4.14 TB/s (benchmarks/PERF.md)


def grid(device: torch.device, quick: bool, modes: tuple[str, ...]) -> list[tuple]:
    """(M, N, dtype, activation, p, mode, focus) in priority order, without repeats."""
    if device.type != "cuda":
        shapes = CPU_SHAPES[:1] if quick else CPU_SHAPES
        return [
            (m, n, "fp32", "gelu", p, mode, True) for m, n in shapes for p in (0.1, 0.0) for mode in modes
        ]
    if quick:
        rows = [
            (m, n, "bf16", "gelu", p, mode, (m, n, p) == (*BIG, 0.1))
            for (m, n) in (BIG, DECODE)
            for p in (0.1, 0.0)
            for mode in modes
        ]
        return rows + [(*BIG, "fp32", "gelu", 0.1, mode, False) for mode in modes]
    rows = []
    for shape in (BIG, DECODE):
        for dt in DTYPES:
            for act in ("gelu", "relu"):
                for p in (0.1, 0.0):
                    focus = dt == "bf16" and (shape == BIG or (act, p) == ("gelu", 0.1))
                    rows += [(*shape, dt, act, p, mode, focus) for mode in modes]
    sweep = {n: [m for m in MS if m * n <= MAX_ELEMENTS] for n in NS}
    rows += [(ms[-1], n, "bf16", "gelu", 0.1, mode, True) for n, ms in sweep.items() for mode in modes]
    rows += [
        (m, n, "bf16", "gelu", 0.1, mode, False) for n, ms in sweep.items() for m in ms[:-1] for mode in modes
    ]
    seen, out = set(), []
    for r in rows:
        if r[:6] not in seen:
            seen.add(r[:6])
            out.append(r)
    return out


def min_bytes(m: int, n: int, itemsize: int, mode: str) -> int:
    return {"forward": 2, "backward": 3, "forward+backward": 5}[mode] * m * n * itemsize


# ----------------------------------------------------------------------------- entries


def _op(backend: Optional[str], activation: str, p: float) -> Callable:
    from dispatch import fused_bias_act_dropout

    return lambda x, b, gen=None: fused_bias_act_dropout(x, b, activation, p, generator=gen, backend=backend)


def _pytorch(activation: str, p: float) -> Callable:
    """The composite, torch's RNG (the generator is ignored: F.dropout takes none)."""
    from dispatch.ops.bias_act_dropout import baseline

    return lambda x, b, gen=None: baseline(x, b, activation, p)


@functools.cache
def _compiled(activation: str, p: float, backward_only: bool) -> Callable:
    """One compiled function per (activation, p): dynamic=True, so new shapes reuse its graph. The
    backward mode gets its own, traced without buffer donation (``common.timed``)."""
    composite = _pytorch(activation, p)

    def kept_graph(x, b):  # a code object of its own: dynamo caches graphs per code object
        return composite(x, b)

    fn = torch.compile(kept_graph if backward_only else composite, dynamic=True)
    return lambda x, b, gen=None: fn(x, b)


def results(fn: Callable, mode: str, x, b, gy) -> list[torch.Tensor]:
    """Output (and gradients) with a generator seeded 0: the same mask for every backend."""
    gen = torch.Generator(device=x.device).manual_seed(0)
    if mode == "forward":
        with torch.no_grad():
            return [fn(x, b, gen)]
    leaves = (x.detach().requires_grad_(), b.detach().requires_grad_())
    y = fn(*leaves, gen)
    return [y.detach(), *torch.autograd.grad(y, leaves, gy)]


def compare_results(got: list[torch.Tensor], ref: list[torch.Tensor]) -> str:
    from dispatch.contracts.tolerances import allowed_error, max_error

    bad = []
    for name, g, r in zip(("y", "grad_x", "grad_bias"), got, ref):
        err, allowed = max_error(g, r), allowed_error(r, g.dtype)
        if not err <= allowed:
            bad.append(f"{name} err {err:.3g} > {allowed:.3g}")
    return "; ".join(bad) or "ok"


def entries(row: dict, x, b, names: list[str], focus: bool) -> dict[str, Callable]:
    from dispatch import explain
    from dispatch.registry import Call

    act, p, mode = row["act"], row["p"], row["mode"]
    call = Call("bias_act_dropout", x.device, x.dtype, tuple(x.shape), mode != "forward", ("activation", "dropout"),
                (act, p > 0))
    out = common.backend_entries(row, call, names, focus, lambda name: _op(name, act, p))
    with torch.set_grad_enabled(mode != "forward"):
        probe = x.detach().requires_grad_(mode != "forward")
        row["picked"] = explain("fused_bias_act_dropout", probe, b, act, p).backend.name
    out["dispatch"] = _op(None, act, p)
    out["pytorch"] = _pytorch(act, p)
    out["compile"] = _compiled(act, p, mode == "backward")
    return out


def measure_row(m, n, dt, act, p, mode, focus, args, names, device) -> dict:
    from dispatch.registry import backends

    dtype = DTYPES[dt]
    row = dict(M=m, N=n, dtype=dt, act=act, p=p, mode=mode)
    nbytes = min_bytes(m, n, dtype.itemsize, mode)
    x = torch.randn(m, n, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    gy = torch.randn(m, n, device=device).to(dtype)
    fns = entries(row, x, b, names, focus)
    runs = {name: common.timed(fn, mode, (x, b), gy) for name, fn in fns.items()}
    dst = torch.empty_like(x)
    runs["copy"] = lambda: dst.copy_(x)
    reference: list = []
    own_masks = {*common.BASELINES, *(n for n in names if backends()[n].torch_masks)}

    def check(name: str) -> str:
        if name == "copy":
            return ""
        if p > 0 and name in own_masks:
            return "baseline (PyTorch's own mask)"
        if p > 0 and name == "dispatch" and row["picked"] in own_masks:
            return f"not checked: picked {row['picked']} (PyTorch's own mask)"
        if not reference:
            reference.extend(results(fns["eager"], mode, x, b, gy))
        return (
            "reference" if name == "eager" else compare_results(results(fns[name], mode, x, b, gy), reference)
        )

    rep_ms = max(args.rep_ms, 8 * nbytes / COPY_BYTES_PER_MS)  # >= ~8 timed calls at copy speed
    measured = timing.compare(runs, device, check=check, rounds=args.rounds, rep_ms=rep_ms)
    common.record(row, measured)
    common.copy_rates(row, nbytes, 2 * m * n * dtype.itemsize)
    common.speedups(row)
    return row


# ----------------------------------------------------------------------------- report


def plot(rows: list[dict], args) -> None:
    """GB/s against M, a panel per N, bf16 gelu p = 0.1, one figure per mode."""
    for mode in MODES:
        shown = [r for r in rows if (r["mode"], r["dtype"], r["act"], r["p"]) == (mode, "bf16", "gelu", 0.1)]
        panels = [(f"N = {n}", [r for r in shown if r["N"] == n and "gbs:copy" in r]) for n in NS]
        title = f"fused_bias_act_dropout bf16 gelu p=0.1, {mode} (GPU time)"
        out = common.path(args, f"bias_act_dropout_{mode.replace('+', '_')}", "png")
        report.plot_rows(panels, out, "gbs", "copy", "GB/s (minimum bytes)", title)


def main() -> None:
    p = common.sweep_parser(__doc__.split("\n\n")[0], BUDGET_S, rep_ms=40.0)
    args = p.parse_args()
    modes = common.modes(p, args)
    device = common.setup(args)
    names = common.registered()
    budget = common.budget(args, BUDGET_S)
    start = time.perf_counter()
    rows: list[dict] = []
    for m, n, dt, act, pr, mode, focus in grid(device, args.quick, modes):
        row = dict(M=m, N=n, dtype=dt, act=act, p=pr, mode=mode)
        if time.perf_counter() - start > budget:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            row = measure_row(m, n, dt, act, pr, mode, focus or args.all_backends, args, names, device)
        except Exception as exc:  # e.g. out of memory: record and go on
            row["error"] = timing.describe(exc)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        times = " ".join(f"{k[7:]}={v:.1f}" for k, v in row.items() if k.startswith("gpu_us:") and v)
        walls = " ".join(f"{k[8:]}={v:.1f}" for k, v in row.items() if k.startswith("wall_us:") and v)
        took = time.perf_counter() - start
        print(f"[{took:5.0f}s] {m}x{n} {dt} {act} p={pr} {mode}: gpu us {times or '-'}; "
              f"wall us {walls or row.get('error', '-')}", flush=True)  # fmt: skip
    report.save_sweep(args, "bias_act_dropout", rows, device, plot)
    keys = ["M", "N", "dtype", "act", "p", "mode"]
    metrics = [("GB/s", "gbs"), ("% copy", "pct_copy")]
    report.print_sweep_tables(rows, names, keys, metrics, time.perf_counter() - start)


if __name__ == "__main__":
    main()
