"""Launch settings of the triton add + norm kernels, side by side with Liger and plain PyTorch: each
variant sets ``dispatch.backends.triton.add_norm``'s constants (elements a thread, programs an SM, the
tile), and every variant is timed on the GPU clock (do_bench_cudagraph) in interleaved rounds, forward
(no_grad) and forward+backward apart, at the widths and token counts of
bench_add_norm. Last, per mode and width, the fastest variant by token count.

    python benchmarks/sweep_add_norm.py [--out DIR] [--variants base,p1,...] [--budget-s 240]
"""

from __future__ import annotations

import time

import bench_add_norm as bench
import common
import torch
from tabulate import tabulate

from dispatch import timing
from dispatch.backends.triton import add_norm as kernels

# name -> constants of dispatch.backends.triton.add_norm (the rest as shipped)
VARIANTS = {
    "base": {},
    "b8": dict(BACKWARD_PER_THREAD=8),  # the setting before 2026-12-06's sweep
    "u16": dict(UNTIMED_BACKWARD_PER_THREAD=16),  # rows past 4096 at 16 a thread too
    "p1": dict(PROGRAMS_PER_SM=1),
    "t2048": dict(TILE=2048),
    "p1t1024": dict(PROGRAMS_PER_SM=1, TILE=1024),
    "t8192": dict(TILE=8192),
}
MODES = ("forward", "forward+backward")  # backward alone: its kept graph cannot be captured
TUNED = ("FORWARD_PER_THREAD", "BACKWARD_PER_THREAD", "UNTIMED_BACKWARD_PER_THREAD", "PROGRAMS_PER_SM",
         "TILE")
SHIPPED = {k: getattr(kernels, k) for k in TUNED}


def use(constants: dict) -> None:
    """The shipped constants, then ``constants``; the launch-setting caches emptied."""
    for name, value in {**SHIPPED, **constants}.items():
        setattr(kernels, name, value)
    kernels.config.cache_clear()
    kernels._programs_cap.cache_clear()


def row(m: int, n: int, kind: str, mode: str, names: list[str], args, device) -> dict:
    dtype = bench.DTYPES[args.dtype]
    x, r, gy, gh = (torch.randn(m, n, device=device).to(dtype) for _ in range(4))
    w = torch.randn(n, device=device).mul_(0.3).add_(1).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if kind == "layer" else None
    inputs = tuple(t for t in (x, r, w, b) if t is not None)
    others = {"pytorch": bench.pytorch(kind)}
    if kind == "rms":
        others.update({k: v for k, v in bench.liger_steps()[0].items() if k == "liger"})
    tri = bench.triton_step(kind)
    entries = [(v, tri) for v in names] + list(others.items())
    got: dict[str, list[float]] = {name: [] for name, _ in entries}
    for rnd in range(args.rounds):
        shift = rnd % len(entries)
        for name, fn in entries[shift:] + entries[:shift]:
            use(VARIANTS.get(name, {}))
            run = common.timed(bench._positional(fn), mode, inputs, (gy, gh))
            run()
            got[name].append(timing.gpu_ms(run, args.rep_ms) * 1e3)
    use({})
    out = dict(M=m, N=n, kind=kind, mode=mode)
    out.update({f"us:{name}": sorted(t)[len(t) // 2] for name, t in got.items()})
    return out


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--kinds", default="rms,layer")
    p.add_argument("--dtype", default="bf16", choices=tuple(bench.DTYPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep-ms", type=float, default=10.0)
    p.add_argument("--budget-s", type=float, default=240.0)
    args = p.parse_args()
    device = common.setup(args)
    if device.type != "cuda":
        p.error("needs a CUDA device")
    names = [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    rows, start = [], time.perf_counter()
    shapes = [(m, n) for m in sorted(bench.MS) for n in bench.NS]  # the short calls first
    with common.logged(args, "sweep_add_norm"):
        for m, n in shapes:
            for kind in args.kinds.split(","):
                for mode in MODES:
                    if time.perf_counter() - start > args.budget_s:
                        continue
                    rows.append(row(m, n, kind, mode, names, args, device))
                    r = rows[-1]
                    print(f"[{time.perf_counter() - start:4.0f}s] {m}x{n} {kind} {mode}: "
                          + " ".join(f"{k[3:]}={v:.1f}" for k, v in r.items() if k.startswith("us:")), flush=True)  # fmt: skip
        common.write(args, "sweep_add_norm", {"variants": VARIANTS, "rows": rows}, device)
        heads = ["M", "N", "kind", "mode", *names, "pytorch", "liger", "best", "best / base", "best / liger"]
        table = []
        for r in rows:
            best = min(names, key=lambda v: r[f"us:{v}"])
            liger = r.get("us:liger")
            table.append([r["M"], r["N"], r["kind"], r["mode"], *(r[f"us:{v}"] for v in names), r["us:pytorch"],
                          liger, best, r[f"us:{best}"] / r[f"us:{names[0]}"],
                          r[f"us:{best}"] / liger if liger else None])  # fmt: skip
        print(tabulate(table, headers=heads, floatfmt=".3g"))


if __name__ == "__main__":
    main()
