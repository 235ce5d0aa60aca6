"""The host cost a patched MLP block adds where plain PyTorch is picked: bench_judge's blocks at a few
tokens (the host binds), wall clock, paired samples (``dispatch.paired``). Entries per (model, mode):
  plain      the block as the model defines it
  patched    dispatch.patch's FusedMLP, deciding (its memo, the table) and then running the module
  floor      the same FusedMLP's module_forward called directly: its layers without the decision
and, where plain PyTorch is picked, "decision alone": the patched block's call with its layers stubbed
out, less an identity module's call (timeit minima: the decision's own microseconds, host noise aside).
Two passes on a GPU: with its table (``--tokens`` where it picks plain PyTorch; a block whose table
names another backend at some M keeps its memo), and with every table hidden (bench_judge.no_tables),
where a block's only pick is plain PyTorch and it runs module_forward after two identity tests
(``dispatch.memo.plain_token``). On a CPU the no-table pass alone. A GPU run first times the capture question
a decision with a capture pick asks every call (``torch.cuda.is_current_stream_capturing``), idle and
with kernels queued.

    python benchmarks/bench_module_host.py [--out DIR] [--tokens 4] [--samples 300] [--models a,b]
"""

from __future__ import annotations

import contextlib
import statistics
import timeit

import bench_judge as judge
import common
import torch
from tabulate import tabulate

from dispatch import paired

MODELS = ("pythia-1.4b", "llama-3.2-1b", "siglip-so400m", "qwen3-0.6b")


def row(name: str, tokens: int, mode: str, args, device: torch.device, table: bool) -> dict:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    plain = judge.build(name, device, dtype, device.type == "cpu")
    fused = judge.patched(plain)
    training = mode == "training"
    plain.train(training), fused.train(training)
    x = torch.randn(tokens, fused.in_features, device=device, dtype=dtype, requires_grad=training)
    gy = torch.randn(tokens, fused.in_features, device=device, dtype=dtype)

    class Floor(torch.nn.Module):  # the module's own layers, no decision
        def __init__(self) -> None:
            super().__init__()
            self.inner = fused

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner.module_forward(x)

    floor = Floor().train(training)
    with contextlib.nullcontext() if table else judge.no_tables():
        entries = (("plain", plain), ("patched", fused), ("floor", floor))
        runs = {n: judge.step(m, x, gy, mode) for n, m in entries}
        for fn in runs.values():
            fn()
        times = paired.times(runs, device, gpu=False, samples=args.samples, slice_ms=args.slice_ms)
        found, memo = fused._memo.found, fused._memo
        path = "token" if memo.token is not None else "span" if memo.span is not None else "memo"
        alone = decision_us(fused, x, training) if found.backend.name == "pytorch" else None
    out = {"model": name, "tokens": tokens, "mode": mode, "table": table, "picked": found.backend.name,
           "capture_pick": getattr(found.captured, "name", None), "path": path, "decision_alone_us": alone}
    for n in runs:
        out[f"us:{n}"] = statistics.median(times[n]) * 1e3
        out[f"x:{n}"] = paired.ratio(times, n, "plain")
    return out


class _Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def decision_us(fused: torch.nn.Module, x: torch.Tensor, training: bool, calls: int = 2000) -> float:
    """The patched block's own cost where it runs plain PyTorch, its layers stubbed out: the best of
    5 x ``calls`` calls (timeit), less a module that returns x (nn.Module's call). Host noise adds;
    the minimum keeps the decision's own microseconds."""
    ident = _Identity()
    fused.module_forward = lambda t: t  # an instance attribute over the method, deleted after
    try:
        with torch.enable_grad() if training else torch.no_grad():
            best = [min(timeit.repeat(lambda m=m: m(x), number=calls, repeat=5)) for m in (fused, ident)]
    finally:
        del fused.module_forward
    return (best[0] - best[1]) / calls * 1e6


def capture_question_us(device: torch.device, calls: int = 2000) -> str:
    """The host cost of one ``is_current_stream_capturing`` call, idle and behind a queued GPU sleep."""
    torch.cuda.synchronize(device)
    idle = timeit.timeit(torch.cuda.is_current_stream_capturing, number=calls) / calls * 1e6
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU work queued
    busy = timeit.timeit(torch.cuda.is_current_stream_capturing, number=calls) / calls * 1e6
    torch.cuda.synchronize(device)
    return f"is_current_stream_capturing: {idle:.2f} us idle, {busy:.2f} us with a kernel queued"


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--slice-ms", type=float, default=1.0)
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args()
    device = common.setup(args)
    with common.logged(args, "module_host"):
        if device.type == "cuda":
            print(capture_question_us(device))
        passes = (True, False) if device.type == "cuda" else (False,)
        rows = [row(n, args.tokens, mode, args, device, table) for table in passes
                for n in args.models.split(",") for mode in ("training", "inference")]  # fmt: skip
        common.write(args, "module_host", {"rows": rows}, device)
        heads = ["model", "mode", "tables", "pick", "path", "plain us", "patched us", "floor us",
                 "patched / plain", "floor / plain", "decision us", "decision alone us"]  # fmt: skip
        table = [[r["model"], r["mode"], "shipped" if r["table"] else "hidden",
                  f"{r['picked']}/{r['capture_pick']}", r["path"], r["us:plain"], r["us:patched"],
                  r["us:floor"], r["x:patched"], r["x:floor"], r["us:patched"] - r["us:floor"],
                  r["decision_alone_us"]]
                 for r in rows]  # fmt: skip
        print(tabulate(table, headers=heads, floatfmt=".3f"))


if __name__ == "__main__":
    main()
