"""Probe: a non-gated block's pointwise work in cuBLASLt's epilogues (the design Apex's
FusedDenseGeluDense and Transformer Engine use, to be weighed against the passes), through
nvmath-python, measured beside the module, torch.compile, triton's passes and "keep" and the GEMM floor
before it becomes a backend. bf16, GPU time by CUDA graph and wall time, interleaved (bench_mlp's
harness), every entry checked against the float64 reference first.

    forward   a, pre = act(x @ W_in^T + b_in)     one cuBLASLt GEMM: GELU_AUX_BIAS (RELU_AUX_BIAS: a
                                                   bitmask for relu), pre (the aux) kept
              y = a @ W_out^T + b_out              cuBLAS (addmm)
    backward  grad_pre, grad_b_in =                one cuBLASLt GEMM: DGELU_BGRAD (DRELU_BGRAD) reads
                (g @ W_out) * act'(pre), sums        pre in its epilogue and writes the bias gradient
              grad_W_out = g^T a, grad_b_out       cuBLAS and g.sum(0), or ("+bgradb") one cuBLASLt GEMM
                                                   with BGRADB
              grad_x, grad_W_in                    cuBLAS
It keeps a and pre (the module's bytes, as "keep"). cuBLASLt's epilogues want column-major results,
so every product is posed transposed: (W_in, x^T) -> a^T, column-major, which is a row-major. Both
products so (``--all-epilogues``) ran 1.18-1.26x compile's time: cuBLASLt runs DGELU_BGRAD as the GEMM
and then a separate epilogue kernel (246 against 65 us at GPT-2's, H100). The default entry is the
forward's epilogue alone with triton's "keep" backward over (pre, a) (relu: RELU_BIAS and a alone,
relu'(pre) = relu'(a)).

    python benchmarks/probe_epilogue_mlp.py [--out DIR] [--m 8192,2048] [--blocks gpt2,gpt2-relu]
    python benchmarks/probe_epilogue_mlp.py --pieces     # each epilogue GEMM alone against cuBLAS's

--pieces times the two epilogue products alone (GPU clock), each against the plain product cuBLAS runs
for it and nvmath's own plain product, with cuBLASLt's first heuristic pick and after nvmath's autotune
over 16 candidates, and names the kernel each ran (torch.profiler).
"""

from __future__ import annotations

import time

import common
import torch
from mlp_blocks import BLOCKS, FLOOR, build, device_of, entries, gemm_floor, step, validate
from profile_mlp import profile_step
from tabulate import tabulate

from dispatch import timing

PROBE_BLOCKS = {**BLOCKS, "gpt2-relu": (768, 3072, "relu", 0.0),
                "bert-large-tanh": (1024, 4096, "gelu_tanh", 0.0)}  # fmt: skip
KEEP = ("pytorch", "compile", "mlp/triton", "mlp/triton+passes", "mlp/triton+keep", "mlp/dispatch")
FORWARD = {  # activation -> (training epilogue, its aux output, inference epilogue)
    "gelu_tanh": ("GELU_AUX_BIAS", "gelu_aux", "GELU_BIAS"),
    "relu": ("RELU_AUX_BIAS", "relu_aux", "RELU_BIAS"),
}
BACKWARD = {"gelu_tanh": ("DGELU_BGRAD", "dgelu_bgrad"), "relu": ("DRELU_BGRAD", "drelu_bgrad")}


class Plans:
    """nvmath Matmul objects planned once per (operand shapes, strides, dtype, epilogue), later calls
    rebinding their operands."""

    def __init__(self) -> None:
        self.cache: dict = {}

    def __call__(self, a, b, epilog: str, inputs: dict):
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, epilog)
        mm = self.cache.get(key)
        if mm is None:
            mm = self.cache[key] = Matmul(a, b)
            mm.plan(epilog=getattr(MatmulEpilog, epilog), epilog_inputs=inputs or None)
        else:
            mm.reset_operands(a=a, b=b, epilog_inputs=inputs or None)
        out = mm.execute()
        return out if isinstance(out, tuple) else (out, {})


PLANS = Plans()


class EpilogueMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, b_out, act: str, bgradb: bool):
        if not torch.is_grad_enabled() and not any(t.requires_grad for t in (x, w_in, w_out)):
            a_t, _ = PLANS(w_in, x.t(), FORWARD[act][2], {"bias": b_in})
            return torch.addmm(b_out, a_t.t(), w_out.t())
        a_t, aux = PLANS(w_in, x.t(), FORWARD[act][0], {"bias": b_in})  # (F, M) column-major
        a = a_t.t()  # (M, F) row-major
        ctx.save_for_backward(x, w_in, w_out, a, aux[FORWARD[act][1]])
        ctx.act, ctx.bgradb = act, bgradb
        return torch.addmm(b_out, a, w_out.t())

    @staticmethod
    def backward(ctx, gy):
        x, w_in, w_out, a, aux = ctx.saved_tensors
        gy = gy.contiguous()
        epilog, name = BACKWARD[ctx.act]
        grad_pre_t, out = PLANS(w_out.t(), gy.t(), epilog, {FORWARD[ctx.act][1]: aux})  # (F, M) col-major
        grad_pre, grad_b_in = grad_pre_t.t(), out[name]
        if ctx.bgradb:  # grad_W_out posed as (a^T g)^T: BGRADB sums g's columns
            gw_t, sums = PLANS(a.t(), gy, "BGRADB", {})
            grad_w_out, grad_b_out = gw_t.t(), sums["bgradb"]
        else:
            grad_w_out, grad_b_out = torch.mm(gy.t(), a), gy.sum(0)
        grad_x = torch.mm(grad_pre, w_in)
        grad_w_in = torch.mm(grad_pre.t(), x)
        return grad_x, grad_w_in, grad_b_in.reshape(-1), grad_w_out, grad_b_out.reshape(-1), None, None


class HybridMLP(torch.autograd.Function):
    """The forward's product with the activation in cuBLASLt's epilogue (GELU_AUX_BIAS: a and pre;
    relu: RELU_BIAS, a alone, since relu'(pre) = relu'(a)), the backward triton fused_mlp's "keep"
    backward over (pre, a): its one pass after cuBLAS's g @ W_out."""

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, b_out, act: str):
        relu = act == "relu"
        epilog = "RELU_BIAS" if relu else FORWARD[act][0]
        a_t, aux = PLANS(w_in, x.t(), epilog, {"bias": b_in})
        a = a_t.t()  # (M, F), row-major where the epilogue wants a column-major result
        pre = a if relu else aux[FORWARD[act][1]].t()
        ctx.save_for_backward(x, w_in, b_in, w_out, b_out, pre, a)
        ctx.act = act
        return torch.addmm(b_out, a, w_out.t())

    @staticmethod
    def backward(ctx, gy):
        from dispatch.backends.triton import fused_mlp as triton_mlp
        from dispatch.ops.fused_mlp_math import MLPOperands

        x, w_in, b_in, w_out, b_out, pre, a = ctx.saved_tensors
        b = MLPOperands(x, w_in, None, b_in, None, w_out, b_out, ctx.act, 0.0, 0.0)
        grads = triton_mlp.backward(gy.contiguous(), b, (None, None), (pre, a), (True,) * 7)
        grad_x, grad_w_in, _, grad_b_in, _, grad_w_out, grad_b_out = grads
        return grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out, None


def hybrid_entry(models):
    from mlp_blocks import Entry

    w, act = models.weights, models.activation
    return Entry(lambda x: HybridMLP.apply(x, w.w_in, w.b_in, w.w_out, w.b_out, act), w.present, False)


def epilogue_entry(models, bgradb: bool):
    from mlp_blocks import Entry

    w, act = models.weights, models.activation

    def fn(x):
        return EpilogueMLP.apply(x, w.w_in, w.b_in, w.w_out, w.b_out, act, bgradb)

    return Entry(fn, w.present, False)


def row(name: str, m: int, mode: str, args, device) -> dict:
    h, f, act, p = PROBE_BLOCKS[name]
    training = mode != "forward"
    models, _ = build(h, f, act, p, torch.bfloat16, device, args)
    x = torch.randn(m, h, device=device, dtype=torch.bfloat16).requires_grad_(training)
    gy = torch.randn(m, h, device=device, dtype=torch.bfloat16)
    found = {k: v for k, v in entries(models, p, training, ["triton"]).items() if k in KEEP}
    found["cublaslt-forward+triton-keep"] = hybrid_entry(models)
    for bgradb in (False, True) if args.all_epilogues else ():
        found["cublaslt-epilogues" + ("+bgradb" if bgradb else "")] = epilogue_entry(models, bgradb)
    valid = validate(found, models, x, gy, training)
    runs = {n: step(e, x, gy, mode) for n, e in found.items()}
    runs[FLOOR] = gemm_floor(models.weights, x, gy, mode)
    measured = timing.compare(runs, device, check=lambda n: valid.get(n, ""), rounds=args.rounds,
                              rep_ms=args.rep_ms)  # fmt: skip
    out = dict(block=name, M=m, mode=mode)
    common.record(out, measured)
    out["valid"] = valid
    return out


