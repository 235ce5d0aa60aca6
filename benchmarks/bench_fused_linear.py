"""fused_linear: every backend next to plain PyTorch, torch.compile and torch.mm alone.

    python benchmarks/bench_fused_linear.py [--out DIR] [--quick] [--modes forward,backward]

Inputs: the MLP projections of GPT-2, LLaMA-2-7B, Mistral-7B and LLaMA-2-70B (dispatch.contracts.shapes; "up"
is hidden -> intermediate, "down" the reverse) at 2048, 8192 and 16384 tokens, bf16 gelu_tanh first,
then gelu / relu and fp16 on a few, then 128 and 512 tokens; on a machine without CUDA a few small
float32 shapes (a smoke run). Modes: forward (no grad), backward (autograd.grad of x, W and b from a
kept graph), forward+backward. Entries:
  <backend>  each registered backend that serves the call, fused_linear(backend=...); the others are
             listed with the registry's reason (the pytorch backend's kernels are the pytorch entry's
             composite: timed once, as that entry)
  dispatch   the public op choosing for itself (its pick in the "picked" column)
  pytorch    act(F.linear(x, W, b)): the composite a user writes, under PyTorch's autograd, called
             directly (``dispatch.ops.fused_linear.baseline``)
  compile    torch.compile(dynamic=True) of that composite (--compile-mode to autotune)
  torch.mm   x @ W^T alone (backward: the two gradient products; forward+backward: all three), the
             ceiling: no bias, no activation
FLOPs 2MNK forward, 4MNK backward. Per entry: GPU time (CUDA graph) and wall time (do_bench;
perf_counter on the CPU), TFLOP/s and % of torch.mm's (GPU time), speedups vs pytorch and compile on
both clocks. Every entry's output (and gradients, up to 2**36 MNK) is checked against a float32
reference before timing, allowed twice the pytorch entry's error. nvfuser compiles per shape: FOCUS
rows only unless --all-backends. A time budget stops new rows once spent.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import common
import report
import torch
import torch.nn.functional as F

from dispatch import timing
from dispatch.contracts.activations import ACTIVATIONS
from dispatch.contracts.shapes import MODELS

# projection name -> (K = in_features, N = out_features)
PAIRS = {
    f"{model}.{proj}": dims
    for model in ("gpt2", "llama-2-7b", "mistral-7b", "llama-2-70b")
    for proj, dims in (("up", MODELS[model]), ("down", MODELS[model][::-1]))
}
CPU_PAIRS = {"small.up": (256, 1024), "small.down": (1024, 256)}
TOKENS = (2048, 8192, 16384)
SMALL_TOKENS = (128, 512)  # last, if the budget allows
FOCUS = {("llama-2-7b.up", 8192), ("mistral-7b.down", 8192), ("gpt2.up", 2048), ("llama-2-70b.up", 8192)}
# Measured H200 ceilings (benchmarks/PERF.md): bf16 torch.mm 709 TFLOP/s at 8192x4096x16384, copy 4.14 TB/s
H200_MM_TFLOPS, H200_COPY_TBS = 709.0, 4.14
MODES = common.MODES
BUDGET_S = (210.0, 45.0)  # seconds until no new row starts: full run, --quick
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def grid(device: torch.device, quick: bool) -> list[tuple[str, int, torch.dtype, str]]:
    """(pair, tokens, dtype, activation) in priority order."""
    if device.type != "cuda":
        return [
            (p, m, torch.float32, "gelu_tanh") for m in ((64,) if quick else (64, 256)) for p in CPU_PAIRS
        ]
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
    return {"forward": 2.0, "backward": 4.0, "forward+backward": 6.0}[mode] * M * N * K


def min_bytes(M: int, N: int, K: int, itemsize: int, activation: str, mode: str) -> int:
    """HBM traffic when each tensor moves once. Forward reads x, W and writes y (+ the pre-activation,
    kept for backward, with an activation); backward computes grad_pre = grad_y * act'(pre) (read 2,
    write 1), grad_x (read grad_pre and W, write M x K) and grad_W (read grad_pre and x, write N x K)."""
    act = activation != "identity"
    fwd = M * K + N * K + M * N * (2 if act else 1)
    bwd = (3 * M * N if act else 0) + 2 * (M * N + M * K + N * K)
    return itemsize * {"forward": fwd, "backward": bwd, "forward+backward": fwd + bwd}[mode]


# ----------------------------------------------------------------------------- entries


def _pytorch(activation: str) -> Callable:
    from dispatch.ops.fused_linear import baseline

    return lambda x, w, b: baseline(x, w, b, activation)


@functools.cache
def _compiled(activation: str, mode: str, backward_only: bool) -> Callable:
    """One compiled function per activation: dynamic=True (default mode), so new shapes reuse its
    graph. The backward mode gets its own, traced without buffer donation (``common.timed``)."""
    composite = _pytorch(activation)

    def kept_graph(x, w, b):  # a code object of its own: dynamo caches graphs per code object
        return composite(x, w, b)

    fn = kept_graph if backward_only else composite
    if mode == "default":
        return torch.compile(fn, dynamic=True)
    return torch.compile(fn, mode=mode, dynamic=False)


def _op(backend, activation: str) -> Callable:
    from dispatch import fused_linear

    return lambda x, w, b: fused_linear(x, w, b, activation, backend=backend)


def mm_ceiling(mode: str, x, w, gy) -> timing.Fn:
    xd, wd = x.detach(), w.detach()
    if mode == "forward":
        return lambda: torch.mm(xd, wd.t())
    if mode == "backward":
        return lambda: (torch.mm(gy, wd), torch.mm(gy.t(), xd))
    return lambda: (torch.mm(xd, wd.t()), torch.mm(gy, wd), torch.mm(gy.t(), xd))


def validate(fn: Callable, mode: str, x, w, b, gy, activation: str) -> str:
    """'ok', or what missed: against a float32 reference, allowed twice the pytorch entry's error plus
    the dtype's tolerance. Large shapes check the first 256 rows' output only (the float32 reference
    of a 2**36-MNK training call costs more than the benchmark's row)."""
    from dispatch.contracts.tolerances import allowed_error, max_error

    M, K = x.shape
    N = w.shape[0]
    grads = mode != "forward" and M * N * K <= 2**36
    rows = slice(None) if grads or M <= 256 else slice(0, 256)
    xs, gys = x.detach()[rows], gy[rows]
    sides = []
    for f, dtype in ((fn, None), (_pytorch(activation), torch.float32), (_pytorch(activation), None)):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_(grads) for t in (xs, w, b)]
        sides.append((f, leaves))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        results = []
        for f, leaves in sides:
            with torch.set_grad_enabled(grads):
                y = f(*leaves)
            res = [y.detach()]
            if grads:
                res.extend(torch.autograd.grad(y, leaves, gys.to(y.dtype)))
            results.append(res)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    bad = []
    for name, got, ref, base in zip(("y", "grad_x", "grad_w", "grad_b"), *results):
        err, allowed = max_error(got, ref), allowed_error(ref, got.dtype, base)
        if not err <= allowed:
            bad.append(f"{name} err {err:.3g} > {allowed:.3g}")
    return "; ".join(bad) or "ok"


