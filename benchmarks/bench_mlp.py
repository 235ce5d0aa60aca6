"""fused_mlp: the whole MLP block on every backend, next to the module a user writes, torch.compile of it,
this project's ops composed by hand, Liger's gated MLPs and the block's GEMMs alone.

    python benchmarks/bench_mlp.py [--out DIR] [--m 8192] [--quick] [--modes forward+backward,forward]
    python benchmarks/bench_mlp.py --cpu-smoke     # tiny sizes on the CPU, wall clock only

Blocks (hidden H, intermediate F, activation, dropout p between the projections): GPT-2 (768, 3072,
gelu_tanh, 0), ViT-B (768, 3072, gelu, 0.1), BERT-large (1024, 4096, gelu, 0.1), Qwen2-0.5B (896, 4864,
swiglu, 0), LLaMA-2-7B (4096, 11008, swiglu, 0), Gemma-2B (2048, 16384, geglu_tanh, 0); biases on the
non-gated blocks, none on the gated ones (as those models have); M = 8192 tokens; bf16. Modes:
forward+backward (a training step: autograd.grad of x and every weight; the default) and forward
(inference: no_grad, eval mode, no dropout). Entries:
  pytorch       the nn.Module a user writes: Linear -> act -> Dropout -> Linear; gated, LLaMA's
                down_proj(Dropout(act(gate_proj(x)) * up_proj(x)))
  compile       torch.compile of that module (--compile-mode)
  composed      fused_linear -> fused_bias_act_dropout -> fused_linear by hand (non-gated blocks), the
                dispatcher picking each op's backend: what this project offered before fused_mlp
  mlp/<name>    fused_mlp(backend=<name>) for each registered backend that serves the call (the others
                printed with the registry's reason); a gate's weight one stacked (2F, H) copy, gate rows
                first, or with --gate-pair the module's own (gate, up) pair (as a patched model passes)
  mlp/dispatch  fused_mlp choosing for itself (its pick in the "picked" column)
  mlp/triton+epilogues  triton's "epilogues" variant (mlp_gemm.py), forward and backward
  mlp/triton+keep       triton's "keep" variant: a kept for backward beside pre (PyTorch's bytes)
  compile+mlp/triton    torch.compile of fused_mlp(backend="triton"): one opaque custom op, against
                "compile" the evidence for where fused_mlp should trace as what under compile
  compile+patched       torch.compile of the FusedMLP dispatch.patch makes of the module, no backend
                named: the compile rule (dispatch.compiling.opaque_mlp) decides opaque or math
  liger         Liger-Kernel's LigerSwiGLUMLP (swiglu) or LigerGEGLUMLP (geglu_tanh) on the module's
                own Linears, where liger_kernel imports (on the device: its wheel carried in .whl/,
                installed by device_run.sh's install stage; it needs only torch and triton)
  torch.mm      the block's GEMMs alone at cuBLAS speed, the floor: 2 forward, 4 more backward (a gate's
                first is 2F wide)
Metrics: GPU time (do_bench_cudagraph of the whole step; where capture fails do_bench's time stands in,
said in the last column), wall time (do_bench; perf_counter on the CPU), time / the floor's in the same
run ("x floor"), speedups vs pytorch and compile on both clocks, and what a training forward keeps for
backward: "saved MiB", the tensors autograd saves (saved_tensors_hooks; each storage counted once;
parameters and the input x left out), and on CUDA "held MiB", memory_allocated after the forward minus
before, the output's own bytes subtracted. Every entry is checked before timing, at p = 0, against the
float64 reference (output and, training, every gradient), allowed twice the pytorch entry's error.
"""

from __future__ import annotations

import time
from typing import Optional

import common
import report
import torch
from mlp_blocks import (
    BLOCKS,
    DTYPES,
    FLOOR,
    MODES,
    QUICK,
    SMOKE_F,
    SMOKE_H,
    SMOKE_M,
    Entry,
    build,
    device_of,
    entries,
    gemm_floor,
    held_mib,
    liger_version,
    saved_mib,
    step,
    validate,
)
from torch import Tensor

from dispatch import timing


def implementing() -> list[str]:
    """The registered backends that implement fused_mlp (the others are said once, not per row)."""
    from dispatch.registry import backends

    return [n for n in common.registered() if backends()[n].implements("fused_mlp")]


