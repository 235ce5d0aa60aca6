"""fused_linear on the device: every backend vs eager, cuBLASLt, torch.compile and torch.mm alone.

    python3 benchmarks/bench_fused_linear.py --out DIR [--quick] [--variants] [--no-compile]

Rows are (model projection, tokens, dtype, activation, mode); mode "inference" times the forward
alone (no grad), "training" forward + backward (torch.autograd.grad of x, W and b). Entries:
  triton / eager / cublaslt / ...   each registered backend that can serve the call, via fused_linear
  torch      act(F.linear(x, W, b)) with PyTorch's own autograd (the issue's "eager")
  torch.mm   x @ W^T alone (training: the three products) -- the ceiling, no bias, no activation
  compile    torch.compile(mode="max-autotune-no-cudagraphs") of the torch entry (a few rows; its
             compile time is recorded)
Backends that compile per shape (nvfuser, inductor, ...) run on the FOCUS rows only unless
--all-backends. FLOPs: 2MNK forward, 6MNK training. The triton output (and its gradients up to
2**36 MNK) is checked against a float32 reference before timing. A time budget (--budget-s) stops
new rows once spent; rows come in priority order, the issue-6 target rows first. --variants times the
triton main loops (pointer / tma / tma_flat) and save-vs-recompute on a few shapes.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

from benchmarks import common  # noqa: E402
from dispatch.activations import ACTIVATIONS  # noqa: E402
from dispatch.shapes import MODELS  # noqa: E402

# projection name -> (K = in_features, N = out_features)
PAIRS = {
    f"{model}.{proj}": dims
    for model in ("gpt2", "llama-2-7b", "mistral-7b", "llama-2-70b")
    for proj, dims in (("up", MODELS[model]), ("down", MODELS[model][::-1]))
}
TOKENS = (2048, 8192, 16384)  # the targets (M >= 2048); SMALL_TOKENS come last, if the budget allows
SMALL_TOKENS = (128, 512)
FOCUS = {("llama-2-7b.up", 8192), ("mistral-7b.down", 8192), ("gpt2.up", 2048), ("llama-2-70b.up", 8192)}
COMPILE_ROWS = (("llama-2-7b.up", 8192),)  # torch.compile max-autotune: about 30-60 s per mode
COMPILE_RESERVE_S = 60.0  # of the budget, kept for the compile rows
VARIANT_ROWS = (
    ("llama-2-7b.up", 8192),
    ("mistral-7b.down", 8192),
    ("gpt2.up", 2048),
    ("llama-2-70b.up", 4096),
)
H200_MM_TFLOPS, H200_COPY_TBS = 709.0, 4.14  # measured ceilings, benchmarks/NOTES.md (2026-11-30)
MODES = ("inference", "training")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def grid(quick: bool) -> list[tuple[str, int, torch.dtype, str]]:
    """(pair, tokens, dtype, activation) in priority order."""
    if quick:
        return [
            (p, m, torch.bfloat16, "gelu_tanh") for m in (2048, 8192) for p in ("gpt2.up", "llama-2-7b.up")
        ]
    rows = [(p, m, torch.bfloat16, "gelu_tanh") for m in TOKENS for p in PAIRS]
    few = ("llama-2-7b.up", "mistral-7b.down", "llama-2-70b.up")
    rows += [(p, m, torch.bfloat16, a) for a in ("gelu", "relu") for m in (2048, 8192) for p in few]
    rows += [(p, m, torch.float16, "gelu_tanh") for m in (2048, 8192) for p in few]
    rows += [(p, m, torch.bfloat16, "gelu_tanh") for m in SMALL_TOKENS for p in PAIRS]
    return rows


def flops(M: int, N: int, K: int, mode: str) -> float:
    return (6.0 if mode == "training" else 2.0) * M * N * K


def min_bytes(M: int, N: int, K: int, itemsize: int, activation: str, mode: str) -> int:
    """HBM traffic when each tensor moves once. Forward reads x, W and writes y (+ pre, kept for
    backward, with an activation); training adds grad_pre = grad_y * act'(pre) (read 2, write 1),
    grad_x (read grad_pre, W; write M x K) and grad_W (read grad_pre, x; write N x K)."""
    act = activation != "identity"
    fwd = M * K + N * K + M * N * (2 if act else 1)
    if mode == "inference":
        return itemsize * fwd
    return itemsize * (fwd + (3 * M * N if act else 0) + 2 * (M * N + M * K + N * K))


# ----------------------------------------------------------------------------- entries


def _torch_fn(activation: str) -> Callable:
    act = ACTIVATIONS[activation].forward
    return lambda x, w, b: act(F.linear(x, w, b))


def _backend_fn(name: str, activation: str) -> Callable:
    from dispatch import fused_linear

    return lambda x, w, b: fused_linear(x, w, b, activation, backend=name)


def _timed(fn: Callable, mode: str, x, w, b, gy) -> Callable[[], object]:
    if mode == "inference":

        def run():
            with torch.no_grad():
                return fn(x, w, b)

        return run
    leaves = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_())
    return lambda: torch.autograd.grad(fn(*leaves), leaves, gy)


def _mm_ceiling(mode: str, x, w, gy) -> Callable[[], object]:
    xd, wd = x.detach(), w.detach()
    if mode == "inference":
        return lambda: torch.mm(xd, wd.t())
    return lambda: (torch.mm(xd, wd.t()), torch.mm(gy, wd), torch.mm(gy.t(), xd))


def _reasons(name: str, x, N: int, activation: str, mode: str) -> list[str]:
    from dispatch.registry import Call, backends

    call = Call(
        "fused_linear", x.device, x.dtype, (x.shape[0], N, x.shape[1]), activation, False, mode == "training"
    )
    return backends()[name].not_supported_reasons(call)


def _validate(fn: Callable, mode: str, x, w, b, gy, activation: str) -> str:
    """'ok', or what missed: triton vs a float32 reference, tolerance from the torch entry's error."""
    from dispatch.tolerances import allowed_error, max_error

    M, K = x.shape
    N = w.shape[0]
    rows = slice(0, min(M, 256)) if mode == "inference" or M * N * K > 2**36 else slice(None)
    xs, gys = x.detach()[rows], gy[rows]
    leaves = [t.detach().requires_grad_(mode == "training") for t in (xs, w, b)]
    ref_leaves = [t.detach().float().requires_grad_(mode == "training") for t in (xs, w, b)]
    base_leaves = [t.detach().requires_grad_(mode == "training") for t in (xs, w, b)]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        outs = [fn(*leaves), _torch_fn(activation)(*ref_leaves), _torch_fn(activation)(*base_leaves)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    results = [[o.detach()] for o in outs]
    if mode == "training" and rows == slice(None):
        for res, out, ls in zip(results, outs, (leaves, ref_leaves, base_leaves)):
            res.extend(torch.autograd.grad(out, ls, gys.to(out.dtype)))
    bad = []
    for name, got, ref, base in zip(("y", "grad_x", "grad_w", "grad_b"), *results):
        err, allowed = max_error(got, ref), allowed_error(ref, got.dtype, base)
        if not err <= allowed:
            bad.append(f"{name} err {err:.3g} > {allowed:.3g}")
    return "; ".join(bad) or "ok"


def _first_call(fn: Callable[[], object]) -> Optional[str]:
    """One untimed call (compiles, allocations): None, or the error that stopped it."""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except Exception as err:  # one failing entry must not end the run
        torch.cuda.synchronize()
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def _measure(fn: Callable[[], object], rep_ms: float) -> tuple[Optional[float], Optional[str]]:
    """Median ms of ``fn`` after one untimed call (compiles), or the error that stopped it."""
    err = _first_call(fn)
    if err:
        return None, err
    return common.time_ms(fn, warmup_ms=max(5, int(rep_ms) // 4), rep_ms=int(rep_ms)), None


def measure_row(pair, M, dtype, activation, mode, args, backend_names) -> dict:
    K, N = PAIRS[pair]
    row = dict(pair=pair, M=M, N=N, K=K, dtype=DTYPE_NAMES[dtype], act=activation, mode=mode)
    row.update(
        gflop=flops(M, N, K, mode) / 1e9, mbytes=min_bytes(M, N, K, dtype.itemsize, activation, mode) / 1e6
    )
    row["floor_ms"] = max(flops(M, N, K, mode) / H200_MM_TFLOPS / 1e9, row["mbytes"] / H200_COPY_TBS / 1e6)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    gy = torch.randn(M, N, device="cuda", dtype=dtype)
    entries: dict[str, Callable] = {}
    for name in backend_names:
        if name not in ("triton", "eager", "cublaslt") and not (args.all_backends or (pair, M) in FOCUS):
            continue
        why = _reasons(name, x, N, activation, mode)
        if why:
            row[f"skip:{name}"] = "; ".join(why)[:200]
            continue
        entries[name] = _backend_fn(name, activation)
    entries["torch"] = _torch_fn(activation)
    if "triton" in entries:
        row["valid"] = _validate(entries["triton"], mode, x, w, b, gy, activation)
    rep_ms = max(args.rep_ms, 8 * row["floor_ms"])  # at least ~5 timed runs on the big shapes
    runs = {name: _timed(fn, mode, x, w, b, gy) for name, fn in entries.items()}
    runs["torch.mm"] = _mm_ceiling(mode, x, w, gy)
    for name, ms in interleaved(runs, rep_ms, args.rounds, row).items():
        row[f"ms:{name}"] = ms
    _ratios(row, M, N, K, mode)
    return row


def interleaved(runs: dict[str, Callable[[], object]], rep_ms: float, rounds: int, row: dict) -> dict:
    """Median ms of each entry over ``rounds`` rounds, each round timing every entry once (do_bench,
    ``rep_ms / rounds``) in an order rotated from round to round. The H200's clock follows its power
    and temperature: the same kernel measured a few seconds apart differed by up to 10% (sweep_epilogue,
    session 10), so ratios between entries timed one after another carried that drift; within a round
    the entries see the same clock. ``spread:NAME`` in ``row``: (max - min) / median over the rounds.
    An entry whose first (untimed) call fails is left out, its error in ``row``."""
    alive = {}
    for name, fn in runs.items():
        err = _first_call(fn)
        if err:
            row[f"error:{name}"] = err
        else:
            alive[name] = fn
    samples: dict[str, list[float]] = {name: [] for name in alive}
    names = list(alive)
    per_round = max(5, int(rep_ms / rounds))
    for r in range(rounds if names else 0):
        first = r % len(names)
        for name in names[first:] + names[:first]:
            ms = common.time_ms(alive[name], warmup_ms=max(5, per_round // 4), rep_ms=per_round)
            samples[name].append(ms)
    out = {}
    for name, got in samples.items():
        got.sort()
        out[name] = got[len(got) // 2]
        if rounds > 1:
            row[f"spread:{name}"] = (got[-1] - got[0]) / out[name]
    return out


def add_compiled(row: dict, args) -> None:
    """torch.compile(max-autotune-no-cudagraphs) of the torch entry on ``row``'s shape: compile seconds
    (first call) and steady-state time."""
    M, N, K, mode = row["M"], row["N"], row["K"], row["mode"]
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[row["dtype"]]
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    gy = torch.randn(M, N, device="cuda", dtype=dtype)
    row.update(_compiled(row["act"], mode, x, w, b, gy, max(args.rep_ms, 8 * row["floor_ms"])))
    _ratios(row, M, N, K, mode)


def _compiled(activation, mode, x, w, b, gy, rep_ms) -> dict:
    torch._dynamo.reset()
    fn = torch.compile(_torch_fn(activation), mode="max-autotune-no-cudagraphs", dynamic=False)
    run = _timed(fn, mode, x, w, b, gy)
    start = time.perf_counter()
    try:
        run()
        torch.cuda.synchronize()
    except Exception as err:
        return {"error:compile": f"{type(err).__name__}: {str(err)[:160]}"}
    out = {"compile_s": time.perf_counter() - start}
    out["ms:compile"], err = _measure(run, rep_ms)
    if err:
        out["error:compile"] = err
    return out


def _ratios(row: dict, M: int, N: int, K: int, mode: str) -> None:
    for key in [k for k in row if k.startswith("ms:")]:
        if row[key]:
            row["tflops:" + key[3:]] = flops(M, N, K, mode) / row[key] / 1e9
    t = row.get("ms:triton")
    if not t:
        return
    eager = [row[k] for k in ("ms:eager", "ms:torch") if row.get(k)]
    if eager:
        row["x_eager"] = min(eager) / t  # the faster of the eager backend and plain torch
    if row.get("ms:cublaslt"):
        row["x_cublaslt"] = row["ms:cublaslt"] / t
    if row.get("ms:torch.mm"):
        row["x_mm"] = row["ms:torch.mm"] / t


# ----------------------------------------------------------------------------- variants


def variant_rows(args) -> list[dict]:
    """Forward (saving pre or not) and backward (saved pre or recompute) of each triton main loop, and
    the forward with each tile config forced, bf16 gelu_tanh, on VARIANT_ROWS; times in ms."""
    from backends.triton import fused_linear as triton_op
    from backends.triton import matmul

    act, needs = "gelu_tanh", (True, True, True)
    rows = []
    for pair, M in VARIANT_ROWS[: 2 if args.quick else None]:
        K, N = PAIRS[pair]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        pre = triton_op.forward(x, w, b, act)[1]
        cases = {
            "fwd": lambda: triton_op.forward(x, w, b, act),
            "fwd_nosave": lambda: triton_op.launch_forward(x, w, b, act, save_pre=False),
            "bwd_saved": lambda: triton_op.backward(gy, x, w, b, pre, act, needs),
            "bwd_recompute": lambda: triton_op.backward(gy, x, w, b, None, act, needs),
        }
        row = dict(pair=pair, M=M, N=N, K=K, config=str(matmul.pick_config(M, N, K, x.dtype, x.device)))
        rep_ms = max(args.rep_ms, 8 * flops(M, N, K, "training") / H200_MM_TFLOPS / 1e9)
        for variant in matmul.VARIANTS:
            with matmul.options(variant=variant):
                for label, fn in cases.items():
                    row[f"{variant}:{label}"], err = _measure(fn, rep_ms)
                    if err:
                        row[f"error:{variant}:{label}"] = err
            t = {label: row[f"{variant}:{label}"] for label in cases}
            if None not in t.values():  # training either way: keep pre, or recompute it in backward
                row[f"{variant}:train_saved"] = t["fwd"] + t["bwd_saved"]
                row[f"{variant}:train_recompute"] = t["fwd_nosave"] + t["bwd_recompute"]
        for cfg in matmul.CONFIGS_16:  # each candidate of the rule forced: does the rule pick the best?
            with matmul.options(variant="pointer", config=cfg):
                row[f"pointer:fwd:{cfg}"], _ = _measure(cases["fwd"], rep_ms)
        row["torch.mm"], _ = _measure(lambda: torch.mm(x, w.t()), rep_ms)
        rows.append(row)
        times = ", ".join(f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, float))
        print(f"variants {pair} M={M} ({row['config']}): {times}")
    return rows


# ----------------------------------------------------------------------------- report


TARGETS = {  # issue 6, bf16, M >= 2048: (ratio column, goal) per mode; ratio = other's time / triton's
    "inference": {"x_mm": 0.97, "x_cublaslt": 1.0, "x_eager": 1.1},
    "training": {"x_eager": 1.05},
}


def summary(rows: list[dict]) -> list[list]:
    """One line per bf16 row with M >= 2048: triton's TFLOP/s and each ratio, PASS / MISS where the
    issue sets a target (training's x_mm, vs the three bare products, is for information)."""
    out = []
    for r in rows:
        if r.get("dtype") != "bf16" or r.get("M", 0) < 2048 or not r.get("ms:triton"):
            continue
        line = [r["pair"], r["M"], r["act"], r["mode"], f"{r['tflops:triton']:.0f}", r.get("valid", "")[:24]]
        for col in ("x_mm", "x_cublaslt", "x_eager"):
            v, goal = r.get(col), TARGETS[r["mode"]].get(col)
            if v is None:
                line.append("n/a")
            else:
                line.append(f"{v:.2f}" if goal is None else f"{'PASS' if v >= goal else 'MISS'} {v:.2f}")
        out.append(line)
    return out


def plot(rows: list[dict], out: str) -> None:
    for mode in MODES:
        panels = [
            (f"{pair} (K={PAIRS[pair][0]}, N={PAIRS[pair][1]})",
             [r for r in rows if r["pair"] == pair and r["mode"] == mode and r["dtype"] == "bf16"
              and r["act"] == "gelu_tanh"])  # fmt: skip
            for pair in PAIRS
        ]
        path = os.path.join(out, f"fused_linear_{mode}.png")
        common.plot_panels(panels, "tflops", "torch.mm", "TFLOP/s", f"fused_linear bf16 gelu_tanh, {mode}", path)


def run_grid(args, names: list[str], start: float, stop_at: float) -> list[dict]:
    rows: list[dict] = []
    for pair, M, dtype, act in grid(args.quick):
        for mode in MODES:
            key = dict(pair=pair, M=M, dtype=DTYPE_NAMES[dtype], act=act, mode=mode)
            if time.perf_counter() - start > stop_at:
                rows.append(dict(key, skipped="time budget"))
                continue
            try:
                rows.append(measure_row(pair, M, dtype, act, mode, args, names))
            except Exception as err:  # e.g. out of memory: record and go on
                rows.append(dict(key, error=repr(err)[:200]))
            torch.cuda.empty_cache()
            tflops = " ".join(f"{k[7:]}={v:.0f}" for k, v in rows[-1].items() if k.startswith("tflops:"))
            print(f"[{time.perf_counter() - start:4.0f}s] {pair} M={M} {key['dtype']} {act} {mode}: {tflops}")
    return rows


def run_compile(rows: list[dict], args, start: float, stop_at: float) -> None:
    for r in rows:
        if (r["pair"], r["M"]) not in COMPILE_ROWS or r["act"] != "gelu_tanh" or "ms:torch" not in r:
            continue
        if time.perf_counter() - start > stop_at:
            r["error:compile"] = "time budget"
            continue
        try:
            add_compiled(r, args)
        except Exception as err:
            r["error:compile"] = repr(err)[:200]
        print(
            f"[{time.perf_counter() - start:4.0f}s] torch.compile {r['pair']} M={r['M']} {r['mode']}: "
            f"{r.get('compile_s', float('nan')):.0f} s to compile, {r.get('tflops:compile') or 0:.0f} TFLOP/s"
        )


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--variants", action="store_true", help="also time triton's main loops and save/recompute")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile rows")
    p.add_argument("--all-backends", action="store_true", help="per-shape compilers on every row, not FOCUS")
    p.add_argument("--budget-s", type=float, help="start no row after this many seconds (210; quick 45)")
    p.add_argument("--rep-ms", type=int, default=60, help="do_bench time per entry (ms), over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row (median)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_linear needs a CUDA GPU (timings on the interpreter mean nothing)")
    from dispatch.registry import backends

    names = [n for n, be in backends().items() if not be.unavailable()]
    budget = args.budget_s or (45.0 if args.quick else 210.0)
    compiling = args.compile and not args.quick
    start = time.perf_counter()
    rows = run_grid(args, names, start, budget - (COMPILE_RESERVE_S if compiling else 0.0))
    if compiling:
        run_compile(rows, args, start, budget)
    others = tuple(n for n in names if n not in ("triton", "eager", "cublaslt"))
    entries = ("triton", "torch.mm", "cublaslt", "eager", "torch", "compile") + others
    shown = ["pair", "M", "act", "dtype", "mode", "floor_ms", *(f"tflops:{n}" for n in entries)]
    common.write("fused_linear", rows, args.out, headers=shown + ["x_eager", "x_cublaslt", "x_mm", "valid"])
    if args.variants:
        try:
            common.write("fused_linear_variants", variant_rows(args), args.out)
        except Exception as err:  # keep the main results and the summary
            print(f"variants failed: {err!r}")
    if common.have_matplotlib() and not args.quick:
        try:
            plot(rows, args.out)
        except Exception as err:
            print(f"plot failed: {err!r}")
    took = time.perf_counter() - start
    print(f"\nissue-6 targets, bf16, M >= 2048 (ratio = other's time / triton's; run took {took:.0f} s)")
    heads = [
        "pair",
        "M",
        "act",
        "mode",
        "triton TFLOP/s",
        "valid",
        "x_mm (inf >=0.97)",
        "x_cublaslt (inf >=1)",
    ]
    print(tabulate(summary(rows), headers=heads + ["x_eager (inf >=1.1, train >=1.05)"]))


if __name__ == "__main__":
    main()
