"""End to end, LLaMA: does dispatch.patch make a gated-MLP model train faster, in less memory, same loss?

A LLaMA-style model from a transformers LlamaConfig, random init (nothing downloaded), built so that
the MLP's activations dominate memory: 8 layers, hidden H = 1024, SwiGLU intermediate F = 8192 (8H,
LLaMA's is ~2.7H), 16 heads, vocab V = 2048 (the data uses 1024 tokens), context 2048, sdpa attention,
no dropout: 240M parameters. bf16 autocast over float32 parameters, fused AdamW, clipping
(``e2e_common.step``); data: bench_e2e's Markov chain (its entropy is the loss floor).

Activation bytes a token keeps for backward, per layer (fp32 residual stream and RMSNorms, bf16
matmuls; autocast caches the casts of parameters, not of activations, so each projection casts its
input again):
    norms      two RMSNorms, each its fp32 input and normalized output and the rsqrt: 16H + 8
    attention  q/k/v each cast the norm's output (3 x 2H), RoPE, sdpa's inputs, output and logsumexp,
               o_proj's input: ~14H (measured by ``per_token`` on the CPU's autocast, transformers 5.x)
    MLP, eager gate and up each cast x (2 x 2H); gate, silu(gate), up, the product (4 x 2F): 4H + 8F
    MLP, FusedMLP on triton: x once (2H), the gate and up pre-activations (2 x 2F): 2H + 4F
and once a token the final norm (8H) and cross-entropy's fp32 log-softmax (4V). Here (H = 1024,
F = 8192, V = 2048): eager 34H + 8F = 98 KiB a layer, fused 32H + 4F = 64 KiB (-35%); eight layers and
the rest, 800 vs 528 KiB a token: at 8 x 2048 tokens 12.5 vs 8.3 GiB, over 4.0 GiB resident
(parameters, gradients and AdamW's two states in fp32, 16 B a parameter, and the bf16 weight casts):
peaks ~16.5 vs ~12.3 GiB, -26% (the target: -20%). The MLP's GEMMs are ~80% of the step's FLOPs.
``e2e_llama.per_token`` measures these per part (mlp, attention, norms, other) from the bytes saved at
batch 2 less batch 1, for every config, and the summary prints them beside the formulas.

Configs (``e2e_common``): eager, patched (``dispatch.patch(model)``, the dispatcher picks or
``--backend``), patched-triton (forced onto triton). Training (the default): each config is built from
the same weights and first runs ``--warmup`` steps alone (compiles, autotuning; its own peak memory:
torch.cuda.max_memory_allocated over those steps but the first, whose autotuning buffers are reported
apart, less what was allocated before it was built); then all
step in turn on the same batches (a duel: one GPU clock and host phase for all): tokens/s from each
one's median step (CUDA events on the stream), the median of the per-step ratios against eager with a
95% interval (``e2e_common.paired``), every step's loss to a PNG, the MLP blocks' share of the step and
the block alone (``e2e_profile``), and the targets: speedup, peak memory, loss parity over the last 20
steps. Then, under a memory cap (``--mem-cap-gib``, torch.cuda.set_per_process_memory_fraction), the
largest batch each of ``--fit-configs`` trains in, in a fresh process (``e2e_memory.fit``: two steps of a fresh model;
doubling from ``--batch``, then bisection; out-of-memory caught, the cache emptied): the target is a
batch that fits patched where eager runs out of memory. The model and its memory accounting are
``e2e_llama``'s.

    python benchmarks/bench_e2e_llama.py [--batch 8] [--steps 60] [--mem-cap-gib 24] [--out DIR]
    python benchmarks/bench_e2e_llama.py --find-max-batch      # only the search under the cap
    python benchmarks/bench_e2e_llama.py --cpu-smoke           # a tiny model on the CPU, < 1 min

Targets (H200): patched >= 1.05x eager tokens/s with >= 20% less peak memory at the same batch, a
batch that fits patched where eager runs out of memory, loss within 1%.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import time
import traceback

import common
import e2e_common
import e2e_llama
import e2e_memory
import e2e_profile
import e2e_report
import torch
from tabulate import tabulate

from dispatch import timing

CONFIGS = ("eager", "patched", "patched-triton")
SPEEDUP, MEMORY_CUT = 1.05, 0.20
SMOKE = {"hidden": 64, "intermediate": 512, "layers": 2, "heads": 4, "seq": 64, "vocab": 1024, "batch": 2,
         "steps": 20, "warmup": 2, "max_batch": 8, "profile_steps": 2}  # fmt: skip


def arguments():
    p = common.parser(__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, help="duel steps of each config (default 60; 30 with --quick)")
    p.add_argument("--warmup", type=int, default=5, help="steps of each config alone first (untimed)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}, eager first"
    )
    p.add_argument(
        "--backend", help="the backend of configs not named -triton (default: the dispatcher picks)"
    )
    p.add_argument("--profile-steps", type=int, default=8, help="steps with the MLP blocks stamped (0: none)")
    p.add_argument("--find-max-batch", action="store_true", help="only the largest batch under the cap")
    p.add_argument("--no-fit", action="store_true", help="no search for the largest batch after training")
    p.add_argument("--fit-configs", default="eager,patched-triton", help="the configs the search runs")
    p.add_argument(
        "--mem-cap-gib", type=float, default=24.0, help="the search's memory cap (0: the whole GPU)"
    )
    p.add_argument("--max-batch", type=int, default=256, help="the search's upper bound (default 256)")
    p.add_argument("--cpu-smoke", action="store_true", help="2 layers, 64 wide, seq 64, on the CPU")
    if "--cpu-smoke" in sys.argv[1:]:  # the smoke's sizes as defaults: flags given still win
        p.set_defaults(**SMOKE, tag="cpu_smoke")
    args = p.parse_args()
    args.steps = args.steps or (30 if args.quick else 60)
    if args.vocab < e2e_common.CHAIN_VOCAB:
        p.error(f"--vocab must be at least the chain's {e2e_common.CHAIN_VOCAB} tokens, got {args.vocab}")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.fit_configs = [c.strip() for c in args.fit_configs.split(",") if c.strip()]
    bad = [c for c in args.configs + args.fit_configs if c not in CONFIGS]
    if bad or args.configs[:1] != ["eager"]:
        p.error(f"--configs / --fit-configs: some of {', '.join(CONFIGS)}, --configs eager first; got {bad}")
    return args


# ----------------------------------------------------------------------------- training


def prepare(name: str, config, state: dict, batches, args, device) -> dict:
    """Builds one config, measures what its tokens keep, runs its warm-up steps alone: a run dict with
    its losses so far, a copy of layer 0's MLP block (initial weights) and, on CUDA, its own peak and
    resident memory."""
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    model, opt, sched, report = e2e_llama.build(name, config, state, args, device)
    backend = e2e_common.backend_of(name, args.backend)
    run = {"config": name, "backend": backend, "model": model, "opt": opt, "sched": sched, "losses": []}
    if report is not None:
        print(report)
        run.update(patch=str(report), replaced=len(report))
        if not len(report):
            print("dispatch.patch replaced nothing: the patched model is the eager one")
    run["block"] = copy.deepcopy(e2e_llama.mlps(model)[0])
    run["saved_per_token"] = e2e_llama.per_token(model, args, device, backend)
    e2e_common.release(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    gib, first = e2e_memory.gib, None
    with e2e_common.dispatch_backend(backend):
        for i, (x, y) in enumerate(batches[: args.warmup]):
            run["losses"].append(e2e_common.step(model, opt, x, y, device))
            sched.step()
            if cuda and i == 0 and args.warmup > 1:  # the first step also holds autotuning's buffers
                timing.synchronize(device)
                first = gib(torch.cuda.max_memory_allocated() - before)
                torch.cuda.reset_peak_memory_stats()
    timing.synchronize(device)
    run["warmup_s"] = time.perf_counter() - start
    run["peak_gib"] = gib(torch.cuda.max_memory_allocated() - before) if cuda else None
    run["first_step_peak_gib"] = first
    run["resident_gib"] = gib(torch.cuda.memory_allocated() - before) if cuda else None  # weights, AdamW
    return run


def duel(runs: list[dict], batches, args, device) -> list[list[float]]:
    """The runs stepped in turn on each batch after the warm-up, the order rotated each step so that
    none always goes first; each one's step milliseconds (CUDA events: the GPU's clock)."""
    steps = [functools.partial(train_step, r, device) for r in runs]
    return e2e_common.in_turn(steps, batches[args.warmup :], device)


def train_step(run: dict, device, x, y) -> None:
    """One training step of a run on ``(x, y)`` under its backend: its loss kept, its schedule stepped."""
    with e2e_common.dispatch_backend(run["backend"]):
        run["losses"].append(e2e_common.step(run["model"], run["opt"], x, y, device))
    run["sched"].step()


def summarize(run: dict, ms: list[float], args) -> dict:
    """A results row as bench_e2e's: tokens/s from the median step, the loss curve, memory."""
    median = e2e_common.median(ms)
    losses = torch.stack(run["losses"]).float().tolist()
    keep = ("config", "patch", "replaced", "warmup_s", "peak_gib", "resident_gib", "saved_per_token")
    return {
        **{k: run[k] for k in keep if k in run},
        "backend": e2e_common.backend_label(run["config"], run["backend"]),
        "status": "ok",
        "step_ms": median,
        "tokens_per_s": args.batch * args.seq / (median / 1e3),
        "final_loss": e2e_common.final_loss(losses),
        "losses": losses,
    }