def block_row(name: str, m: int, mode: str, args, device) -> tuple:
    """A row's start for one block at M tokens in one mode: (row, models, x, grad_y, the backends that
    serve its call, why the others do not); the row says the block, the weights' form, the pick and
    why Liger is out."""
    from dispatch import explain
    from dispatch.ops.fused_mlp import parse

    h, f, act, p = BLOCKS[name]
    h, f = (SMOKE_H, SMOKE_F) if args.cpu_smoke else (h, f)
    dtype, training = DTYPES[args.dtype], mode != "forward"
    models, no_liger = build(h, f, act, p, dtype, device, args)
    row = dict(block=name, M=m, H=h, F=f, act=act, p=p, dtype=args.dtype, mode=mode)
    row["w_in"] = "pair" if models.weights.pair else "one tensor"
    if no_liger:
        row["skip:liger"] = no_liger
    x = torch.randn(m, h, device=device, dtype=dtype).requires_grad_(training)  # (M, H)
    gy = torch.randn(m, h, device=device, dtype=dtype)  # (M, H)
    with torch.set_grad_enabled(training):
        call = parse(x, *models.weights, act, p, 0.0, training).call
        row["picked"] = explain("fused_mlp", x, *models.weights, act, p, 0.0, training).backend.name
    ok, why = common.available(call, implementing())
    return row, models, x, gy, ok, why


def measure_row(name: str, m: int, mode: str, args, device) -> dict:
    """One block at M tokens in one mode: validate, time in interleaved rounds, then memory."""
    row, models, x, gy, ok, why = block_row(name, m, mode, args, device)
    training, p = mode != "forward", row["p"]
    row.update({f"skip:mlp/{b}": reason for b, reason in why.items()})
    valid = validate(entries(models, 0.0, training, ok), models, x, gy, training)
    found = entries(models, p, training, ok)
    runs = {n: step(e, x, gy, mode) for n, e in found.items()}
    runs[FLOOR] = gemm_floor(models.weights, x, gy, mode)
    check = lambda n: valid.get(n, "")  # noqa: E731  (checked above, at p = 0)
    measured = timing.compare(runs, device, check=check, rounds=args.rounds, rep_ms=args.rep_ms)
    common.record(row, measured)
    derive(row, measured, device)
    if training:
        memory(row, found, x, device)
    return row


def derive(row: dict, measured: dict[str, timing.Measured], device) -> None:
    """do_bench's time where capture failed (said so), time / the floor's, the speedups."""
    for n, meas in measured.items():
        if meas.gpu is None and meas.wall is not None and "gpu" in meas.errors:
            row[f"gpu_us:{n}"] = meas.wall.ms * 1e3
            row[f"error:{n}"] = f"gpu = do_bench (capture failed: {meas.errors['gpu']})"
    clock = "gpu_us:" if device.type == "cuda" else "wall_us:"
    floor = row.get(clock + FLOOR)
    for key in [k for k in row if k.startswith(clock) and row[k] and floor and k != clock + FLOOR]:
        row[f"floor:{key[len(clock) :]}"] = row[key] / floor
    common.speedups(row)


def memory(row: dict, found: dict[str, Entry], x: Tensor, device) -> None:
    for n, e in found.items():
        try:
            row[f"saved_mib:{n}"] = saved_mib(e, x)
            if device.type == "cuda":
                row[f"held_mib:{n}"] = held_mib(e, x)
        except Exception as exc:  # e.g. out of memory: the times stand
            row.setdefault(f"error:{n}", f"memory: {timing.describe(exc)}")


# ----------------------------------------------------------------------------- report


def wide_table(rows: list[dict], device) -> tuple[list[list], list[str]]:
    """The issue's table: a line per block and mode, each entry's time, the best fused_mlp backend's
    speedups, its time over the floor, and the saved MiB of pytorch and that backend."""
    clock = "gpu" if device.type == "cuda" else "wall"
    names = [n for n in common.entry_names(rows) if any(r.get(f"{clock}_us:{n}") for r in rows)]
    order = ("pytorch", "compile", "composed", "mlp/", "compile+", "liger", FLOOR)
    names.sort(key=lambda n: next(i for i, o in enumerate((*order, "")) if n.startswith(o)))
    lines = []
    for r in rows:
        line = [r["block"], r["M"], r["mode"]] + [_ms(r.get(f"{clock}_us:{n}")) for n in names]
        best = common.fastest(r, [n for n in names if n.startswith("mlp/")], clock)
        line += [best] + [r.get(f"{k}:{best}") for k in (f"x_pytorch_{clock}", f"x_compile_{clock}", "floor")]
        line += [r.get("saved_mib:pytorch"), r.get(f"saved_mib:{best}")]
        lines.append(line)
    heads = ["block", "M", "mode", *(f"{n} ms" for n in names), "best mlp", "x torch", "x compile", "x floor"]
    return lines, heads + ["saved MiB torch", "saved MiB best"]


