"""Where a training step of each bench_mlp block spends its GPU time: per entry, torch.profiler's kernels
of one forward+backward step sorted into products, passes, pointwise, reductions and copies, the
launches, and the time over the floor (the block's GEMMs alone).

    python benchmarks/profile_mlp.py [--out DIR] [--m 8192] [--blocks gpt2,llama-2-7b] [--steps 5]
                                     [--entries pytorch,compile,mlp/dispatch | all] [--gate-pair]
    python benchmarks/profile_mlp.py --cpu-smoke   # tiny sizes on the CPU: CPU ops' self time, no compile

Blocks, entries, weights and the step are bench_mlp's (``bench_mlp.block_row``; ``entries``, ``step`` and
``gemm_floor`` of ``mlp_blocks``), in its forward+backward mode (autograd.grad of x and every weight),
bf16, M = 8192 tokens; ``--gate-pair`` as there (gated blocks: fused_mlp gets the module's own (gate, up)
pair). Default entries: pytorch, compile, composed (non-gated blocks), mlp/dispatch, mlp/triton,
mlp/triton+epilogues and liger (where liger_kernel imports), with torch.mm, the floor, always; ``--entries
all`` profiles every entry bench_mlp times. Each entry is called WARMUP times, then ``--steps`` steps run
under the profiler (CUDA activity) and every number is divided by the steps.

Categories, by kernel name, first match wins (``categorize``):
  products    GEMMs: gemm, nvjet, cutlass, xmma, sm90_, Kernel2, splitK (cuBLAS and CUTLASS),
              inductor's triton_tem_ templates, and this project's Triton GEMMs (the ``*_kernel``
              functions of dispatch/backends/triton/matmul.py and mlp_gemm.py)
  passes      the other Triton kernels: this project's (every ``@triton.jit`` ``*_kernel`` in
              dispatch/backends/triton/), inductor's triton_* and Triton-style ``_*kernel`` names (Liger)
  copies      memcpy, memset, cat and copy kernels
  reductions  ATen's reduce_kernel / Reduce
  pointwise   ATen's elementwise, vectorized, unrolled and dropout kernels
  other       the rest
Columns: total us (the sum of every kernel's time), each category's us, launches (kernels, memcpys
and memsets a step), span us (first kernel's start to last kernel's end, a step: total plus the GPU's
idle gaps, where launches cost), over floor us (total - torch.mm's total). A second table per row
lists the 8 longest kernels of mlp/dispatch and compile. With ``--cpu-smoke`` the profiler records CPU
activity: ops' self CPU time by the same categories of op names (aten::mm, aten::addmm, aten::linear
are products), launches the aten ops a step, span us the wall clock; compile entries are left out
(inductor's CPU compile per block would take most of a smoke run). A smoke run checks the plumbing,
not the numbers.
Results: ``<out>/profile_mlp[-<tag>].json`` (every row's columns as ``<metric>:<entry>``, the top
kernels of every entry as ``top:<entry>``) and the printed log beside it.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import time

import bench_mlp
import common
import report
import torch
from mlp_blocks import (
    BLOCKS,
    DTYPES,
    FLOOR,
    QUICK,
    SMOKE_F,
    SMOKE_H,
    SMOKE_M,
    device_of,
    entries,
    gemm_floor,
    liger_version,
    step,
)

from dispatch import timing

MODE = "forward+backward"  # a training step: the rows
CATEGORIES = ("products", "passes", "pointwise", "reductions", "copies", "other")
DEFAULT_ENTRIES = ("pytorch", "compile", "composed", "mlp/dispatch", "mlp/triton", "mlp/triton+epilogues",
                   "liger")  # fmt: skip
TOP_OF = ("mlp/dispatch", "compile")  # the entries whose longest kernels are printed
TOP = 8
WARMUP = 3  # compile's first call compiles forward and backward; a guard may recompile on the second
TRITON_DIR = os.path.join(common.ROOT, "dispatch", "backends", "triton")
MATMUL_FILES = ("matmul.py", "mlp_gemm.py")  # their kernels run tile_product: GEMMs with epilogues

# GPU kernel names, substrings in order (first match wins); case as cuBLAS and ATen spell them
GPU_PRODUCTS = ("gemm", "Gemm", "nvjet", "cutlass", "xmma", "sm90_", "Kernel2", "splitK", "triton_tem_")
GPU_RULES = (  # FillFunctor: a fill is a memset of another value
    ("copies", ("Memcpy", "Memset", "memcpy", "memset", "CatArray", "copy", "Copy", "FillFunctor")),
    ("reductions", ("reduce_kernel", "Reduce")),
    ("pointwise", ("elementwise", "vectorized", "unrolled", "dropout")),
)
TRITON_STYLE = re.compile(r"^_\w*kernel$")  # a Python function's name: Triton's; ATen's carry C++ signatures
# CPU op names, "aten::" dropped: exact names, then substrings for pointwise
CPU_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addmv", "mv"}
CPU_COPIES = {"copy_", "cat", "clone", "_to_copy", "to", "contiguous", "fill_", "zero_", "zeros", "stack"}
CPU_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "norm", "var", "std", "prod", "sum_to_size"}
CPU_POINTWISE = ("add", "mul", "sub", "div", "gelu", "silu", "relu", "tanh", "sigmoid", "dropout",
                 "bernoulli", "where", "neg", "exp", "pow", "threshold", "_backward")  # fmt: skip


@functools.cache
def triton_kernels() -> tuple[frozenset[str], frozenset[str]]:
    """(GEMM kernels, other kernels): the ``@triton.jit`` functions named ``*_kernel`` in
    dispatch/backends/triton/, the GEMMs those of MATMUL_FILES."""
    jit = re.compile(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\b")
    products: set[str] = set()
    passes: set[str] = set()
    for path in sorted(glob.glob(os.path.join(TRITON_DIR, "*.py"))):
        with open(path) as f:
            names = jit.findall(f.read())
        (products if os.path.basename(path) in MATMUL_FILES else passes).update(names)
    return frozenset(products), frozenset(passes)


def categorize(name: str, cuda: bool) -> str:
    """The category of a kernel (``cuda``) or a CPU op by its name."""
    if not cuda:
        return _categorize_op(name)
    gemms, passes = triton_kernels()
    if name in gemms or any(s in name for s in GPU_PRODUCTS):
        return "products"
    if name in passes or name.startswith("triton_") or TRITON_STYLE.match(name):
        return "passes"
    return next((cat for cat, subs in GPU_RULES if any(s in name for s in subs)), "other")


def _categorize_op(name: str) -> str:
    op = name[len("aten::") :] if name.startswith("aten::") else None
    if op is None:  # autograd nodes, the profiler's own, inductor's compiled regions
        return "passes" if "triton" in name or "cpp_fused" in name else "other"
    for cat, names in (("products", CPU_PRODUCTS), ("copies", CPU_COPIES), ("reductions", CPU_REDUCTIONS)):
        if op in names:
            return cat
    return "pointwise" if any(s in op for s in CPU_POINTWISE) else "other"


def profile_step(fn: timing.Fn, steps: int, device: torch.device) -> dict:
    """One step of ``fn`` by the profiler, averaged over ``steps``: total and per-category us, launches,
    span us and the TOP longest kernels [name, us, calls]."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(WARMUP):
        fn()
    timing.synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        timing.synchronize(device)
    wall_us = (time.perf_counter() - start) * 1e6
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind]
    out = {f"{c}_us": 0.0 for c in CATEGORIES}
    per_name: dict[str, list[float]] = {}
    for e in events:
        # a kernel's device_time_total is its own duration (torch 2.11+); a CPU op's self time excludes
        # its children, so either way the times add up to the step's without counting anything twice
        us = e.device_time_total if cuda else e.self_cpu_time_total
        out[f"{categorize(e.name, cuda)}_us"] += us / steps
        per_name.setdefault(e.name, [0.0, 0])
        per_name[e.name][0] += us / steps
        per_name[e.name][1] += 1
    out["us"] = sum(out[f"{c}_us"] for c in CATEGORIES)
    if cuda and not out["us"]:
        raise RuntimeError("the profiler saw no CUDA kernel time (no CUPTI?)")
    out["launches"] = sum(1 for e in events if cuda or e.name.startswith("aten::")) / steps
    if cuda:
        first, last = min(e.time_range.start for e in events), max(e.time_range.end for e in events)
        out["span_us"] = (last - first) / steps
    else:
        out["span_us"] = wall_us / steps
    longest = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    out["top"] = [[n, us, calls / steps] for n, (us, calls) in longest]
    return out


