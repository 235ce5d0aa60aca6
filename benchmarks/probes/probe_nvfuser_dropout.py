"""Probe of issue 4: nvfuser's (functorch + TorchScript/NNC) bias_act_dropout with dropout on CUDA.

On the H200 (torch 2.11) the NNC-fused float32 backward zeroed the gradients of KEPT elements, even
with the keep mask drawn outside the graph by ``dispatch.rng.keep_mask`` and passed in as a bool
tensor. This script (1) runs the backend's own forward/backward against the eager backend and the
float64 reference, then (2) compiles small variants of the backward graph function through
``backends.nvfuser.compiler.run`` (each under its own key), one candidate fix or control each:

  baseline      backends.nvfuser.bias_act_dropout.forward/backward as they are
  aot_noscript  the same AOT graph (decompositions + partitioner), run without TorchScript: control
  nnc_off       baseline graph with TorchScript's NNC fuser disabled: control
  static_only   NNC with static-shape fusion only (fusion strategy [("STATIC", 20)])
  jit_trace     torch.jit.trace of the same math, no AOTAutograd: NNC without functorch's graph
  zeros_like    torch.where(keep, g * scale, torch.zeros_like(g))
  masked_fill   (g * scale).masked_fill(~keep, 0.0)
  bool_mul      bool mask converted in the graph, g * keep.to(g.dtype) * scale (bool load, no where)
  u8_mul        mask passed as uint8, applied as g * keep.to(g.dtype) * scale (no bool in the graph)
  float_mul     mask passed as float32 0/1, applied as g * keep * scale
  scaled_mask   mask passed as float32 0/scale, applied as g * mask
  mask_outside  torch.where(keep, g.float() * scale, 0.0) in eager, the graph gets no mask
  philox_graph  the old design, keep_mask traced inside the graph from the int64 rng (one case only)

Every (variant, case) prints max|error| of y (baseline only), grad_x, grad_bias against the float64
reference, with dispatch.tolerances' rule (allowed = 2 * eager's error + atol + rtol * max|ref|), the
count of kept elements whose grad_x is 0 where eager's is not, of dropped elements whose grad_x is
not 0, and whether NNC fused the graph. Each variant runs in try/except, and a time budget skips
what is left. On CPU, NNC does not fuse by default, so everything should PASS there.

    PYTHONPATH=. python3 benchmarks/probes/probe_nvfuser_dropout.py              # cuda when present
    PYTHONPATH=. python3 benchmarks/probes/probe_nvfuser_dropout.py --device cpu
    ... --kernels    also prints NNC's CUDA source for baseline's first backward (to stderr)
    ... --device cpu --nnc-cpu   NNC's lowering on CPU (slow IR interpreter without LLVM)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root

from backends.eager import bias_act_dropout as eager
from backends.nvfuser import bias_act_dropout as nvf
from backends.nvfuser.compiler import run, signature
from dispatch import rng as dropout_rng
from dispatch.activations import ACTIVATIONS
from dispatch.tolerances import allowed_error, max_error

P = 0.3


# ----------------------------------------------------------------------------- the cases


class Case:
    def __init__(self, dtype, shape, activation, bias, host_rng, device):
        self.dtype, self.shape, self.activation = dtype, shape, activation
        self.x = torch.randn(shape, device=device, dtype=dtype)
        self.b = torch.randn(shape[1], device=device, dtype=dtype) if bias else None
        self.g = torch.randn(shape, device=device, dtype=dtype)
        # HostRng on CUDA (what the ops use outside capture), else the int64 [seed, offset] tensor
        self.rng = dropout_rng.draw_for(self.x) if host_rng else dropout_rng.draw(self.x.device)
        self.keep = dropout_rng.keep_mask(self.rng, shape[0], shape[1], P, self.x.device)
        self.name = (
            f"{str(dtype)[6:]} {shape[0]}x{shape[1]} {activation}"
            f"{'' if bias else ' nobias'}{' host' if isinstance(self.rng, dropout_rng.HostRng) else ''}"
        )
        self.eager_y = eager.forward(self.x, self.b, activation, P, self.rng)
        self.eager_gx, self.eager_gb = eager.backward(
            self.g, self.x, self.b, activation, P, self.rng, True, bias
        )
        x64 = self.x.double().requires_grad_()
        b64 = None if self.b is None else self.b.double().requires_grad_()
        self.ref_y = eager.reference(x64, b64, activation, P, self.rng, upcast=True)
        leaves = [t for t in (x64, b64) if t is not None]
        grads = torch.autograd.grad(self.ref_y, leaves, self.g.double())
        self.ref_gx, self.ref_gb = grads[0], grads[1] if bias else None
        self.ref_y = self.ref_y.detach()


def make_cases(device: str) -> list[Case]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((64, 256), (7, 40)):
            for activation in ("identity", "gelu"):
                cases.append(Case(dtype, shape, activation, True, False, device))
    # the shape of tests/test_compiled_backends.py's mask test, which failed: no bias, HostRng
    cases.append(Case(torch.float32, (257, 1000), "identity", False, True, device))
    return cases


# ----------------------------------------------------------------------------- the variants


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pre(x, b):
    z = x.to(_compute_dtype(x.dtype))
    return z if b is None else z + b.to(z.dtype)


def _grads_tail(g, x, b, need_bias, derivative):
    grad_z = g * derivative(_pre(x, b))
    grad_x = grad_z.to(x.dtype)
    grad_b = grad_z.sum(0).to(b.dtype) if need_bias else None
    return grad_x, grad_b


def _mask_fn(kind: str, scale: float) -> Callable:
    """How the graph applies the (prepared) mask argument to the float gradient g."""
    if kind == "where":
        return lambda g, m: torch.where(m, g * scale, 0.0)
    if kind == "zeros_like":
        return lambda g, m: torch.where(m, g * scale, torch.zeros_like(g))
    if kind == "masked_fill":
        return lambda g, m: (g * scale).masked_fill(~m, 0.0)
    if kind == "bool_mul":
        return lambda g, m: g * m.to(g.dtype) * scale
    if kind == "u8_mul":
        return lambda g, m: g * m.to(g.dtype) * scale
    if kind == "float_mul":
        return lambda g, m: g * m * scale
    if kind == "scaled_mask":
        return lambda g, m: g * m
    if kind == "none":
        return lambda g, m: g
    raise ValueError(kind)


PREPARE = {  # the mask argument each kind gets, made in eager from the bool keep mask
    "where": lambda keep, scale: keep,
    "zeros_like": lambda keep, scale: keep,
    "masked_fill": lambda keep, scale: keep,
    "bool_mul": lambda keep, scale: keep,
    "u8_mul": lambda keep, scale: keep.to(torch.uint8),
    "float_mul": lambda keep, scale: keep.to(torch.float32),
    "scaled_mask": lambda keep, scale: keep.to(torch.float32) * scale,
}


def variant_backward(kind: str, case: Case) -> tuple[Tensor, Tensor | None]:
    """bias_act_dropout.backward with the mask applied the ``kind`` way, compiled by ``run``."""
    scale = dropout_rng.keep_scale(P)
    derivative = ACTIVATIONS[case.activation].derivative
    need_bias = case.b is not None
    apply = _mask_fn(kind, scale)
    mask = PREPARE[kind](case.keep, scale)

    def grads(g, x, b, m):
        return _grads_tail(apply(g.to(_compute_dtype(x.dtype)), m), x, b, need_bias, derivative)

    key = ("probe", kind, case.activation, P, need_bias, signature(case.g, case.x, case.b, mask))
    return run(key, grads, case.g, case.x, case.b, mask)


def mask_outside(case: Case):
    scale = dropout_rng.keep_scale(P)
    derivative = ACTIVATIONS[case.activation].derivative
    need_bias = case.b is not None
    g = torch.where(case.keep, case.g.to(_compute_dtype(case.x.dtype)) * scale, 0.0)

    def grads(g, x, b):
        return _grads_tail(g, x, b, need_bias, derivative)

    key = ("probe", "mask_outside", case.activation, P, need_bias, signature(g, case.x, case.b))
    return run(key, grads, g, case.x, case.b)


def philox_graph(case: Case):
    """The pre-fix design: the mask regenerated inside the traced graph from the rng tensor."""
    scale = dropout_rng.keep_scale(P)
    derivative = ACTIVATIONS[case.activation].derivative
    need_bias = case.b is not None
    m, n = case.shape
    rng = dropout_rng.as_tensor(case.rng, case.x.device)

    def grads(g, x, b, rng):
        keep = dropout_rng.keep_mask(rng, m, n, P)
        g = torch.where(keep, g.to(_compute_dtype(x.dtype)) * scale, 0.0)
        return _grads_tail(g, x, b, need_bias, derivative)

    key = ("probe", "philox_graph", case.activation, P, need_bias, signature(case.g, case.x, case.b, rng))
    return run(key, grads, case.g, case.x, case.b, rng)


def aot_noscript(case: Case):
    """The baseline's AOT graph run as an FX GraphModule: decompositions and partitioner, no NNC."""
    from functorch.compile import make_boxed_compiler, memory_efficient_fusion

    scale = dropout_rng.keep_scale(P)
    derivative = ACTIVATIONS[case.activation].derivative
    need_bias = case.b is not None

    def grads(g, x, b, keep):
        g = torch.where(keep, g.to(_compute_dtype(x.dtype)) * scale, 0.0)
        return _grads_tail(g, x, b, need_bias, derivative)

    fx = make_boxed_compiler(lambda gm, example_inputs: gm)
    with torch.no_grad():
        return memory_efficient_fusion(grads, fw_compiler=fx, bw_compiler=fx)(
            case.g, case.x, case.b, case.keep
        )