def pieces(args, device) -> list[list]:
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    def planned(a, b, epilog, inputs, tune):
        mm = Matmul(a, b)
        epi = None if epilog is None else getattr(MatmulEpilog, epilog)
        mm.plan(epilog=epi, epilog_inputs=inputs, preferences={"limit": 16})
        if tune:
            mm.autotune(iterations=10)
        return mm.execute

    table = []
    for name in args.blocks.split(","):
        h, f, act, _ = PROBE_BLOCKS[name]
        if act not in FORWARD:
            continue
        for m in (int(v) for v in args.m.split(",")):
            new = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16) / s[-1] ** 0.5  # noqa: E731
            x, w_in, b_in, w_out, g = new(m, h), new(f, h), new(f), new(h, f), new(m, h)
            aux = planned(w_in, x.t(), FORWARD[act][0], {"bias": b_in}, False)()[1][FORWARD[act][1]]
            up = (w_in, x.t(), FORWARD[act][0], {"bias": b_in})
            cases = {
                "forward: torch.addmm + bias": lambda: torch.addmm(b_in, x, w_in.t()),
                "forward: nvmath plain": planned(w_in, x.t(), None, None, False),
                f"forward: nvmath {FORWARD[act][0]}": planned(*up, False),
                f"forward: nvmath {FORWARD[act][0]}, tuned": planned(*up, True),
                "backward: torch.mm g W_out": lambda: torch.mm(g, w_out),
                "backward: nvmath plain": planned(w_out.t(), g.t(), None, None, False),
                f"backward: nvmath {BACKWARD[act][0]}": planned(w_out.t(), g.t(), BACKWARD[act][0],
                                                                {FORWARD[act][1]: aux}, False),
                f"backward: nvmath {BACKWARD[act][0]}, tuned": planned(w_out.t(), g.t(), BACKWARD[act][0],
                                                                       {FORWARD[act][1]: aux}, True),
            }  # fmt: skip
            for case, fn in cases.items():
                try:
                    us = timing.gpu_ms(fn, args.rep_ms) * 1e3
                    longest = profile_step(fn, 1, device)["top"][0][0]
                    table.append([name, m, case, round(us, 1), longest[:60]])
                except Exception as exc:
                    table.append([name, m, case, None, timing.describe(exc)[:60]])
                print(table[-1], flush=True)
    return table


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--m", default="8192", help="tokens, comma-separated")
    p.add_argument("--blocks", default="gpt2,bert-large-tanh,gpt2-relu")
    p.add_argument("--modes", default="forward+backward", help="forward+backward and/or forward")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no row after this many seconds")
    p.add_argument("--rep-ms", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=timing.ROUNDS)
    p.add_argument("--compile-mode", default="default")
    p.add_argument("--gate-pair", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--pieces", action="store_true", help="each epilogue product alone (CUDA)")
    p.add_argument("--all-epilogues", action="store_true", help="also both products with epilogues")
    args = p.parse_args()
    device = device_of(p, args)
    if args.pieces:
        with common.logged(args, "probe_epilogue_pieces"):
            table = pieces(args, device)
            common.write(args, "probe_epilogue_pieces", {"rows": table}, device)
            print(tabulate(table, headers=["block", "M", "product", "GPU us", "longest kernel"]))
        return
    rows, start = [], time.perf_counter()
    with common.logged(args, "probe_epilogue_mlp"):
        for name in args.blocks.split(","):
            for m in (int(v) for v in args.m.split(",")):
                for mode in args.modes.split(","):
                    if time.perf_counter() - start > args.budget_s:
                        continue
                    try:
                        rows.append(row(name, m, mode, args, device))
                    except Exception as exc:
                        rows.append(dict(block=name, M=m, mode=mode, error=timing.describe(exc)))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    print(f"[{time.perf_counter() - start:4.0f}s] {rows[-1]}", flush=True)
        common.write(args, "probe_epilogue_mlp", {"rows": rows}, device)
        clock = "gpu_us:" if device.type == "cuda" else "wall_us:"
        names = sorted({k.split(":", 1)[1] for r in rows for k in r if k.startswith(clock)})
        table = []
        for r in rows:
            floor = r.get(clock + FLOOR)
            for n in names:
                g, w = r.get(clock + n), r.get(f"wall_us:{n}")
                ratio = lambda k: None if not (g and r.get(k)) else round(g / r[k], 3)  # noqa: E731
                table.append([r["block"], r["M"], r["mode"], n, g and round(g, 1), w and round(w, 1),
                              floor and g and round(g / floor, 3), ratio(clock + "compile"),
                              ratio(clock + "pytorch"), r.get("valid", {}).get(n, "")])  # fmt: skip
        print(tabulate(table, headers=["block", "M", "mode", "entry", "GPU us", "wall us", "x floor",
                                       "/ compile", "/ pytorch", "check"]))  # fmt: skip


if __name__ == "__main__":
    main()
