"""fused add + RMSNorm / LayerNorm, memory-bound (one pass each way): the triton kernel next to plain
PyTorch, torch.compile, Liger and a device copy.

    python benchmarks/bench_add_norm.py [--out DIR] [--quick] [--modes forward,backward] [--kinds rms,layer]
    python benchmarks/bench_add_norm.py --cpu-smoke     # tiny sizes on the CPU (Triton's interpreter)

Inputs: hidden widths N of LLaMA-2-7B (4096), Qwen2-0.5B / 1.5B (896, 1536) and Gemma-2B / 7B (2048,
3072) at M = 1024, 4096 and 16384 tokens, bf16 (--dtype). Each step: h = x + residual, y = norm(h)
* weight, both y and h used downstream (upstream gradients on both). Modes: forward (no_grad), backward
(autograd.grad of x, residual and weight from a kept graph), forward+backward. Entries:
  pytorch      h = x + r, then RMSNorm in torch ops as Hugging Face's LlamaRMSNorm writes it (float32
               math, normalized cast to x's dtype before the weight); LayerNorm: F.layer_norm
  F.rms_norm   h = x + r, then torch.nn.functional.rms_norm (where this torch has it)
  compile      torch.compile(dynamic=True) of the pytorch entry
  triton       fused_add_rms_norm / fused_add_layer_norm with backend="triton" (the kernels of
               dispatch.backends.triton.add_norm): one kernel each way, dw reduced from per-program rows
  liger        Liger-Kernel's LigerFusedAddRMSNormFunction (fused add + norm, casting_mode "llama")
  liger_rms    h = x + r, then Liger's LigerRMSNormFunction, where liger_kernel imports
  copy         dst.copy_(x): the bandwidth ceiling
Minimum bytes (s = itemsize): forward 4MNs (read x and r, write y and h), backward 4MNs (read dy, dh
and h, write dx), forward+backward 8MNs. Per entry: GPU time (do_bench_cudagraph) and wall time
(do_bench; perf_counter on the CPU), GB/s and % of the copy's, speedups vs pytorch and compile. Every
entry is checked before timing against the op's reference in float32 (y, h and every gradient),
allowed twice the pytorch entry's error plus the dtype's tolerance (dispatch.contracts.tolerances).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable, Optional

import common
import report
import torch
import torch.nn.functional as F
from tabulate import tabulate

from dispatch import fused_add_layer_norm, fused_add_rms_norm, timing
from dispatch.ops.add_norm import EPS, baseline, reference

NS = (4096, 896, 1536, 2048, 3072)
MS = (16384, 4096, 1024)
QUICK = ((4096, 4096), (16384, 896))
SMOKE = ((64, 96), (16, 257))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BUDGET_S = (600.0, 120.0)  # seconds until no new row starts: full run, --quick
COPY_BYTES_PER_MS = 4.14e9  # H200 device copy, 4.14 TB/s (benchmarks/PERF.md)
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], tuple]


# ----------------------------------------------------------------------------- entries


def pytorch(kind: str) -> Step:
    """The op's baseline (``dispatch.ops.add_norm.baseline``): LlamaRMSNorm's torch ops, or F.layer_norm."""
    eps = EPS[kind]

    def step(x, r, w, b=None):
        return baseline(x, r, w, b, eps, kind)

    return step


def f_rms_norm(x, r, w, b=None):
    h = x + r
    return F.rms_norm(h, h.shape[-1:], w, EPS["rms"]), h


@functools.cache
def compiled(kind: str, backward_only: bool) -> Step:
    """One compiled function per kind; the backward mode gets its own (``common.timed``)."""
    composite = pytorch(kind)

    def kept_graph(x, r, w, b=None):  # a code object of its own: dynamo caches graphs per code object
        return composite(x, r, w, b)

    return torch.compile(kept_graph if backward_only else composite, dynamic=True)


def triton_step(kind: str) -> Step:
    """The public op on the triton backend (the shared runner's autograd node over its kernels)."""
    if kind == "rms":
        return lambda x, r, w, b=None: fused_add_rms_norm(x, r, w, EPS[kind], backend="triton")
    return lambda x, r, w, b=None: fused_add_layer_norm(x, r, w, b, EPS[kind], backend="triton")


def liger_steps() -> tuple[dict[str, Step], str]:
    """Liger's fused add + RMSNorm and its RMSNorm after a torch add, or ({}, why there are none)."""
    try:
        import importlib.metadata

        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as exc:  # not installed, or its triton / torch pins disagree with ours
        return {}, f"liger_kernel does not import: {timing.describe(exc)}"
    eps = EPS["rms"]

    def fused(x, r, w, b=None):  # (X, R, W, eps, offset, casting_mode, in_place)
        return tuple(LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False))

    def after_add(x, r, w, b=None):  # (X, W, eps, offset, casting_mode, in_place)
        h = x + r
        return LigerRMSNormFunction.apply(h, w, eps, 0.0, "llama", False), h

    return {
        "liger": fused,
        "liger_rms": after_add,
    }, f"liger_kernel {importlib.metadata.version('liger-kernel')}"