def jit_trace(case: Case):
    """The baseline's math traced by torch.jit.trace (no AOTAutograd), run three times like run()."""
    scale = dropout_rng.keep_scale(P)
    derivative = ACTIVATIONS[case.activation].derivative
    need_bias = case.b is not None

    def grads(g, x, b, keep):
        g = torch.where(keep, g.to(_compute_dtype(x.dtype)) * scale, 0.0)
        return _grads_tail(g, x, b, need_bias, derivative)

    if case.b is None:
        traced = torch.jit.trace(lambda g, x, keep: grads(g, x, None, keep)[0], (case.g, case.x, case.keep))
        args = (case.g, case.x, case.keep)
    else:
        traced = torch.jit.trace(grads, (case.g, case.x, case.b, case.keep))
        args = (case.g, case.x, case.b, case.keep)
    with torch.no_grad():
        outs = [traced(*args) for _ in range(3)]
    out = outs[-1]
    return (out, None) if case.b is None else out


class Flags:
    """Sets TorchScript fuser flags for one variant and restores them afterwards."""

    def __init__(self, fuser: bool | None = None, strategy: list | None = None):
        self.fuser, self.strategy = fuser, strategy

    def __enter__(self):
        self.saved_fuser = torch._C._jit_texpr_fuser_enabled()
        if self.fuser is not None:
            torch._C._jit_set_texpr_fuser_enabled(self.fuser)
        if self.strategy is not None:
            self.saved_strategy = torch._C._jit_set_fusion_strategy(self.strategy)

    def __exit__(self, *exc):
        torch._C._jit_set_texpr_fuser_enabled(self.saved_fuser)
        if self.strategy is not None:
            torch._C._jit_set_fusion_strategy(self.saved_strategy)


