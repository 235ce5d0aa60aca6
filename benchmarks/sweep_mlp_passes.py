"""Tiles of triton fused_mlp's backward pass (``mlp_hidden.backward``: grad_pre, a and the bias
partials in one pass over (M, F)), which takes bias_act_dropout's tile rule untuned: each (BLOCK_M,
BLOCK_N, warps) timed on the GPU clock (do_bench_cudagraph), with and without writing a (the "passes"
and "keep" variants), at bench_mlp's blocks, M = 8192, bf16; the rate is the pass's bytes over its time
(grad_a, pre and grad_pre read or written once, a once where written). Last, per case, the shipped tile
against the fastest. ``--loop`` instead times, at four tiles, the loop of the programs that sum the
bias gradient: rows a program (16-128 against the shipped rule's) and software-pipelining stages.

    python benchmarks/sweep_mlp_passes.py [--out DIR] [--blocks gpt2,qwen2-0.5b] [--budget-s 120] [--loop]
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import common
import torch
from mlp_blocks import BLOCKS, SMOKE_F, SMOKE_M
from tabulate import tabulate

from dispatch import timing
from dispatch.backends.triton import bias_act_dropout, mlp_hidden
from dispatch.contracts import rng as dropout_rng
from dispatch.contracts.activations import GATES

TILES = [bias_act_dropout.Config(bm, bn, w)
         for bn, bm, w in itertools.product((512, 1024), (1, 2, 4, 8), (4, 8))]  # fmt: skip
SHIPPED = bias_act_dropout.config
ROWS, LAUNCH = bias_act_dropout._rows_per_program, mlp_hidden._BACKWARD
# --loop: the row loop of the bias-summing programs, at a few tiles: rows a program, software stages
LOOP_TILES = [None, bias_act_dropout.Config(4, 512, 4), bias_act_dropout.Config(2, 1024, 8),
              bias_act_dropout.Config(4, 512, 8)]  # fmt: skip
LOOP_ROWS, LOOP_STAGES = (None, 16, 32, 64, 128), (None, 1, 4)


def timed(grad_a, pre, act: str, p: float, need_a: bool, bias: bool, tile, rep_ms: float,
          rows: Optional[int] = None, stages: Optional[int] = None) -> float:  # fmt: skip
    """Microseconds of one backward pass under ``tile`` (None: the shipped rule), ``rows`` a program
    sums for the bias (None: the shipped rule) and ``stages`` (None: Triton's default)."""
    rng = dropout_rng.HostRng(7, 0) if p > 0 else None
    bias_act_dropout.config = SHIPPED if tile is None else (lambda *a, **k: tile)
    if rows is not None:
        bias_act_dropout._rows_per_program = lambda *a, **k: rows
    if stages is not None:
        mlp_hidden._BACKWARD = lambda grid, args, cx, num_warps, num_stages=None: LAUNCH(
            grid, args, cx, num_warps, stages
        )
    try:
        run = lambda: mlp_hidden.backward(grad_a, pre, act, p, rng, True, need_a, bias)  # noqa: E731
        if grad_a.device.type != "cuda":  # a smoke run: one call's wall clock
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) * 1e6
        return timing.gpu_ms(run, rep_ms) * 1e3
    finally:
        bias_act_dropout.config = SHIPPED
        bias_act_dropout._rows_per_program, mlp_hidden._BACKWARD = ROWS, LAUNCH


def case(name: str, m: int, args, device) -> list[dict]:
    h, f, act, p = BLOCKS[name]
    f = SMOKE_F if device.type != "cuda" else f
    gated, bias = act in GATES, act not in GATES
    pre = torch.randn(m, 2 * f if gated else f, device=device, dtype=torch.bfloat16)
    grad_a = torch.randn(m, f, device=device, dtype=torch.bfloat16)
    rows = []
    for need_a in (True, False):
        nbytes = (grad_a.numel() + 2 * pre.numel() + (m * f if need_a else 0)) * 2
        shipped = SHIPPED(m, f, 2, backward=True, dropout=p > 0)
        got = {"shipped": timed(grad_a, pre, act, p, need_a, bias, None, args.rep_ms)}
        if args.loop:
            for tile, n, stages in itertools.product(LOOP_TILES, LOOP_ROWS if bias else (None,), LOOP_STAGES):
                if tile is not None or n is not None or stages is not None:
                    label = "shipped" if tile is None else f"{tile.block_m}x{tile.block_n}/w{tile.num_warps}"
                    got[f"{label} rows {n or 'shipped'} stages {stages or '-'}"] = timed(
                        grad_a, pre, act, p, need_a, bias, tile, args.rep_ms, n, stages
                    )
        else:
            for tile in TILES:
                got[f"{tile.block_m}x{tile.block_n}/w{tile.num_warps}"] = timed(
                    grad_a, pre, act, p, need_a, bias, tile, args.rep_ms
                )
        best = min(got, key=got.get)
        rows.append(dict(block=name, M=m, F=f, act=act, p=p, write_a=need_a, bytes=nbytes,
                         shipped_tile=f"{shipped.block_m}x{shipped.block_n}/w{shipped.num_warps}",
                         us=got, best=best))  # fmt: skip
        print(f"{name} write_a={need_a}: shipped {got['shipped']:.1f} us, best {best} {got[best]:.1f} us",
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="gpt2,vit-b,bert-large,qwen2-0.5b,llama-2-7b")
    p.add_argument("--rep-ms", type=float, default=10.0)
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--loop", action="store_true", help="rows a program and stages at a few tiles, not tiles")
    args = p.parse_args()
    device = common.setup(args)
    m = 8192 if device.type == "cuda" else SMOKE_M
    start, rows = time.perf_counter(), []
    with common.logged(args, "sweep_mlp_passes"):
        for name in args.blocks.split(","):
            if time.perf_counter() - start > args.budget_s:
                print(f"budget: {name} and later not run")
                break
            rows += case(name, m, args, device)
        common.write(args, "sweep_mlp_passes", {"rows": rows}, device)
        table = [[r["block"], r["act"], r["p"], "a" if r["write_a"] else "-", r["shipped_tile"],
                  r["us"]["shipped"], r["bytes"] / r["us"]["shipped"] / 1e6, r["best"], r["us"][r["best"]],
                  r["bytes"] / r["us"][r["best"]] / 1e6, r["us"][r["best"]] / r["us"]["shipped"]]
                 for r in rows]  # fmt: skip
        heads = ["block", "act", "p", "writes a", "shipped tile", "shipped us", "TB/s", "best tile",
                 "best us", "best TB/s", "best / shipped"]  # fmt: skip
        print(tabulate(table, headers=heads, floatfmt=".3g"))


if __name__ == "__main__":
    main()