def profile(runs: list[dict], batches, args, device) -> dict:
    """The MLP blocks' share of the step in each run (``--profile-steps`` more steps, stamped), and
    layer 0's block alone at this shape, each under its config's backend."""
    chosen, shares = batches[: args.profile_steps], {}
    for r in runs:
        mlps = e2e_llama.mlps(r["model"])
        shares[r["config"]] = e2e_profile.mlp_share(r["model"], r["opt"], mlps, chosen, device, r["backend"])
    blocks = {r["config"]: (r.pop("block"), r["backend"]) for r in runs}
    alone = e2e_profile.against_eager(blocks, (args.batch, args.seq, args.hidden), device, args.cpu_smoke)
    return {"mlp_share": shares, "block_alone": alone}


def train(config, state: dict, args, device) -> dict:
    batches, entropy = e2e_common.chain_batches(args.warmup + args.steps, args.batch, args.seq, device)
    runs, rows = [], []
    for name in args.configs:
        skip = e2e_common.why_skipped(name, device)
        if skip:
            print(skip)
            rows.append({"config": name, "status": "skipped", "error": skip})
            continue
        print(f"--- {name}: build, {args.warmup} warm-up steps alone", flush=True)
        try:
            runs.append(prepare(name, config, state, batches, args, device))
        except Exception as exc:  # one config failing must not hide the others
            traceback.print_exc()
            rows.append({"config": name, "status": "failed", "error": timing.describe(exc)})
    print(f"--- duel: {', '.join(r['config'] for r in runs)} in turn, {args.steps} steps each", flush=True)
    duels, prof = [], {"mlp_share": {}, "block_alone": {}}
    try:
        ms = duel(runs, batches, args, device) if runs else []
        rows = [summarize(r, m, args) for r, m in zip(runs, ms)] + rows
        if runs and runs[0]["config"] == "eager":
            duels = [
                {"pair": ["eager", r["config"]], **e2e_common.paired(ms[0], m)}
                for r, m in zip(runs[1:], ms[1:])
            ]
        if args.profile_steps:
            print("--- profile: the MLP blocks' share of the step, the block alone", flush=True)
            prof = profile(runs, batches, args, device)
    except Exception as exc:  # e.g. out of memory with the models resident: the results file still says so
        traceback.print_exc()
        done = {r["config"] for r in rows}
        error = f"duel: {timing.describe(exc)}"
        rows += [
            {"config": r["config"], "status": "failed", "error": error}
            for r in runs
            if r["config"] not in done
        ]
    runs.clear()
    e2e_common.release(device)
    e2e_common.speedups(rows, ("eager",))
    png = common.path(args, "bench_e2e_llama_loss", "png")
    title = (
        f"LLaMA {args.layers}x{args.hidden}/{args.intermediate} training, bf16 autocast, batch {args.batch}"
    )
    drawn = e2e_report.plot(rows, entropy, png, title=title)
    print(f"wrote {png}" if drawn else "no matplotlib: no plot")
    found = e2e_report.targets(rows, duels, speedup=SPEEDUP, memory_cut=MEMORY_CUT)
    return {"chain_entropy_nats": entropy, "duels": duels, "rows": rows, "profile": prof,
            "plot": png if drawn else None, "targets": found}  # fmt: skip