def _baseline_backward(case: Case, tag: str = ""):
    """nvf.backward itself; ``tag`` makes a fresh compile by varying p's key (same p value)."""
    if not tag:
        return nvf.backward(case.g, case.x, case.b, case.activation, P, case.rng, True, case.b is not None)
    scale = dropout_rng.keep_scale(P)
    derivative = ACTIVATIONS[case.activation].derivative
    need_bias = case.b is not None

    def grads(g, x, b, keep):
        g = torch.where(keep, g.to(_compute_dtype(x.dtype)) * scale, 0.0)
        return _grads_tail(g, x, b, need_bias, derivative)

    key = ("probe", tag, case.activation, P, need_bias, signature(case.g, case.x, case.b, case.keep))
    return run(key, grads, case.g, case.x, case.b, case.keep)


VARIANTS: dict[str, tuple[Callable[[Case], Any], Callable[[], Any], Callable[[Case], bool]]] = {
    # name: (backward, flags context, which cases)
    "baseline": (_baseline_backward, Flags, lambda c: True),
    "aot_noscript": (aot_noscript, Flags, lambda c: True),
    "nnc_off": (lambda c: _baseline_backward(c, "nnc_off"), lambda: Flags(fuser=False), lambda c: True),
    "static_only": (
        lambda c: _baseline_backward(c, "static_only"),
        lambda: Flags(strategy=[("STATIC", 20)]),
        lambda c: True,
    ),
    "jit_trace": (jit_trace, Flags, lambda c: True),
    "zeros_like": (lambda c: variant_backward("zeros_like", c), Flags, lambda c: True),
    "masked_fill": (lambda c: variant_backward("masked_fill", c), Flags, lambda c: True),
    "bool_mul": (lambda c: variant_backward("bool_mul", c), Flags, lambda c: True),
    "u8_mul": (lambda c: variant_backward("u8_mul", c), Flags, lambda c: True),
    "float_mul": (lambda c: variant_backward("float_mul", c), Flags, lambda c: True),
    "scaled_mask": (lambda c: variant_backward("scaled_mask", c), Flags, lambda c: True),
    "mask_outside": (mask_outside, Flags, lambda c: True),
    "philox_graph": (
        philox_graph,
        Flags,
        lambda c: c.dtype == torch.float32 and c.shape == (64, 256) and c.activation == "identity",
    ),
}


# ----------------------------------------------------------------------------- checking


def _err(out, ref, eager_out, dtype) -> tuple[float, bool]:
    err, allowed = max_error(out, ref), allowed_error(ref, dtype, eager_out)
    return err, err <= allowed


def _fused() -> str:
    try:
        graph = torch.jit.last_executed_optimized_graph()
    except RuntimeError:
        return "?"
    return "NNC" if graph.findAllNodes("prim::TensorExprGroup") else "no"