def profile_row(name: str, m: int, args, device: torch.device) -> dict:
    """One block at M tokens: each chosen entry's step profiled, then the floor's; the over-floor column."""
    row, models, x, gy, ok, why = bench_mlp.block_row(name, m, MODE, args, device)
    p = row["p"]
    row.update(steps=args.steps, clock="CUDA kernels" if device.type == "cuda" else "CPU ops' self time")
    found = entries(models, p, True, ok)
    reasons = {"liger": row.pop("skip:liger", ""), "composed": "gated blocks have none"}
    reasons.update({f"mlp/{b}": r for b, r in why.items()})
    # triton's variants, where triton cannot serve
    for variant in ("mlp/triton+epilogues", "mlp/triton+keep", "compile+mlp/triton"):
        reasons[variant] = why.get("triton", "")
    chosen = list(found) if args.entries == "all" else args.entries.split(",")
    runs = {}
    for n in chosen:
        if args.cpu_smoke and n.startswith("compile"):
            row[f"skip:{n}"] = "--cpu-smoke: no compile entries"
        elif n not in found:
            row[f"skip:{n}"] = reasons.get(n) or f"not an entry of {name}"
        else:
            runs[n] = step(found[n], x, gy, MODE)
    runs[FLOOR] = gemm_floor(models.weights, x, gy, MODE)
    for n, fn in runs.items():  # step() enters each entry's context itself
        try:
            got = profile_step(fn, args.steps, device)
        except Exception as exc:  # one entry failing (out of memory, no kernels seen) must not end the row
            row[f"error:{n}"] = timing.describe(exc)
            continue
        for key, value in got.items():
            row[f"{key}:{n}"] = value
    floor = row.get(f"us:{FLOOR}")
    for n in runs:
        if floor is not None and f"us:{n}" in row:
            row[f"over_floor_us:{n}"] = row[f"us:{n}"] - floor
    return row