def entries(row: dict, x, w, b, names: list[str], focus: bool, compile_mode: str) -> dict[str, Callable]:
    from dispatch import explain
    from dispatch.registry import Call

    M, K = x.shape
    N, act, mode = w.shape[0], row["act"], row["mode"]
    call = Call("fused_linear", x.device, x.dtype, (M, N, K), mode != "forward", ("activation",), (act,))
    out = common.backend_entries(row, call, names, focus, lambda name: _op(name, act))
    with torch.set_grad_enabled(mode != "forward"):
        probe = x.detach().requires_grad_(mode != "forward")
        row["picked"] = explain("fused_linear", probe, w, b, act).backend.name
    out["dispatch"] = _op(None, act)
    out["pytorch"] = _pytorch(act)
    out["compile"] = _compiled(act, compile_mode, mode == "backward")
    return out


def measure_row(pair, M, dtype, act, mode, args, names, device) -> dict:
    K, N = (CPU_PAIRS if device.type != "cuda" else PAIRS)[pair]
    row = dict(pair=pair, M=M, N=N, K=K, dtype=DTYPE_NAMES[dtype], act=act, mode=mode)
    row.update(gflop=flops(M, N, K, mode) / 1e9, mbytes=min_bytes(M, N, K, dtype.itemsize, act, mode) / 1e6)
    row["floor_us"] = 1e3 * max(row["gflop"] / H200_MM_TFLOPS, row["mbytes"] / H200_COPY_TBS / 1e3)
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
    b = torch.randn(N, device=device, dtype=dtype)
    gy = torch.randn(M, N, device=device, dtype=dtype)
    fns = entries(row, x, w, b, names, args.all_backends or (pair, M) in FOCUS, args.compile_mode)
    runs = {name: common.timed(fn, mode, (x, w, b), gy) for name, fn in fns.items()}
    runs["torch.mm"] = mm_ceiling(mode, x, w, gy)

    def check(name: str) -> str:
        if name == "torch.mm":
            return ""
        return validate(fns[name], mode, x, w, b, gy, act)

    rep_ms = max(args.rep_ms, 8e-3 * row["floor_us"])  # >= ~8 timed calls on the big shapes
    measured = timing.compare(runs, device, check=check, rounds=args.rounds, rep_ms=rep_ms)
    common.record(row, measured)
    rates(row, M, N, K, mode)
    common.speedups(row)
    return row