def entries(row: dict, kind: str, device: torch.device, backward_only: bool) -> dict[str, Step]:
    out = {"pytorch": pytorch(kind)}
    if kind == "rms" and hasattr(F, "rms_norm"):
        out["F.rms_norm"] = f_rms_norm
    out["compile"] = compiled(kind, backward_only)
    out["triton"] = triton_step(kind)
    if kind == "rms":
        liger, why = liger_steps()
        if device.type != "cuda" and liger:
            liger, why = {}, "liger's kernels are Triton's: they need CUDA"
        out.update(liger)
        if not liger:
            row["skip:liger"] = why
    return out


# ----------------------------------------------------------------------------- a row


def results(fn: Step, mode: str, tensors: tuple, upstream: tuple) -> list[torch.Tensor]:
    """y and h, and with a backward the gradients of x, residual, weight (and bias)."""
    if mode == "forward":
        with torch.no_grad():
            return list(fn(*tensors))
    leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
    y, h = fn(*leaves)
    wanted = [t for t in leaves if t is not None]
    return [y.detach(), h.detach(), *torch.autograd.grad((y, h), wanted, upstream)]


def measure_row(m: int, n: int, dt: str, kind: str, mode: str, args, device) -> dict:
    from dispatch.contracts.tolerances import allowed_error, max_error

    dtype = DTYPES[dt]
    row = dict(M=m, N=n, dtype=dt, kind=kind, mode=mode)
    x, r, gy, gh = (torch.randn(m, n, device=device).to(dtype) for _ in range(4))
    w = torch.randn(n, device=device).mul_(0.3).add_(1).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if kind == "layer" else None
    tensors, upstream = (x, r, w, b), (gy, gh)
    fns = entries(row, kind, device, mode == "backward")
    inputs = tuple(t for t in tensors if t is not None)
    runs = {name: common.timed(_positional(fn), mode, inputs, upstream) for name, fn in fns.items()}
    dst = torch.empty_like(x)
    runs["copy"] = lambda: dst.copy_(x)
    wide = tuple(None if t is None else t.float() for t in tensors)
    ref = results(lambda *t: reference(*t, EPS[kind], kind), mode, wide, tuple(g.float() for g in upstream))
    base = results(fns["pytorch"], mode, tensors, upstream)

    def check(name: str) -> str:
        if name == "copy":
            return ""
        got = base if name == "pytorch" else results(fns[name], mode, tensors, upstream)
        bad = [
            f"{i}: err {max_error(g, f):.3g} > {allowed_error(f, g.dtype, e):.3g}"
            for i, (g, f, e) in enumerate(zip(got, ref, base))
            if not max_error(g, f) <= allowed_error(f, g.dtype, e)
        ]
        return "; ".join(bad) or "ok"

    nbytes = (8 if mode == "forward+backward" else 4) * m * n * dtype.itemsize
    rep_ms = max(args.rep_ms, 8 * nbytes / COPY_BYTES_PER_MS) if device.type == "cuda" else args.rep_ms
    measured = timing.compare(runs, device, check=check, rounds=args.rounds, rep_ms=rep_ms)
    common.record(row, measured)
    common.copy_rates(row, nbytes, 2 * m * n * dtype.itemsize)
    common.speedups(row)
    return row


def _positional(fn: Step) -> Callable:
    return lambda *t: fn(*t)  # (x, r, w) or (x, r, w, b): common.timed passes the leaves positionally


# ----------------------------------------------------------------------------- the sweep


def grid(args) -> list[tuple[int, int]]:
    if args.cpu_smoke:
        return list(SMOKE)
    if args.quick:
        return list(QUICK)
    return [(m, n) for n in NS for m in MS]