# ----------------------------------------------------------------------------- the largest batch


def fit(config, state: dict, args, device) -> dict:
    """``e2e_memory.fit``: the largest batch of each of ``--fit-configs`` under ``--mem-cap-gib``, from
    ``--batch`` up to ``--max-batch``, each trial a fresh model."""

    def trial(name: str, batch: int) -> tuple:
        backend = e2e_common.backend_of(name, args.backend)
        fresh = functools.partial(e2e_llama.build, name, config, state, args, device)
        return e2e_memory.fits(lambda: fresh()[:2], batch, args.seq, backend, device)

    cap, start, bound = args.mem_cap_gib, args.batch, args.max_batch
    return e2e_memory.fit(args.fit_configs, trial, device, cap, start, bound, args.seq)


def fit_alone(args) -> dict:
    """``fit`` in a fresh process (``--find-max-batch``): its trials see none of the memory this one
    still holds (caches, CUDA graph pools) and no allocator state of the training runs."""
    held = e2e_memory.gib(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0.0
    print(f"--- the largest batch, in a fresh process (this one still holds {held:.2f} GiB)", flush=True)
    argv = [a for a in sys.argv[1:] if a != "--find-max-batch"] + ["--find-max-batch"]
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], check=False)
    try:
        with open(common.path(args, "bench_e2e_llama_maxbatch", "json")) as f:
            found = json.load(f)
    except (OSError, ValueError) as exc:
        line = [f"the largest-batch search ran (rc {done.returncode})", timing.describe(exc), "MISS"]
        return {"max_batch": [], "cap_gib": args.mem_cap_gib, "targets": [line]}
    return {"max_batch": found["max_batch"], "cap_gib": found["cap_gib"], "targets": found["fit_targets"]}