def rates(row: dict, M: int, N: int, K: int, mode: str) -> None:
    """TFLOP/s and % of torch.mm's, on the GPU clock (wall on the CPU)."""
    clock = "gpu_us:" if any(k.startswith("gpu_us:") for k in row) else "wall_us:"
    mm = row.get(clock + "torch.mm")
    for key in [k for k in row if k.startswith(clock) and row[k]]:
        name = key[len(clock) :]
        row[f"tflops:{name}"] = flops(M, N, K, mode) / row[key] / 1e6
        if mm and name != "torch.mm":
            row[f"pct_mm:{name}"] = 100 * mm / row[key]


# ----------------------------------------------------------------------------- breakdown

BREAKDOWN_SHAPES = (("gpt2.up", 512), ("gpt2.up", 8192), ("gpt2.down", 8192), ("llama-2-7b.up", 8192))


def breakdown_pieces(x, w, b, gy, act: str) -> dict[str, timing.Fn]:
    """Where a training call's GPU time goes: the composite and the triton backend whole, then each of
    their kernels alone (cuBLAS products, PyTorch's activation passes and bias-gradient sum, the
    triton backend's bias + activation passes)."""
    from dispatch.backends.triton import bias_act_dropout as triton_bad

    from dispatch import fused_linear

    composite = _pytorch(act)
    a = ACTIVATIONS[act]
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    pre = F.linear(x, w, b)

    def train(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, gy)

    pieces = {
        "pytorch": train(composite),
        "triton": train(lambda *t: fused_linear(*t, act, backend="triton")),
        "three torch.mm": lambda: (torch.mm(x, w.t()), torch.mm(gy, w), torch.mm(gy.t(), x)),
        "pytorch: addmm": lambda: torch.addmm(b, x, w.t()),
        "pytorch: activation": lambda: a.forward(pre),
        "pytorch: activation backward": lambda: a.backward(gy, pre),
        "pytorch: grad_b sum": lambda: gy.sum(0),
        "triton: activation pass": lambda: triton_bad.KERNELS.forward(pre, None, act, 0.0, None),
        "triton: grad_pre + grad_b pass": lambda: triton_bad.backward_pass(
            gy, pre, None, act, 0.0, None, True, True
        ),
    }
    if a.backward is None:
        del pieces["pytorch: activation backward"]
    return pieces