def _ms(us: Optional[float]) -> Optional[float]:
    return None if us is None else us / 1e3


def _times(row: dict) -> str:
    """Each entry's ms on the GPU clock (wall on the CPU), or the row's error."""
    for clock in ("gpu_us:", "wall_us:"):
        times = [f"{k[len(clock) :]}={v / 1e3:.3g}" for k, v in row.items() if k.startswith(clock)]
        if times:
            return " ".join(times)
    return str(row.get("error"))


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--m", default=None, help="tokens, comma-separated (default 8192; 64 with --cpu-smoke)")
    p.add_argument("--blocks", default=None, help=f"a subset of {','.join(BLOCKS)} (default all; --quick: 3)")
    p.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default the first; smoke both)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--compile-mode", default="default", help="torch.compile mode (not one with CUDA graphs)")
    p.add_argument("--rep-ms", type=float, help="ms per entry and clock, all rounds (default 60; quick 30)")
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {timing.ROUNDS}; quick 2)")
    p.add_argument("--gate-pair", action="store_true", help="gated blocks: fused_mlp gets a (gate, up) pair")
    p.add_argument("--cpu-smoke", action="store_true", help=f"the CPU, H={SMOKE_H}, F={SMOKE_F}: a smoke run")
    args = p.parse_args()
    modes = [m for m in (args.modes or (",".join(MODES) if args.cpu_smoke else MODES[0])).split(",") if m]
    blocks = args.blocks.split(",") if args.blocks else list(QUICK if args.quick else BLOCKS)
    if not set(modes) <= set(MODES) or not set(blocks) <= set(BLOCKS):
        p.error(f"--modes: some of {', '.join(MODES)}; --blocks: some of {', '.join(BLOCKS)}")
    ms = [int(v) for v in args.m.split(",")] if args.m else [SMOKE_M if args.cpu_smoke else 8192]
    args.rep_ms = args.rep_ms or (30.0 if args.quick or args.cpu_smoke else 60.0)
    args.rounds = args.rounds or (2 if args.quick or args.cpu_smoke else timing.ROUNDS)
    device = device_of(p, args)
    with common.logged(args, "fused_mlp"):
        run(args, blocks, ms, modes, device)


def run(args, blocks: list[str], ms: list[int], modes: list[str], device) -> None:
    start, rows = time.perf_counter(), []
    for name in blocks:
        for m in ms:
            for mode in modes:
                key = dict(block=name, M=m, mode=mode)
                try:
                    rows.append(measure_row(name, m, mode, args, device))
                except Exception as exc:  # e.g. out of memory: record and go on
                    rows.append(dict(key, error=timing.describe(exc)))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                took = time.perf_counter() - start
                print(f"[{took:4.0f}s] {name} M={m} {mode}: ms {_times(rows[-1])}", flush=True)
    others = sorted(set(common.registered()) - set(implementing()))
    print(f"backends that do not implement fused_mlp: {', '.join(others) or 'none'}")
    report.print_skipped(rows)
    liger_ok, liger = liger_version()
    print(f"liger_kernel {liger}" if liger_ok else liger)
    extra = {"liger_kernel": liger if liger_ok else None, "blocks": {b: BLOCKS[b] for b in blocks}}
    common.write(args, "fused_mlp", {"rows": rows, **extra}, device)
    keys = ["block", "M", "mode"]
    metrics = [("x floor", "floor"), ("saved MiB", "saved_mib")]
    metrics += [("held MiB", "held_mib")] if device.type == "cuda" else []
    lines, heads = report.long_table(rows, keys, metrics)
    took = time.perf_counter() - start
    report.print_table(lines, heads, title=f"every entry (x = baseline's time / entry's; {took:.0f} s)")
    clock = "GPU time (CUDA graph)" if device.type == "cuda" else "wall time"
    report.print_table(*wide_table(rows, device), title=f"fused_mlp, {args.dtype}: {clock}, ms")


if __name__ == "__main__":
    main()