# ----------------------------------------------------------------------------- report


def summary(result: dict, args, device) -> None:
    targets = []
    if "rows" in result:
        rows = result["rows"]
        e2e_llama.print_saved(rows, args)
        cols = [
            "config",
            "backend",
            "status",
            "tokens_per_s",
            "x_eager",
            "step_ms",
            "peak_gib",
            "resident_gib",
        ]
        cols += ["warmup_s", "final_loss"]
        print(f"\nLLaMA {args.layers}x{args.hidden} (intermediate {args.intermediate}, vocab {args.vocab}), "
              f"batch {args.batch} x seq {args.seq}, {args.warmup} + {args.steps} steps, bf16 autocast; "
              f"chain entropy {result['chain_entropy_nats']:.3f} nats")  # fmt: skip
        print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, floatfmt=".4g"))
        for r in rows:
            if r["status"] != "ok":
                print(f"{r['config']} {r['status']}: {r['error']}")
        e2e_report.print_duels(result["duels"], "steps each in turn")
        clock = "GPU" if device.type == "cuda" else "wall"
        what = f"the MLP blocks in the step and alone ({clock} ms)"
        e2e_profile.print_prediction(result["profile"], rows, result["duels"], what)
        targets += result["targets"]
    if "max_batch" in result:
        e2e_memory.print_fit(result["max_batch"], result["cap_gib"], args.seq)
        targets += result["fit_targets"]
    print(tabulate(targets, headers=["target", "measured", ""]))


def main() -> None:
    args = arguments()
    device = common.setup(args)
    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads or 2)
    elif device.type != "cuda":
        raise SystemExit("no CUDA device: run with --cpu-smoke for a smoke run of a tiny model")
    name = "bench_e2e_llama_maxbatch" if args.find_max_batch else "bench_e2e_llama"
    with common.logged(args, name):
        import transformers

        config = e2e_llama.llama_config(args)
        state = e2e_llama.initial_state(config)  # on the host, out of the memory peaks
        params = sum(t.numel() for t in state.values())
        model = {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                 "heads": args.heads, "vocab": args.vocab, "seq": args.seq, "params": params,
                 "attn_implementation": getattr(config, "_attn_implementation", None)}  # fmt: skip
        print(f"model: {model}", flush=True)
        result: dict = {}
        if not args.find_max_batch:
            decisions = e2e_llama.decisions(config, args, device)
            result = {"decisions": decisions, **train(config, state, args, device)}
        if args.find_max_batch or not args.no_fit:
            found = fit(config, state, args, device) if args.find_max_batch else fit_alone(args)
            result.update(
                max_batch=found["max_batch"], cap_gib=found["cap_gib"], fit_targets=found["targets"]
            )
        common.write(args, name, {"transformers": transformers.__version__, "model": model, **result}, device)
        summary(result, args, device)


if __name__ == "__main__":
    main()