def evaluate(name: str, case: Case, backward: Callable, flags: Callable, with_forward: bool) -> dict:
    row = {"variant": name, "case": case.name}
    start = time.perf_counter()
    with flags(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notes
        ok = True
        if with_forward:
            y = nvf.forward(case.x, case.b, case.activation, P, case.rng)
            err, good = _err(y, case.ref_y, case.eager_y, case.dtype)
            row["err_y"] = f"{err:.2g}"
            ok &= good and torch.equal(y == 0, case.eager_y == 0)
        errs = {"err_gx": 0.0, "err_gb": 0.0, "kept_zero": 0, "drop_nonzero": 0}
        # first call compiles (returning the second run's output), second is a warm cached run
        for _ in range(2):
            gx, gb = backward(case)
            row["fused"] = _fused()
            err_gx, good_x = _err(gx, case.ref_gx, case.eager_gx, case.dtype)
            err_gb, good_b = (
                (0.0, True) if case.b is None else _err(gb, case.ref_gb, case.eager_gb, case.dtype)
            )
            kept_zero = int((case.keep & (gx == 0) & (case.eager_gx != 0)).sum())
            drop_nonzero = int((~case.keep & (gx != 0)).sum())
            ok &= good_x and good_b and kept_zero == 0 and drop_nonzero == 0
            for k, v in zip(errs, (err_gx, err_gb, kept_zero, drop_nonzero)):
                errs[k] = max(errs[k], v)
        row.update({k: f"{v:.2g}" if isinstance(v, float) else v for k, v in errs.items()})
        if case.b is None:
            row["err_gb"] = "-"
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    row["status"] = "PASS" if ok else "FAIL"
    row["s"] = f"{time.perf_counter() - start:.2f}"
    return row


def _fusion_strategy() -> list:
    saved = torch._C._jit_set_fusion_strategy([("STATIC", 2)])
    torch._C._jit_set_fusion_strategy(saved)
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=float, default=50.0, help="seconds; later runs are skipped")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--kernels", action="store_true", help="print NNC's CUDA source for baseline")
    parser.add_argument(
        "--nnc-cpu", action="store_true", help="NNC fusion on CPU (IR interpreter if no LLVM)"
    )
    args = parser.parse_args()
    if args.nnc_cpu:
        torch._C._jit_override_can_fuse_on_cpu(True)
        torch._C._jit_set_te_must_use_llvm_cpu(False)
    torch.manual_seed(20261130)
    t0 = time.perf_counter()
    print(
        f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
        + f", texpr fuser {torch._C._jit_texpr_fuser_enabled()}, can fuse on gpu "
        f"{torch._C._jit_can_fuse_on_gpu()}, on cpu {torch._C._jit_can_fuse_on_cpu()}, fusion strategy "
        f"{_fusion_strategy()}"
    )
    cases = make_cases(args.device)
    rows = []
    for name in args.variants.split(","):
        backward, flags, applies = VARIANTS[name]
        for i, case in enumerate(cases):
            if not applies(case):
                continue
            if time.perf_counter() - t0 > args.budget:
                rows.append({"variant": name, "case": case.name, "status": "SKIP (budget)"})
                continue
            kernels = args.kernels and name == "baseline" and i == 0 and args.device == "cuda"
            if kernels:
                torch._C._jit_set_logging_option(">>>cuda_codegen")
            try:
                rows.append(evaluate(name, case, backward, flags, with_forward=name == "baseline"))
            except Exception as err:  # noqa: BLE001  one crash must not stop the other variants
                last = traceback.format_exc().strip().splitlines()[-1]
                rows.append(
                    {
                        "variant": name,
                        "case": case.name,
                        "status": f"ERROR {type(err).__name__}",
                        "err_y": last[:100],
                    }
                )
            finally:
                if kernels:
                    torch._C._jit_set_logging_option("")
            if name == "baseline" and i == 0 and rows[-1]["status"] != "PASS":
                print("baseline's failing backward graph as TorchScript ran it:")
                print(torch.jit.last_executed_optimized_graph())
    cols = [
        "variant",
        "case",
        "status",
        "err_y",
        "err_gx",
        "err_gb",
        "kept_zero",
        "drop_nonzero",
        "fused",
        "s",
    ]
    print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols))
    print()
    names = list(dict.fromkeys(r["variant"] for r in rows))
    case_names = [c.name for c in cases]
    status = {(r["variant"], r["case"]): r["status"].split(" ")[0] for r in rows}
    print(
        tabulate(
            [[v] + [status.get((v, c), "") for c in case_names] for v in names],
            headers=["variant"] + [c.replace(" ", "\n") for c in case_names],
        )
    )
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
