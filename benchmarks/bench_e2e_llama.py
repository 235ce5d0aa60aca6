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
``per_token`` measures these per part (mlp, attention, norms, other) from the bytes saved at batch 2
less batch 1, for every config, and the summary prints them beside the formulas.

Configs (``e2e_common``): eager, patched (``dispatch.patch(model)``, the dispatcher picks or
``--backend``), patched-triton (forced onto triton). Training (the default): each config is built from
the same weights and first runs ``--warmup`` steps alone (compiles, autotuning; its own peak memory:
torch.cuda.max_memory_allocated over those steps less what was allocated before it was built); then all
step in turn on the same batches (a duel: one GPU clock and host phase for all): tokens/s from each
one's median step (CUDA events on the stream), the median of the per-step ratios against eager with a
95% interval (``e2e_common.paired``), every step's loss to a PNG, the MLP blocks' share of the step and
the block alone (``e2e_profile``), and the targets: speedup, peak memory, loss parity over the last 20
steps. Then, under a memory cap (``--mem-cap-gib``, torch.cuda.set_per_process_memory_fraction), the
largest batch each of ``--fit-configs`` trains in (two steps of a fresh model; doubling from
``--batch``, then bisection; out-of-memory caught, the cache emptied): the target is a batch that fits
patched where eager runs out of memory.

    python benchmarks/bench_e2e_llama.py [--batch 8] [--steps 60] [--mem-cap-gib 24] [--out DIR]
    python benchmarks/bench_e2e_llama.py --find-max-batch      # only the search under the cap
    python benchmarks/bench_e2e_llama.py --cpu-smoke           # a tiny model on the CPU, < 1 min

Targets (H200): patched >= 1.05x eager tokens/s with >= 20% less peak memory at the same batch, a
batch that fits patched where eager runs out of memory, loss within 1%.
"""

from __future__ import annotations

import copy
import gc
import sys
import time
import traceback
from typing import Optional

import common
import e2e_common
import e2e_memory
import e2e_profile
import torch
import torch.nn.functional as F
from tabulate import tabulate

from dispatch import timing

CONFIGS = ("eager", "patched", "patched-triton")
SPEEDUP, MEMORY_CUT = 1.05, 0.20
SMOKE = {"hidden": 64, "intermediate": 512, "layers": 2, "heads": 4, "seq": 64, "vocab": 1024, "batch": 2,
         "steps": 20, "warmup": 2, "max_batch": 8, "profile_steps": 2}  # fmt: skip
TRIAL_STEPS = 2  # a batch fits when this many steps do (the first allocates AdamW's state)
PARTS = {
    "mlp": "mlp",
    "self_attn": "attention",
    "input_layernorm": "norms",
    "post_attention_layernorm": "norms",
}


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


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.seq), hidden_act="silu", attention_dropout=0.0,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip


def build(name: str, config, state: dict, args, device):
    """(model, optimizer, lr schedule, patch report or None): the weights of ``state``, patched for
    patched configs; built on the device (its random init then overwritten: faster than on the host)."""
    from transformers import LlamaForCausalLM

    import dispatch

    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.train()
    report = dispatch.patch(model) if e2e_common.is_patched(name) else None
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    warm = max(1, (args.warmup + args.steps) // 15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return model, opt, sched, report


def mlps(model) -> list:
    return [layer.mlp for layer in model.model.layers]


def _gib(n: int) -> float:
    return n / 2**30


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- what a token keeps


def saved_bytes(model, batch: int, args, device, backend: Optional[str]) -> dict[str, int]:
    """``e2e_memory.saved_bytes`` of one training forward and loss at ``batch``, by decoder-layer part."""
    parts = {getattr(layer, attr): part for layer in model.model.layers for attr, part in PARTS.items()}
    x = torch.randint(0, e2e_common.CHAIN_VOCAB, (batch, args.seq + 1), device=device)

    def forward() -> torch.Tensor:
        with e2e_common.dispatch_backend(backend), torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits  # (batch, seq, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())

    return e2e_memory.saved_bytes(model, parts, forward)


def per_token(model, args, device, backend: Optional[str]) -> dict[str, float]:
    """Bytes a token keeps, per layer for each of ``PARTS``' parts and once for "other": the saved
    bytes at batch 2 less those at batch 1 (what does not grow with the batch, the weight casts among
    it, cancels), over the tokens and layers."""
    one, two = (saved_bytes(model, b, args, device, backend) for b in (1, 2))
    out = {}
    for part in sorted(set(one) | set(two)):
        grew = two.get(part, 0) - one.get(part, 0)
        out[part] = grew / args.seq / (1 if part == "other" else args.layers)
    return out


def analytic(args) -> dict[str, float]:
    """The docstring's formulas: bytes a token keeps per layer (MLP, norms) and once (other)."""
    h, f = args.hidden, args.intermediate
    return {
        "mlp eager": 4 * h + 8 * f,
        "mlp fused": 2 * h + 4 * f,
        "norms": 16 * h + 8,
        "other": 8 * h + 4 * args.vocab,
    }