def breakdown(args, device: torch.device) -> None:
    """``--breakdown``: GPU time (CUDA graph) of each piece, two interleaved rounds, min; and the host
    cost of a training call (CPU clock, the GPU queue kept busy by a sleep kernel so the host never
    waits on it: what the host spends per call, not the GPU)."""
    lines, result = [], []
    for pair, M in BREAKDOWN_SHAPES:
        K, N = PAIRS[pair]
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5
        b = torch.randn(N, device=device, dtype=torch.bfloat16)
        gy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        pieces = breakdown_pieces(x, w, b, gy, "gelu_tanh")
        got: dict[str, list[float]] = {}
        for _ in range(2):
            for name, fn in pieces.items():
                got.setdefault(name, []).append(timing.gpu_ms(fn, rep_ms=30) * 1e3)
        base = min(got["pytorch"])
        for name, us in got.items():
            lines.append([f"{pair} M={M}", name, round(min(us), 1), round(base / min(us), 3)])
        for name in ("pytorch", "triton"):
            host = timing.host_ms(pieces[name], device)[0] * 1e3
            lines.append([f"{pair} M={M}", f"host: {name}", round(host, 1), None])
        result += [dict(zip(("shape", "entry", "us", "x_pytorch"), line)) for line in lines[-len(got) - 2 :]]
    common.write(args, "fused_linear_breakdown", {"rows": result}, device)
    title = "bf16 gelu_tanh training: GPU us (CUDA graph), host us"
    report.print_table(lines, ["shape", "entry", "us", "x pytorch"], title=title)


# ----------------------------------------------------------------------------- report


def plot(rows: list[dict], args) -> None:
    """TFLOP/s against M, a panel per projection, bf16 gelu_tanh, one figure per mode."""
    for mode in MODES:
        shown = [r for r in rows if (r["mode"], r["dtype"], r["act"]) == (mode, "bf16", "gelu_tanh")]
        panels = [
            (f"{pair} (K={k}, N={n})", [r for r in shown if r["pair"] == pair and "tflops:torch.mm" in r])
            for pair, (k, n) in PAIRS.items()
        ]
        out = common.path(args, f"fused_linear_{mode.replace('+', '_')}", "png")
        title = f"fused_linear bf16 gelu_tanh, {mode} (GPU time)"
        report.plot_rows(panels, out, "tflops", "torch.mm", "TFLOP/s", title)


def main() -> None:
    p = common.sweep_parser(__doc__.split("\n\n")[0], BUDGET_S, rep_ms=60.0)
    p.add_argument("--compile-mode", default="default", help="torch.compile mode of the compile entry")
    p.add_argument(
        "--activation", help="every row with this activation instead (duplicates dropped), e.g. relu"
    )
    p.add_argument(
        "--breakdown", action="store_true", help="GPU time of each piece of a training call (CUDA only)"
    )
    args = p.parse_args()
    modes = common.modes(p, args)
    device = common.setup(args)
    if args.breakdown:
        if device.type != "cuda":
            p.error("--breakdown times kernels on the GPU's clock: it needs CUDA")
        return breakdown(args, device)
    names = common.registered()
    budget = common.budget(args, BUDGET_S)
    start = time.perf_counter()
    rows: list[dict] = []
    rows_wanted = grid(device, args.quick)
    if args.activation:
        if args.activation not in ACTIVATIONS:
            p.error(f"--activation: expected one of {', '.join(ACTIVATIONS)}, got {args.activation!r}")
        rows_wanted = list(dict.fromkeys((pair, M, d, args.activation) for pair, M, d, _ in rows_wanted))
    for pair, M, dtype, act in rows_wanted:
        for mode in modes:
            key = dict(pair=pair, M=M, dtype=DTYPE_NAMES[dtype], act=act, mode=mode)
            if time.perf_counter() - start > budget:
                rows.append(dict(key, skipped="time budget"))
                continue
            try:
                rows.append(measure_row(pair, M, dtype, act, mode, args, names, device))
            except Exception as exc:  # e.g. out of memory: record and go on
                rows.append(dict(key, error=timing.describe(exc)))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            tf = " ".join(f"{k[7:]}={v:.3g}" for k, v in rows[-1].items() if k.startswith("tflops:"))
            print(f"[{time.perf_counter() - start:4.0f}s] {pair} M={M} {key['dtype']} {act} {mode}: "
                  f"TFLOP/s {tf or rows[-1].get('error', '-')}", flush=True)  # fmt: skip
    report.save_sweep(args, "fused_linear", rows, device, plot)
    keys = ["pair", "M", "dtype", "act", "mode"]
    metrics = [("TFLOP/s", "tflops"), ("% mm", "pct_mm")]
    report.print_sweep_tables(rows, names, keys, metrics, time.perf_counter() - start)


if __name__ == "__main__":
    main()
