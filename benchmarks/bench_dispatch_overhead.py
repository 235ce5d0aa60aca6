"""Host overhead of the public ops over calling the chosen backend directly (target: <= 4 us per call).

The overhead is everything the public op adds in steady state: argument checks, the reshape to 2-D,
the cached decision and the final view. Both sides run on tiny tensors, so the time is host time:
the direct side runs the chosen backend's ``Kernels`` (``Backend.kernels_for``) as a caller bypassing
the dispatcher would, choosing once what ``dispatch.ops.<op>.runner`` chooses: ``inference`` without
autograd; with an input that requires grad ``forward`` where ``Kernels.autograd(activation)`` says
torch's autograd differentiates it, else the op's autograd Function around the kernels
(the shared autograd Function of ``dispatch.contracts.running``); plus
the dropout draw (``dispatch.contracts.rng.draw_for``) when the kernels' masks are the spec's. Both
sides run the same kernels object, which skips the backend's own argument checks where it has them
(triton's ``KERNELS``): the public op has checked the arguments, the direct side trusts its caller.
Timed with ``time.perf_counter`` over ``--calls`` back-to-back calls, median of ``--repeats`` samples,
the two sides interleaved so that drift hits both, and the samples of every case spread over the whole
run (passes over all cases). This is host time: neither GPU clock applies (``dispatch.timing``'s
do_bench and CUDA-graph clocks time device kernels, and the tiny kernels here finish before the host
launches the next).

Each row also gives ``paired_overhead_us``: the median of api - direct over calls timed one by one
in adjacent pairs (``_paired_us``), the two sides in the same host state.

Rows marked "(A/A)" are controls: a real backend's direct call on both sides, timed the same way. What
they read is the measurement's own offset between two identical loops, the yardstick for a real
backend's row (kernel launches and autograd make those loops ~20-40 us a call: a 5% drift of the host's
speed between the two loops would read as 1-2 us of overhead).

Rows with backend "null" isolate the overhead from kernel-time noise: a stand-in backend whose kernels
return a preallocated tensor, chosen through ``DISPATCH_BACKEND`` so the steady-state path (context
variable, environment setting, cache) is the one every call takes. The real backends' rows are the
dispatcher's own pick, and the pytorch backend (the composite a user writes, torch's dropout RNG)
where the pick is another, requested through ``DISPATCH_BACKEND`` the same way. CPU runs use one
intra-op thread: a 256-element GELU took 0.1-0.8 ms with two threads on a busy 2-core machine,
drowning microseconds.

    python benchmarks/bench_dispatch_overhead.py [--out DIR] [--quick] [--calls N] [--repeats R]
"""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import Callable, Iterator, NamedTuple, Optional

import common
import report
import torch

from dispatch import ACTIVATION_NAMES, explain, fused_bias_act_dropout, fused_linear, ops, timing
from dispatch.contracts.backend import Backend, Kernels
from dispatch.registry import backends, get, register
from dispatch.select import ENV_VAR, clear_cache

TARGET_US = 4.0  # the budget per call over calling the backend directly
# Tiny, so that kernels cost little next to the host work; M even: the 3-D cases view x as (2, M // 2, .)
M, N, K = 4, 64, 64
PYTORCH = "pytorch"  # the composite a user writes: timed where the dispatcher picks another backend


def _per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    return timing.back_to_back_ms(fn, (), calls, device) * 1e3


def _sample(
    api: Callable[[], object], direct: Callable[[], object], calls: int, device, api_first: bool
) -> tuple[float, float]:
    """One timed loop of each side after a warm-up (the decision cache, allocator, kernels): per-call
    microseconds of api and of direct. ``api_first``: which loop runs first, alternated over the
    repeats so that whatever the position in the pair costs (a drifting clock, the previous case's
    state) falls on both sides alike; the control rows measure what is left."""
    for fn in (api, direct):
        for _ in range(50):
            fn()
    if api_first:
        api_us = _per_call_us(api, calls, device)
        return api_us, _per_call_us(direct, calls, device)
    direct_us = _per_call_us(direct, calls, device)
    return _per_call_us(api, calls, device), direct_us