# ----------------------------------------------------------------------------- training


def prepare(name: str, config, state: dict, batches, args, device) -> dict:
    """Builds one config, measures what its tokens keep, runs its warm-up steps alone: a run dict with
    its losses so far, a copy of layer 0's MLP block (initial weights) and, on CUDA, its own peak and
    resident memory."""
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    model, opt, sched, report = build(name, config, state, args, device)
    backend = e2e_common.backend_of(name, args.backend)
    run = {"config": name, "backend": backend, "model": model, "opt": opt, "sched": sched, "losses": []}
    if report is not None:
        print(report)
        run.update(patch=str(report), replaced=len(report))
        if not len(report):
            print("dispatch.patch replaced nothing: the patched model is the eager one")
    run["block"] = copy.deepcopy(mlps(model)[0])
    run["saved_per_token"] = per_token(model, args, device, backend)
    release(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with e2e_common.dispatch_backend(backend):
        for x, y in batches[: args.warmup]:
            run["losses"].append(e2e_common.step(model, opt, x, y, device))
            sched.step()
    timing.synchronize(device)
    run["warmup_s"] = time.perf_counter() - start
    run["peak_gib"] = _gib(torch.cuda.max_memory_allocated() - before) if cuda else None
    run["resident_gib"] = _gib(torch.cuda.memory_allocated() - before) if cuda else None  # weights, AdamW
    return run


def duel(runs: list[dict], batches, args, device) -> list[list[float]]:
    """The runs stepped in turn on each batch after the warm-up, the order rotated each step so that
    none always goes first; each one's step milliseconds (CUDA events: the GPU's clock)."""
    marks: list[list] = [[] for _ in runs]
    for i, (x, y) in enumerate(batches[args.warmup :]):
        shift = i % len(runs)
        for k in [*range(shift, len(runs)), *range(shift)]:
            r = runs[k]
            start = timing.stamp(device)
            with e2e_common.dispatch_backend(r["backend"]):
                r["losses"].append(e2e_common.step(r["model"], r["opt"], x, y, device))
            r["sched"].step()
            marks[k].append((start, timing.stamp(device)))
    timing.synchronize(device)
    return [[timing.elapsed_ms(a, b) for a, b in m] for m in marks]


def summarize(run: dict, ms: list[float], args) -> dict:
    """A results row as bench_e2e's: tokens/s from the median step, the loss curve, memory."""
    median = sorted(ms)[len(ms) // 2]
    losses = torch.stack(run["losses"]).float().tolist()
    tail = losses[-e2e_common.PARITY_TAIL :]
    keep = ("config", "patch", "replaced", "warmup_s", "peak_gib", "resident_gib", "saved_per_token")
    return {
        **{k: run[k] for k in keep if k in run},
        "backend": (run["backend"] or "dispatch") if e2e_common.is_patched(run["config"]) else "-",
        "status": "ok",
        "step_ms": median,
        "tokens_per_s": args.batch * args.seq / (median / 1e3),
        "final_loss": sum(tail) / len(tail),
        "losses": losses,
    }


def profile(runs: list[dict], batches, args, device) -> dict:
    """The MLP blocks' share of the step in each run (``--profile-steps`` more steps, stamped), and
    layer 0's block alone at this shape, each under its config's backend."""
    shares = {}
    for r in runs:
        chosen = batches[: args.profile_steps]
        shares[r["config"]] = e2e_profile.mlp_share(r["model"], r["opt"], mlps(r["model"]), chosen, device,
                                                    r["backend"])  # fmt: skip
    blocks = {r["config"]: (r.pop("block"), r["backend"]) for r in runs}
    alone = {}
    if "eager" in blocks and len(blocks) > 1:
        rep_ms = 20.0 if args.cpu_smoke else 60.0
        alone = e2e_profile.block_alone(blocks, (args.batch, args.seq, args.hidden), device, rep_ms=rep_ms)
    return {"mlp_share": shares, "block_alone": alone}


def train(config, state: dict, args, device) -> dict:
    corpus, entropy = e2e_common.markov_corpus((args.warmup + args.steps) * args.batch, args.seq + 1)
    corpus = corpus.to(device).view(args.warmup + args.steps, args.batch, args.seq + 1)
    batches = [(c[:, :-1], c[:, 1:]) for c in corpus]
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
    release(device)
    by = {r["config"]: r for r in rows if r["status"] == "ok"}
    if "eager" in by:
        for r in by.values():
            r["x_eager"] = r["tokens_per_s"] / by["eager"]["tokens_per_s"]
    png = common.path(args, "bench_e2e_llama_loss", "png")
    title = (
        f"LLaMA {args.layers}x{args.hidden}/{args.intermediate} training, bf16 autocast, batch {args.batch}"
    )
    drawn = e2e_common.plot(rows, entropy, png, title=title)
    print(f"wrote {png}" if drawn else "no matplotlib: no plot")
    found = e2e_common.targets(rows, duels, speedup=SPEEDUP, memory_cut=MEMORY_CUT)
    return {"chain_entropy_nats": entropy, "duels": duels, "rows": rows, "profile": prof,
            "plot": png if drawn else None, "targets": found}  # fmt: skip


# ----------------------------------------------------------------------------- the largest batch


def fits(name: str, batch: int, config, state: dict, args, device) -> tuple[bool, Optional[float]]:
    """(whether ``TRIAL_STEPS`` training steps of a fresh model at ``batch`` fit, their peak GiB)."""
    cuda = device.type == "cuda"
    model = opt = None
    ok = False
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model, opt, _, _ = build(name, config, state, args, device)
        x = torch.randint(0, e2e_common.CHAIN_VOCAB, (batch, args.seq + 1), device=device)
        with e2e_common.dispatch_backend(e2e_common.backend_of(name, args.backend)):
            for _ in range(TRIAL_STEPS):
                e2e_common.step(model, opt, x[:, :-1], x[:, 1:], device)
        timing.synchronize(device)
        ok = True
    except Exception as exc:
        if not e2e_memory.is_oom(exc):
            raise
    finally:
        del model, opt
        release(device)
    return ok, _gib(torch.cuda.max_memory_allocated()) if cuda and ok else None


def max_batch(name: str, config, state: dict, args, device) -> dict:
    """The largest batch up to ``--max-batch`` that fits (``e2e_memory.largest_batch`` from ``--batch``),
    every trial's peak GiB (None where it failed)."""
    trials: dict[int, Optional[float]] = {}

    def trial(batch: int) -> bool:
        ok, peak = fits(name, batch, config, state, args, device)
        trials[batch] = peak if ok else None
        print(f"{name} batch {batch}: {'fits' if ok else 'out of memory'}"
              + (f", peak {peak:.2f} GiB" if peak else ""), flush=True)  # fmt: skip
        return ok

    best, bounded = e2e_memory.largest_batch(trial, args.batch, args.max_batch)
    return {"config": name, "max_batch": best, "bounded": bounded, "tokens": best * args.seq,
            "peak_gib": trials.get(best), "trials": trials}  # fmt: skip


def fit(config, state: dict, args, device) -> dict:
    """``max_batch`` of each of ``--fit-configs`` under ``--mem-cap-gib``, and the target's line."""
    found = []
    with e2e_memory.memory_cap(args.mem_cap_gib, device) as cap:
        for name in args.fit_configs:
            skip = e2e_common.why_skipped(name, device)
            if skip:
                print(skip)
                continue
            where = f" in {args.mem_cap_gib:g} GiB" if cap else ""
            print(f"--- the largest batch of {name}{where}", flush=True)
            found.append(max_batch(name, config, state, args, device))
    by = {r["config"]: r for r in found}
    target = []
    if "eager" in by and len(by) > 1:
        e = by["eager"]
        for name, r in by.items():
            if name != "eager":
                ok = not e["bounded"] and r["max_batch"] > e["max_batch"]
                what = f"max batch {r['max_batch']} vs eager's {e['max_batch']}" + (
                    " (bound)" if r["bounded"] else ""
                )
                limit = f"cap {args.mem_cap_gib:g} GiB" if cap else "no cap"
                target.append([f"{name} fits a batch eager cannot ({limit})", what, "PASS" if ok else "MISS"])
    return {"max_batch": found, "cap_gib": args.mem_cap_gib if cap else None, "targets": target}


# ----------------------------------------------------------------------------- report


def decisions(config, args, device) -> dict:
    """What the dispatcher picks for the patched MLP's call at this size (bf16, training, the (gate,
    up) pair as dispatch.patch passes LLaMA's), per patched config's backend."""
    from dispatch import explain

    m, h, f = args.batch * args.seq, config.hidden_size, config.intermediate_size
    kw = {"device": device, "dtype": torch.bfloat16, "requires_grad": True}
    x, gate, up, down = (torch.randn(*s, **kw) for s in ((m, h), (f, h), (f, h), (h, f)))
    out = {}
    for name in args.configs[1:]:
        with e2e_common.dispatch_backend(e2e_common.backend_of(name, args.backend)):
            try:
                out[name] = str(explain("fused_mlp", x, (gate, up), None, down, None, "swiglu"))
            except Exception as exc:  # e.g. triton on the CPU: the reason is the answer
                out[name] = timing.describe(exc)
    return out


def print_saved(rows: list[dict], args) -> None:
    """Bytes a token keeps, per layer and part, measured per config, beside the docstring's formulas."""
    formulas = analytic(args)
    parts = ["mlp", "attention", "norms", "other"]
    lines = [
        [r["config"], *(r["saved_per_token"].get(p) for p in parts)] for r in rows if "saved_per_token" in r
    ]
    lines.append(["formula: eager / fused", f"{formulas['mlp eager']} / {formulas['mlp fused']}",
                  f"~{14 * args.hidden}", formulas["norms"], f"~{formulas['other']}"])  # fmt: skip
    sizes = f"H = {args.hidden}, F = {args.intermediate}"
    print(f"\nbytes a token keeps for backward, per layer (other: once), {sizes}")
    print(tabulate(lines, headers=["config", *parts], floatfmt=".0f", missingval="-"))


def summary(result: dict, args, device) -> None:
    targets = []
    if "rows" in result:
        rows = result["rows"]
        print_saved(rows, args)
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
        for d in result["duels"]:
            print(f"duel {d['pair'][0]} vs {d['pair'][1]}, {d['steps']} steps each in turn: step ms "
                  f"{d['step_ms'][0]:.3f} vs {d['step_ms'][1]:.3f}")  # fmt: skip
        prof = result["profile"]
        if prof["mlp_share"]:
            lines, heads = e2e_profile.prediction(
                prof["mlp_share"], prof["block_alone"], rows, result["duels"]
            )
            clock = "GPU" if device.type == "cuda" else "wall"
            print(f"\nthe MLP blocks in the step and alone ({clock} ms); "
                  "predicted x = 1 / (1 - eager's share + share / block x)")  # fmt: skip
            print(tabulate(lines, headers=heads, floatfmt=".4g", missingval="-"))
        targets += result["targets"]
    if "max_batch" in result:
        cols = ["config", "max_batch", "tokens", "peak_gib", "bounded"]
        cap = f"in {result['cap_gib']:g} GiB" if result["cap_gib"] else "(no cap)"
        print(
            f"\nthe largest batch of seq {args.seq} for {TRIAL_STEPS} training steps {cap}, each model alone"
        )
        print(tabulate([[r.get(c) for c in cols] for r in result["max_batch"]], headers=cols, floatfmt=".4g"))
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
        from transformers import LlamaForCausalLM

        config = llama_config(args)
        torch.manual_seed(e2e_common.SEED)
        state = LlamaForCausalLM(config).state_dict()  # on the host, out of the memory peaks
        params = sum(t.numel() for t in state.values())
        model = {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                 "heads": args.heads, "vocab": args.vocab, "seq": args.seq, "params": params,
                 "attn_implementation": getattr(config, "_attn_implementation", None)}  # fmt: skip
        print(f"model: {model}", flush=True)
        result: dict = {}
        if not args.find_max_batch:
            result = {"decisions": decisions(config, args, device), **train(config, state, args, device)}
        if args.find_max_batch or not args.no_fit:
            found = fit(config, state, args, device)
            result.update(
                max_batch=found["max_batch"], cap_gib=found["cap_gib"], fit_targets=found["targets"]
            )
        common.write(args, name, {"transformers": transformers.__version__, "model": model, **result}, device)
        summary(result, args, device)


if __name__ == "__main__":
    main()
