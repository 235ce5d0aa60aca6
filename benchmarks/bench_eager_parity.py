"""Is the eager fused_linear backend within 2% of plain PyTorch, on every clock, everywhere?

    python benchmarks/bench_eager_parity.py [--out DIR] [--tag T] [--quick] [--budget S] [--activations A,B]

The eager backend launches PyTorch's own kernels (dispatch/backends/eager/fused_linear.py), so whatever
separates it from ``act(F.linear(x, w, b))`` is the dispatcher's host cost, or the clock's noise.
Per point (projection, tokens M, activation, mode), four entries timed in interleaved rounds:
  pytorch       act(F.linear(x, w, b)), the composite a user writes (``dispatch.ops.fused_linear.baseline``)
  pytorch_aa    the same composite again: an A/A control, what the clock reads between identical work
  eager         dispatch.fused_linear(x, w, b, act, backend="eager"), through the dispatcher
  eager_direct  the eager backend's kernels without the dispatcher, as ``dispatch.ops.fused_linear.runner``
                runs them: ``inference`` (inference); ``forward`` under torch's autograd where
                ``Kernels.autograd(act)`` says so, else the shared autograd Function (training)
Modes: inference (no_grad) and training (forward + backward of x, w, b, a fixed grad_y). Clocks: GPU
(CUDA graph), wall (do_bench), host per call (behind a sleep kernel); on the CPU wall (perf_counter)
only. Ratios entry / pytorch (> 1: slower). Eager's output and gradients are checked against pytorch's
before timing: "exact", "close" (assert_close, the dtype's default tolerances) or what failed. On CUDA,
torch.profiler lists the kernels pytorch and eager launch, once per (mode, activation).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import common
import report
import torch

from dispatch import fused_linear, timing
from dispatch import ops
from dispatch.ops.fused_linear import baseline
from dispatch.registry import get

# projection -> (N = out_features, K = in_features)
SHAPES = {"gpt2.up": (3072, 768), "gpt2.down": (768, 3072), "llama-2-7b.up": (11008, 4096),
          "deit-s.up": (1536, 384), "llama-2-70b.up": (28672, 8192)}  # fmt: skip
TOKENS = (1, 16, 256, 2048, 8192, 16384)
MAX_MNK = 2**40  # past it (LLaMA-70B from 8192 tokens) bf16 training takes >= 16 ms a call (6 MNK)
# gelu_tanh first: when the budget runs out partway, every shape and M has been seen once
ACTS = ("gelu_tanh", "identity", "relu", "gelu", "silu")
QUICK = (("gpt2.up", "llama-2-7b.up"), (1, 2048), ("gelu_tanh", "identity"))
CPU_SHAPES, CPU_TOKENS = {"tiny": (64, 32)}, (1, 16)  # a smoke run: every call is host time
KERNEL_POINT = ("gpt2.up", 2048)  # the mid shape whose CUDA kernels are compared
MODES = ("inference", "training")
RATIOS = ("eager", "eager_direct")  # each against pytorch, with the A/A ratio beside them
CUDA_ROUNDS, CPU_ROUNDS = 7, 3  # the H200's host swings 2x for seconds: more rounds outvote it
REP_MS = 40.0  # per entry and clock, over all rounds
# host clock: runs per sample and an upper guess of a run's host time (a training step costs the
# H200's host 100-300 us, dispatch/calibrate/measure.py), so the sleep kernel outlasts the loop
HOST_RUNS, HOST_GUESS_MS = 10, 0.5
WITHIN = 1.02


def grid(device: torch.device, quick: bool) -> list[tuple[str, int, str, str]]:
    """(projection, M, activation, mode) in priority order, activation outermost."""
    shapes, tokens, acts = SHAPES, TOKENS, ACTS
    if device.type != "cuda":
        shapes, tokens, acts = CPU_SHAPES, CPU_TOKENS, QUICK[2] if quick else ACTS
    elif quick:
        shapes, tokens, acts = {s: SHAPES[s] for s in QUICK[0]}, QUICK[1], QUICK[2]
    pts = [(s, m, a, n * k) for a in acts for s, (n, k) in shapes.items() for m in tokens]
    return [(s, m, a, mode) for s, m, a, nk in pts if m * nk <= MAX_MNK for mode in MODES]


def eager_direct(act: str, training: bool) -> Callable:
    """The eager backend's kernels as ``dispatch.ops.fused_linear``'s runner runs them, no dispatcher:
    the arguments checked once per (x, w, b), outside the timed calls."""
    kernels, spec, made = get("eager").kernels_for("fused_linear"), ops.get("fused_linear"), {}

    def run(x, w, b):
        found = made.get((id(x), id(w), id(b)))
        if found is None:
            c = spec.parse(x, w, b, act)
            found = made[(id(x), id(w), id(b))] = (spec.runner(kernels, c.call), c)
        return found[0](found[1])

    return run


def entries(act: str, training: bool) -> dict[str, Callable]:
    """Each entry as a function of (x, w, b)."""
    return {
        "pytorch": lambda x, w, b: baseline(x, w, b, act),
        "pytorch_aa": lambda x, w, b: baseline(x, w, b, act),
        "eager": lambda x, w, b: fused_linear(x, w, b, act, backend="eager"),
        "eager_direct": eager_direct(act, training),
    }


def inputs(shape: str, M: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x (M, K), w (N, K), b (N,) and grad_y (M, N)."""
    N, K = (SHAPES if device.type == "cuda" else CPU_SHAPES)[shape]
    sizes, scales = ((M, K), (N, K), (N,), (M, N)), (1.0, K**-0.5, 1.0, 1.0)
    return tuple(torch.randn(*n, device=device, dtype=dtype) * c for n, c in zip(sizes, scales))