def _paired_us(api: Callable[[], object], direct: Callable[[], object], calls: int) -> list[float]:
    """Per-call differences api - direct (us), each pair timed call by call with the two calls adjacent
    (``timing.paired_diffs_ms``), so both sides run in the same state of the host. (The loops of
    ``_sample`` run each side alone: its code stays hot in the CPU caches in a way it does not between
    a model's other ops, and the two loops run at different moments.) perf_counter_ns around each
    call: ~0.1 us of timer, the same both sides."""
    return [d * 1e3 for d in timing.paired_diffs_ms(api, direct, calls)]


def _summary(samples: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """Median per-call microseconds of api, of direct, and of their difference within each sample; and
    min(api) - min(direct), the cost with host noise (which only ever adds time) least in the way."""
    api_us, direct_us = [a for a, _ in samples], [d for _, d in samples]
    medians = statistics.median(api_us), statistics.median(direct_us)
    return (*medians, statistics.median(a - d for a, d in samples), min(api_us) - min(direct_us))


# ----------------------------------------------------------------------------- the direct side


def _direct(op: str, kernels: Kernels, *args: object) -> Callable[[], object]:
    """What the op's runner does for this call on ``kernels``, without the dispatcher: the arguments
    checked once, outside the timing; the runner (inference, torch's autograd or the shared autograd
    Function, the dropout draw) inside it."""
    spec = ops.get(op)
    c = spec.parse(*args)
    run = spec.runner(kernels, c.call)
    return lambda: run(c)


def _bias_act_dropout_direct(
    kernels: Kernels, x: torch.Tensor, bias: torch.Tensor, act: str, p: float
) -> Callable[[], object]:
    return _direct("bias_act_dropout", kernels, x, bias, act, p)


def _fused_linear_direct(
    kernels: Kernels, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, act: str
) -> Callable[[], object]:
    return _direct("fused_linear", kernels, x, w, bias, act)


# ----------------------------------------------------------------------------- cases


def _preallocated(result: object) -> Callable[..., object]:
    """A kernel returning a preallocated result: calling it costs only Python."""
    return lambda *args: result


def _no_backward(*args: object) -> object:
    raise NotImplementedError("the null backend times forward calls only")


def _register_null(device: torch.device) -> str:
    name = f"null-{device.type}"
    if name not in backends():
        y = torch.empty(M, N, device=device)
        bad = Kernels(forward=_preallocated(y), backward=_no_backward, inference=_preallocated(y))
        lin = Kernels(forward=_preallocated((y, None)), backward=_no_backward, inference=_preallocated(y))
        register(
            Backend(
                name=name,
                kernels={"bias_act_dropout": bad, "fused_linear": lin},
                devices=frozenset({device.type}),
                dtypes=frozenset({torch.float32}),
                activations=frozenset(ACTIVATION_NAMES),
                deterministic=True,
                summary="benchmark stand-in: returns a preallocated output",
            )
        )
    return name


class Case(NamedTuple):
    backend: str
    op: str
    mode: str
    api: Callable[[], object]
    direct: Callable[[], object]
    env: Optional[str]  # the DISPATCH_BACKEND it runs under (None: the caller's environment)


def _null_cases(device: torch.device) -> list[Case]:
    """The public ops over the null backend, 2-D and 3-D inputs (the direct side of a 3-D call
    flattens and unflattens too, as any caller of a 2-D backend would: from x's own shape, which such
    a caller does not know in advance; literal sizes there made the direct side ~0.6 us cheaper than
    any general caller, H200 host, 2026-12-01)."""
    null_name = _register_null(device)
    null = get(null_name)
    bad, lin = null.kernels["bias_act_dropout"], null.kernels["fused_linear"]
    x, bias = torch.randn(M, N, device=device), torch.randn(N, device=device)
    x3 = x.view(2, M // 2, N)
    xk, w = torch.randn(M, K, device=device), torch.randn(N, K, device=device)
    xk3 = xk.view(2, M // 2, K)
    # the training path: the autograd Function on both sides, and the dropout draw on both sides
    x_grad, xk_grad = x.clone().requires_grad_(), xk.clone().requires_grad_()
    w_grad = w.clone().requires_grad_()
    cases = [
        ("bias_act_dropout", "inference 2-D", lambda: fused_bias_act_dropout(x, bias, "gelu"),
         _bias_act_dropout_direct(bad, x, bias, "gelu", 0.0)),
        ("bias_act_dropout", "inference 3-D", lambda: fused_bias_act_dropout(x3, bias, "gelu"),
         lambda: bad.inference(x3.reshape(-1, x3.shape[-1]), bias, "gelu", 0.0, None).view_as(x3)),
        ("fused_linear", "inference 2-D", lambda: fused_linear(xk, w, bias, "gelu"),
         _fused_linear_direct(lin, xk, w, bias, "gelu")),
        ("fused_linear", "inference 3-D", lambda: fused_linear(xk3, w, bias, "gelu"),
         lambda: lin.inference(xk3.reshape(-1, xk3.shape[-1]), w, bias, "gelu").view(*xk3.shape[:-1], N)),
        ("bias_act_dropout", "training, p=0.1", lambda: fused_bias_act_dropout(x_grad, bias, "gelu", 0.1),
         _bias_act_dropout_direct(bad, x_grad, bias, "gelu", 0.1)),
        ("fused_linear", "training", lambda: fused_linear(xk_grad, w_grad, bias, "gelu"),
         _fused_linear_direct(lin, xk_grad, w_grad, bias, "gelu")),
    ]  # fmt: skip
    return [Case(null_name, op, mode, api, direct, null_name) for op, mode, api, direct in cases]


def _real_cases(device: torch.device) -> list[Case]:
    """The public ops over the backend the dispatcher chooses, against that backend's kernels; and
    over the pytorch backend, requested through DISPATCH_BACKEND, where the dispatcher chooses another."""
    x, bias = torch.randn(M, N, device=device), torch.randn(N, device=device)
    x_grad = x.clone().requires_grad_()
    xk, w = torch.randn(M, K, device=device), torch.randn(N, K, device=device)
    xk_grad, w_grad = xk.clone().requires_grad_(), w.clone().requires_grad_()
    # (op, mode, the public op's call, its arguments for explain(), the direct side on given kernels)
    calls = [
        ("bias_act_dropout", "inference 2-D", lambda: fused_bias_act_dropout(x, bias, "gelu"),
         (x, bias, "gelu"), lambda k: _bias_act_dropout_direct(k, x, bias, "gelu", 0.0)),
        ("bias_act_dropout", "training, p=0.1", lambda: fused_bias_act_dropout(x_grad, bias, "gelu", 0.1),
         (x_grad, bias, "gelu", 0.1), lambda k: _bias_act_dropout_direct(k, x_grad, bias, "gelu", 0.1)),
        ("fused_linear", "inference 2-D", lambda: fused_linear(xk, w, bias, "gelu"),
         (xk, w, bias, "gelu"), lambda k: _fused_linear_direct(k, xk, w, bias, "gelu")),
        ("fused_linear", "training", lambda: fused_linear(xk_grad, w_grad, bias, "gelu"),
         (xk_grad, w_grad, bias, "gelu"), lambda k: _fused_linear_direct(k, xk_grad, w_grad, bias, "gelu")),
    ]  # fmt: skip
    chosen, plain = [], []
    for op, mode, api, args, direct in calls:
        picked = explain(op, *args).backend  # resolved once, as the dispatcher caches it
        chosen.append(Case(picked.name, op, mode, api, direct(picked.kernels_for(op)), None))
        if picked.name != PYTORCH:
            plain.append(Case(PYTORCH, op, mode, api, direct(get(PYTORCH).kernels_for(op)), PYTORCH))
    return chosen + plain


CONTROL = " (A/A)"


def _controls(cases: list[Case]) -> list[Case]:
    """Each case with its direct side on both sides: an A/A control, whose "overhead" is what the
    measurement itself reads between two identical loops (their order, the host's drift)."""
    return [c._replace(mode=c.mode + CONTROL, api=c.direct) for c in cases]


@contextlib.contextmanager
def _env_for(case: Case) -> Iterator[None]:
    """The null backend, and pytorch where the dispatcher would pick another, are chosen through
    DISPATCH_BACKEND, read by clear_cache()."""
    before = os.environ.get(ENV_VAR)
    if case.env is not None:
        os.environ[ENV_VAR] = case.env
    clear_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before
        clear_cache()


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=15, help="timed loops per side (median)")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.repeats = 200, 5
    torch.set_num_threads(args.threads or 1)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    cases = [
        (device, case)
        for device in devices
        for case in _null_cases(device) + _real_cases(device) + _controls(_real_cases(device))
    ]
    # Passes over every case, so each case's samples spread over the whole run: the H200 host swings
    # between fast and slow phases for seconds (2x on these microseconds), which used to land on
    # whichever cases were being timed then.
    samples: list[list[tuple[float, float]]] = [[] for _ in cases]
    paired: list[list[float]] = [[] for _ in cases]
    for repeat in range(args.repeats):
        for i, (device, case) in enumerate(cases):
            with _env_for(case):
                samples[i].append(_sample(case.api, case.direct, args.calls, device, repeat % 2 == 0))
                paired[i] += _paired_us(case.api, case.direct, args.calls // 4)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    rows = []
    for (device, case), got, diffs in zip(cases, samples, paired):
        api_us, direct_us, overhead_us, best_us = _summary(got)
        rows.append(
            {
                "device": device.type,
                "backend": case.backend,
                "op": case.op,
                "mode": case.mode,
                "api_us": round(api_us, 2),
                "direct_us": round(direct_us, 2),
                "overhead_us": round(overhead_us, 2),
                "min_overhead_us": round(best_us, 2),
                "paired_overhead_us": round(statistics.median(diffs), 2),
                "ok": None if case.mode.endswith(CONTROL) else overhead_us <= TARGET_US,
            }
        )
    common.write(args, "dispatch_overhead", {"rows": rows})
    null = [r for r in rows if r["backend"].startswith("null")]
    real = [r for r in rows if r["ok"] is not None and not r["backend"].startswith("null")]
    controls = [r for r in rows if r["ok"] is None]
    worst_real = max(real, key=lambda r: r["overhead_us"])
    worst_paired = max(rows, key=lambda r: r["paired_overhead_us"])
    null_us, null_min = max(r["overhead_us"] for r in null), max(r["min_overhead_us"] for r in null)
    aa = [r["overhead_us"] for r in controls]

    def where(r: dict) -> str:
        return f"{r['device']} {r['backend']} {r['op']} {r['mode']}"

    print(
        f"dispatch overhead (null backend, worst case): {null_us:.2f} us per call (median), "
        f"{null_min:.2f} us (min over repeats); target <= {TARGET_US} us\n"
        f"real backends (worst case): {worst_real['overhead_us']:.2f} us per call ({where(worst_real)}); "
        f"their A/A controls read {min(aa):+.2f} to {max(aa):+.2f} us\n"
        f"paired calls (every backend, worst case): {worst_paired['paired_overhead_us']:.2f} us per call "
        f"({where(worst_paired)})"
    )
    heads = list(rows[0])
    report.print_table([[r[h] for h in heads] for r in rows], heads, title="host us per call (A/A: controls)")


if __name__ == "__main__":
    main()