def plot(rows: list[dict], args) -> None:
    """GB/s against M, a panel per N, one figure per (kind, mode)."""
    for kind in {r["kind"] for r in rows if "kind" in r}:
        for mode in common.MODES:
            shown = [r for r in rows if r.get("kind") == kind and r.get("mode") == mode and "gbs:copy" in r]
            panels = [(f"N = {n}", [r for r in shown if r["N"] == n]) for n in NS]
            name, title = f"add_norm_{kind}_{mode.replace('+', '_')}", f"fused add + {kind} norm, {args.dtype}"
            report.plot_rows(panels, common.path(args, name, "png"), "gbs", "copy", "GB/s (minimum bytes)",
                             f"{title}, {mode} (GPU time)")  # fmt: skip


def main() -> None:
    p = common.sweep_parser(__doc__.split("\n\n")[0], BUDGET_S, rep_ms=40.0)
    p.add_argument("--kinds", default="rms", help="comma-separated, of rms, layer")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU, Triton's interpreter")
    args = p.parse_args()
    modes = common.modes(p, args)
    kinds = [k for k in args.kinds.split(",") if k]
    if not set(kinds) <= set(EPS):
        p.error(f"--kinds: some of rms, layer, got {args.kinds!r}")
    device = common.setup(args)
    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads or 1)  # tiny tensors: more threads only contend
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first imported (entries)
        args.dtype, args.rep_ms, args.rounds = "fp32", min(args.rep_ms, 20.0), 1
        args.tag = args.tag or "cpu_smoke"
    elif device.type != "cuda":
        p.error("no CUDA device: run with --cpu-smoke for a smoke run of tiny sizes")
    with common.logged(args, "add_norm"):
        run(args, kinds, modes, device)


def run(args, kinds: list[str], modes: tuple[str, ...], device: torch.device) -> None:
    budget = common.budget(args, BUDGET_S)
    start, rows = time.perf_counter(), []
    for m, n in grid(args):
        for kind in kinds:
            for mode in modes:
                row = dict(M=m, N=n, dtype=args.dtype, kind=kind, mode=mode)
                if time.perf_counter() - start > budget:
                    rows.append({**row, "skipped": "time budget"})
                    continue
                try:
                    row = measure_row(m, n, args.dtype, kind, mode, args, device)
                except Exception as exc:  # e.g. out of memory: record and go on
                    row["error"] = timing.describe(exc)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                clock = "gpu_us:" if device.type == "cuda" else "wall_us:"
                times = " ".join(
                    f"{k[len(clock) :]}={v:.1f}" for k, v in row.items() if k.startswith(clock) and v
                )
                took = time.perf_counter() - start
                print(
                    f"[{took:5.0f}s] {m}x{n} {kind} {mode}: us {times or row.get('error', '-')}", flush=True
                )
    liger, why = liger_steps()
    print(why)
    report.save_sweep(args, "add_norm", rows, device, plot)
    keys, metrics = ["M", "N", "kind", "mode"], [("GB/s", "gbs"), ("% copy", "pct_copy")]
    title = f"every entry (x = baseline's time / entry's; {time.perf_counter() - start:.0f} s)"
    report.print_table(*report.long_table(rows, keys, metrics), title=title)
    if device.type == "cuda":
        print(tabulate(targets(rows), headers=["target (fwd+bwd, GPU time)", "worst row", ""]))


TARGETS = (("pytorch", 0.5), ("liger", 1.0))  # triton's GPU time over each entry's, fwd+bwd, at most


def targets(rows: list[dict]) -> list[list[str]]:
    """Per kind and entry of ``TARGETS``: the worst ratio over the forward+backward rows, with PASS
    where it is within the bound on every row measured (MISS where a row is missing its triton time)."""
    lines = []
    for kind in sorted({r["kind"] for r in rows if "kind" in r}):
        shown = [r for r in rows if r.get("kind") == kind and r.get("mode") == "forward+backward"]
        for entry, bound in TARGETS:
            with_entry = [r for r in shown if r.get(f"gpu_us:{entry}")]
            if not with_entry:
                continue
            ratios = [(r.get("gpu_us:triton", float("inf")) / r[f"gpu_us:{entry}"], r) for r in with_entry]
            worst, r = max(ratios, key=lambda t: t[0])
            ok = worst <= bound and len(with_entry) == len(shown)
            lines.append([f"{kind}: triton <= {bound:g}x {entry} on {len(with_entry)}/{len(shown)} rows",
                          f"{worst:.3f}x at {r['M']}x{r['N']}", "PASS" if ok else "MISS"])  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