# ----------------------------------------------------------------------------- report


def breakdown(row: dict) -> tuple[list[list], list[str]]:
    """A line per profiled entry of ``row``: total, the categories, launches, span, over the floor."""
    metrics = ["us", *(f"{c}_us" for c in CATEGORIES), "launches", "span_us", "over_floor_us"]
    names = [n for n in common.entry_names([row]) if f"us:{n}" in row]
    lines = [[n, *(row.get(f"{k}:{n}") for k in metrics)] for n in names]
    heads = ["entry", "total us", *(f"{c} us" for c in CATEGORIES), "launches", "span us", "over floor us"]
    return lines, heads


def longest(row: dict) -> tuple[list[list], list[str]]:
    """The TOP longest kernels (ops on the CPU) of each TOP_OF entry profiled in ``row``."""
    lines = [[n, kernel[:60], us, calls] for n in TOP_OF for kernel, us, calls in row.get(f"top:{n}", [])]
    return lines, ["entry", "kernel", "us", "calls"]


def print_row(row: dict) -> None:
    where = f"{row['block']} M={row['M']} {row['dtype']} {row['mode']}, {row['clock']}, a step"
    if "error" in row:
        print(f"\n{where}: {row['error']}")
        return
    report.print_table(*breakdown(row), title=f"{where} (mlp/dispatch picks {row['picked']})")
    for k, v in row.items():
        if k.startswith("error:"):
            print(f"  {k[6:]}: {v}")
    lines, heads = longest(row)
    if lines:
        which = ", ".join(n for n in TOP_OF if f"top:{n}" in row)
        report.print_table(lines, heads, title=f"{row['block']}: the {TOP} longest of {which}, a step")


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--m", default=None, help="tokens, comma-separated (default 8192; 64 with --cpu-smoke)")
    p.add_argument("--blocks", default=None, help=f"a subset of {','.join(BLOCKS)} (default all; --quick: 3)")
    p.add_argument("--entries", default=",".join(DEFAULT_ENTRIES), help="comma-separated, or 'all'")
    p.add_argument("--steps", type=int, default=5, help="profiled steps, averaged")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--compile-mode", default="default", help="torch.compile mode (not one with CUDA graphs)")
    p.add_argument("--gate-pair", action="store_true", help="gated blocks: fused_mlp gets a (gate, up) pair")
    p.add_argument("--cpu-smoke", action="store_true", help=f"the CPU, H={SMOKE_H}, F={SMOKE_F}: a smoke run")
    args = p.parse_args()
    blocks = args.blocks.split(",") if args.blocks else list(QUICK if args.quick else BLOCKS)
    if not set(blocks) <= set(BLOCKS) or args.steps < 1:
        p.error(f"--blocks: some of {', '.join(BLOCKS)}; --steps: at least 1")
    ms = [int(v) for v in args.m.split(",")] if args.m else [SMOKE_M if args.cpu_smoke else 8192]
    device = device_of(p, args)
    with common.logged(args, "profile_mlp"):
        run(args, blocks, ms, device)


def run(args, blocks: list[str], ms: list[int], device: torch.device) -> None:
    start, rows = time.perf_counter(), []
    for name in blocks:
        for m in ms:
            try:
                rows.append(profile_row(name, m, args, device))
            except Exception as exc:  # e.g. out of memory: record and go on
                rows.append(dict(block=name, M=m, mode=MODE, error=timing.describe(exc)))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            r = rows[-1]
            totals = " ".join(f"{n}={r[f'us:{n}']:.4g}" for n in common.entry_names([r]) if f"us:{n}" in r)
            took = time.perf_counter() - start
            print(f"[{took:4.0f}s] {name} M={m}: us {totals or r.get('error')}", flush=True)
    report.print_skipped(rows)
    liger_ok, liger = liger_version()
    extra = {"categories": CATEGORIES, "liger_kernel": liger if liger_ok else None,
             "blocks": {b: BLOCKS[b] for b in blocks}}  # fmt: skip
    common.write(args, "profile_mlp", {"rows": rows, **extra}, device)
    for r in rows:
        print_row(r)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