def timed(fn: Callable, training: bool, x, w, b, gy) -> timing.Fn:
    # training: autograd.grad returns the gradients, none accumulate (as backward() with grads reset to None)
    return common.timed(fn, "forward+backward" if training else "forward", (x, w, b), gy)


def outputs(fn: Callable, training: bool, x, w, b, gy) -> list[torch.Tensor]:
    """y, and in training the gradients of x, w and b for grad_y ``gy``."""
    if not training:
        with torch.no_grad():
            return [fn(x, w, b)]
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, gy)]


def agree(got: list[torch.Tensor], ref: list[torch.Tensor]) -> str:
    """'exact', 'close', or the first tensor that missed and by how much."""
    if all(torch.equal(g, r) for g, r in zip(got, ref)):
        return "exact"
    for name, g, r in zip(("y", "grad_x", "grad_w", "grad_b"), got, ref):
        try:
            torch.testing.assert_close(g, r)  # rtol 1.6e-2, atol 1e-5 for bf16
        except AssertionError as exc:  # its last lines: the greatest absolute and relative differences
            return f"FAIL {name}: {str(exc).splitlines()[-2].strip()}"[:120]
    return "close"


def kernel_names(fn: timing.Fn) -> list[str]:
    """The CUDA kernels (and memsets) of one call of ``fn``, in launch order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]


def check_kernels(device: torch.device, dtype: torch.dtype, acts: list[str]) -> list[dict]:
    """Per (mode, activation) at KERNEL_POINT: whether pytorch and eager launch the same kernels."""
    out = []
    for mode in MODES:
        for act in acts:
            row: dict = dict(mode=mode, act=act, shape=KERNEL_POINT[0], M=KERNEL_POINT[1])
            try:
                args = inputs(*KERNEL_POINT, device, dtype)
                fns, train = entries(act, mode == "training"), mode == "training"
                names = {e: kernel_names(timed(fns[e], train, *args)) for e in ("pytorch", "eager")}
                if not names["pytorch"]:
                    raise RuntimeError("the profiler saw no CUDA kernels")
                row.update(identical=names["pytorch"] == names["eager"], kernels=names)
            except Exception as exc:  # a profiler without CUPTI: say so
                row["error"] = timing.describe(exc)
            out.append(row)
    return out


def measure(shape: str, M: int, act: str, mode: str, device, dtype, cycles) -> dict:
    data = inputs(shape, M, device, dtype)  # x, w, b, grad_y
    (N, K), training = data[1].shape, mode == "training"
    row = dict(shape=shape, M=M, N=N, K=K, act=act, mode=mode, dtype=str(dtype)[6:])
    fns = entries(act, training)
    runs = {e: timed(fn, training, *data) for e, fn in fns.items()}
    ref = outputs(fns["pytorch"], training, *data)

    def check(name: str) -> str:  # validation before timing
        return "baseline" if name.startswith("pytorch") else agree(outputs(fns[name], training, *data), ref)

    rounds = CUDA_ROUNDS if device.type == "cuda" else CPU_ROUNDS
    # slow_ms=None: every point in all rounds, the slow ones too (the GPU's clock drifts over them)
    measured = timing.compare(runs, device, check=check, rounds=rounds, rep_ms=REP_MS, slow_ms=None)
    common.record(row, measured)
    if device.type == "cuda":
        host: dict[str, list[float]] = {e: [] for e, m in measured.items() if "first" not in m.errors}
        for _, e in timing.rotations(list(host), rounds):
            ms, drained = timing.host_ms(runs[e], device, HOST_RUNS, (), HOST_GUESS_MS, cycles)
            host[e].append(ms)
            row[f"host_drained:{e}"] = row.get(f"host_drained:{e}", False) or drained
        for e, got in host.items():
            row[f"host_us:{e}"] = statistics.median(got) * 1e3
            row[f"host_spread:{e}"] = timing.Timing(tuple(got)).spread
    for clock in ("gpu", "wall", "host"):
        base = row.get(f"{clock}_us:pytorch")
        for e in ("pytorch_aa", *RATIOS):
            if base and row.get(f"{clock}_us:{e}"):
                row[f"ratio_{clock}:{e}"] = row[f"{clock}_us:{e}"] / base
    return row


def summary(rows: list[dict], clocks: tuple[str, ...]) -> tuple[list[list], list[str], dict]:
    """Per mode, clock and ratio: median, max and share within 2%, the A/A ratio's beside them."""
    lines, worst = [], {}
    for mode in MODES:
        done = [r for r in rows if r["mode"] == mode and "ratio_wall:eager" in r]
        valid = sum(all(r.get(f"valid:{e}") in ("exact", "close") for e in RATIOS) for r in done)
        for clock in clocks:
            key = f"ratio_{clock}:"
            aa = [r[key + "pytorch_aa"] for r in done if key + "pytorch_aa" in r]
            for e in RATIOS:
                got = [r for r in done if key + e in r]
                if not got:
                    continue
                rs, top = [r[key + e] for r in got], max(got, key=lambda r: r[key + e])
                worst[f"{mode} {clock} {e}"] = {k: top[k] for k in ("shape", "M", "act", key + e)}
                lines.append([
                    mode, clock, f"{e}/pytorch", len(rs), statistics.median(rs), max(rs),
                    f"{sum(r <= WITHIN for r in rs)}/{len(rs)}",
                    statistics.median(aa) if aa else None, min(aa, default=None), max(aa, default=None),
                    f"{sum(r <= WITHIN for r in aa)}/{len(aa)}", f"{valid}/{len(done)}",
                ])  # fmt: skip
    heads = ["mode", "clock", "ratio", "points", "median", "max", "<=1.02"]
    return lines, heads + ["A/A med", "A/A min", "A/A max", "A/A <=1.02", "valid"], worst


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=240.0, metavar="SECONDS", help="no new point after it")
    p.add_argument("--activations", help=f"some of {','.join(ACTS)}, comma-separated (to split a long run)")
    args = p.parse_args()
    device = common.setup(args)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    points = grid(device, args.quick)
    wanted = args.activations.split(",") if args.activations else ACTS
    if not set(wanted) <= set(ACTS):
        p.error(f"--activations: expected some of {', '.join(ACTS)}, got {args.activations!r}")
    points = [pt for pt in points if pt[2] in wanted]
    torch.manual_seed(0)
    start = time.perf_counter()
    cycles = timing.sleep_cycles_per_ms(device) if cuda else None
    rows: list[dict] = []
    for shape, M, act, mode in points:
        key = dict(shape=shape, M=M, act=act, mode=mode)
        if time.perf_counter() - start > args.budget:
            rows.append(dict(key, skipped="time budget"))
            continue
        try:
            rows.append(measure(shape, M, act, mode, device, dtype, cycles))
        except Exception as exc:  # e.g. out of memory: record it, go on
            rows.append(dict(key, error=timing.describe(exc)))
            timing.settle(device)
        if cuda:
            torch.cuda.empty_cache()
    # after the timing: a finished profiler can leave CUPTI's callbacks in place, slowing every later
    # launch by 10-20% (pytorch/pytorch#146604)
    kernels = check_kernels(device, dtype, list(dict.fromkeys(pt[2] for pt in points))) if cuda else []
    took = time.perf_counter() - start
    skipped, errors = [r for r in rows if "skipped" in r], [r for r in rows if "error" in r]
    clocks = ("gpu", "wall", "host") if cuda else ("wall",)
    lines, heads, worst = summary(rows, clocks)
    result = dict(rows=rows, kernels=kernels, worst=worst, took_s=took, not_started=len(skipped))
    common.write(args, "eager_parity", dict(result, summary=[dict(zip(heads, ln)) for ln in lines]), device)
    if errors:  # the JSON lists each
        e = errors[0]
        print(f"{len(errors)} of {len(rows)} points failed; {e['shape']} M={e['M']} {e['act']}: {e['error']}")
    if skipped:
        print(f"budget of {args.budget:g} s spent: {len(skipped)} of {len(rows)} points not started")
    if kernels:
        other = [
            f"{k['mode']} {k['act']}: {k.get('error', 'differ')}" for k in kernels if not k.get("identical")
        ]
        where = f"{KERNEL_POINT[0]} M={KERNEL_POINT[1]}"
        same = f"{len(kernels) - len(other)}/{len(kernels)} (mode, activation)"
        print(f"identical CUDA kernels, pytorch vs eager at {where}: {same}", *other, sep="\n  ")
    every = [r for r in rows if "ratio_wall:eager" in r]
    ok = sum(all(r.get(f"ratio_{c}:eager", float("inf")) <= WITHIN for c in clocks) for r in every)
    title = f"eager parity, {dtype} on {device.type} ({took:.0f} s): eager/pytorch <= {WITHIN} on every clock"
    report.print_table(lines, heads, title=f"{title} at {ok}/{len(every)} points")


if __name__ == "__main__":
    main()
