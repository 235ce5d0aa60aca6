"""End to end, LLaMA: does dispatch.patch make a gated-MLP model train faster, in less memory, same loss?

A LLaMA-style model from a transformers LlamaConfig, random init (nothing downloaded): 8 layers, hidden
1024, SwiGLU intermediate 4096, 16 heads, vocab 32000, context 2048, sdpa attention, no dropout: 200M
parameters, 3.2 GB with float32 gradients and AdamW state, while a batch of 8 x 2048 tokens keeps, by
estimate, several times that in activations (the MLP's gate, up, silu and product outputs among them).
bf16 autocast, fused AdamW, clipping: ``e2e_common.step``; data: bench_e2e's Markov chain (its entropy
is the loss floor).

Training (the default): eager and ``dispatch.patch(model)`` (its report printed) start from the same
weights. Each first runs ``--warmup`` steps alone (compiles, autotuning; its own peak memory:
torch.cuda.max_memory_allocated over those steps, less what was allocated before it was built, the other
model idle), then the two step in turn on the same batches, a duel, so both see one GPU clock and host
phase: tokens/s from each one's median step time (CUDA events on the stream), the median of the per-step
ratios with a 95% interval (``e2e_common.paired``), loss curves of every step to a PNG (matplotlib), and
bench_e2e's targets (speedup, peak memory, loss parity over the last 20 steps).

``--find-max-batch``: instead, for each model alone, the largest batch whose two training steps fit
(doubling from 1, then bisection; out-of-memory caught, the cache emptied), up to ``--max-batch``.

    python benchmarks/bench_e2e_llama.py [--batch 8] [--steps 100] [--out DIR] [--tag TAG]
    python benchmarks/bench_e2e_llama.py --find-max-batch
    python benchmarks/bench_e2e_llama.py --cpu-smoke [--find-max-batch]   # a tiny model on the CPU
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Optional

import common
import e2e_common
import torch
from tabulate import tabulate

from dispatch import timing

CONFIGS = ("eager", "patched")
SMOKE = {"hidden": 64, "intermediate": 256, "layers": 2, "heads": 4, "seq": 64, "vocab": 1024, "batch": 2,
         "steps": 6, "warmup": 2, "max_batch": 8}  # fmt: skip
TRIAL_STEPS = 2  # a batch fits when this many steps do (the first allocates AdamW's state)


def arguments():
    p = common.parser(__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, help="duel steps of each model (default 100; 30 with --quick)")
    p.add_argument("--warmup", type=int, default=5, help="steps of each model alone first (untimed)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--backend", help="one dispatch backend for all fused ops (default: the dispatcher picks)")
    p.add_argument("--find-max-batch", action="store_true", help="the largest batch each model fits, alone")
    p.add_argument("--max-batch", type=int, default=1024, help="the search's upper bound (default 1024)")
    p.add_argument("--cpu-smoke", action="store_true", help="2 layers, 64 wide, seq 64, on the CPU")
    args = p.parse_args()
    if args.cpu_smoke:
        vars(args).update(SMOKE)
        args.tag = args.tag or "cpu_smoke"
    args.steps = args.steps or (30 if args.quick else 100)
    if args.vocab < e2e_common.CHAIN_VOCAB:
        p.error(f"--vocab must be at least the chain's {e2e_common.CHAIN_VOCAB} tokens, got {args.vocab}")
    return args


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.seq), hidden_act="silu", attention_dropout=0.0,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip


def build(name: str, config, state: dict, args, device):
    """(model, optimizer, lr schedule, patch report or None): the weights of ``state``, patched for
    "patched"; built on the device (its random init then overwritten: faster than on the host)."""
    from transformers import LlamaForCausalLM

    import dispatch

    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.train()
    report = dispatch.patch(model) if name == "patched" else None
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    warm = max(1, (args.warmup + args.steps) // 15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return model, opt, sched, report


def _gib(n: int) -> float:
    return n / 2**30


# ----------------------------------------------------------------------------- training


def prepare(name: str, config, state: dict, batches, args, device) -> dict:
    """Builds one config and runs its warm-up steps alone: a run dict with its losses so far and, on
    CUDA, its own peak and resident memory."""
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model, opt, sched, report = build(name, config, state, args, device)
    run = {"config": name, "model": model, "opt": opt, "sched": sched, "losses": []}
    if report is not None:
        print(report)
        run.update(patch=str(report), replaced=len(report))
        if not len(report):
            print("dispatch.patch replaced nothing: the patched model is the eager one")
    with e2e_common.dispatch_backend(args.backend):
        for x, y in batches[: args.warmup]:
            run["losses"].append(e2e_common.step(model, opt, x, y, device))
            sched.step()
    timing.synchronize(device)
    run["warmup_s"] = time.perf_counter() - start
    run["peak_gib"] = _gib(torch.cuda.max_memory_allocated() - before) if cuda else None
    run["resident_gib"] = _gib(torch.cuda.memory_allocated() - before) if cuda else None  # weights, AdamW
    return run


def duel(runs: list[dict], batches, args, device) -> list[list[float]]:
    """The runs stepped in turn on each batch after the warm-up, the first one alternating so that
    neither always goes first; each one's step milliseconds (CUDA events: the GPU's clock)."""
    marks: list[list] = [[] for _ in runs]
    with e2e_common.dispatch_backend(args.backend):
        for i, (x, y) in enumerate(batches[args.warmup :]):
            order = list(range(len(runs)))
            for k in order if i % 2 == 0 else order[::-1]:
                r = runs[k]
                start = timing.stamp(device)
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
    keep = ("config", "patch", "replaced", "warmup_s", "peak_gib", "resident_gib")
    return {
        **{k: run[k] for k in keep if k in run},
        "status": "ok",
        "step_ms": median,
        "tokens_per_s": args.batch * args.seq / (median / 1e3),
        "final_loss": sum(tail) / len(tail),
        "losses": losses,
    }


def train(config, state: dict, args, device) -> dict:
    corpus, entropy = e2e_common.markov_corpus((args.warmup + args.steps) * args.batch, args.seq + 1)
    corpus = corpus.to(device).view(args.warmup + args.steps, args.batch, args.seq + 1)
    batches = [(c[:, :-1], c[:, 1:]) for c in corpus]
    runs, rows = [], []
    for name in CONFIGS:
        print(f"--- {name}: build, {args.warmup} warm-up steps alone", flush=True)
        try:
            runs.append(prepare(name, config, state, batches, args, device))
        except Exception as exc:  # one config failing must not hide the other
            traceback.print_exc()
            rows.append({"config": name, "status": "failed", "error": timing.describe(exc)})
    print(f"--- duel: {', '.join(r['config'] for r in runs)} in turn, {args.steps} steps each", flush=True)
    try:
        ms = duel(runs, batches, args, device)
        rows = [summarize(r, m, args) for r, m in zip(runs, ms)] + rows
    except Exception as exc:  # e.g. out of memory with both models resident: the results file still says so
        traceback.print_exc()
        error = f"duel: {timing.describe(exc)}"
        rows += [{"config": r["config"], "status": "failed", "error": error} for r in runs]
        runs = []
    duels = [{"pair": [r["config"] for r in runs], **e2e_common.paired(*ms)}] if len(runs) == 2 else []
    by = {r["config"]: r for r in rows if r["status"] == "ok"}
    if "eager" in by:
        for r in by.values():
            r["x_eager"] = r["tokens_per_s"] / by["eager"]["tokens_per_s"]
    png = common.path(args, "bench_e2e_llama_loss", "png")
    title = f"LLaMA {args.layers}x{args.hidden} training, bf16 autocast, batch {args.batch}: eager vs patched"
    drawn = e2e_common.plot(rows, entropy, png, title=title)
    print(f"wrote {png}" if drawn else "no matplotlib: no plot")
    return {"chain_entropy_nats": entropy, "duels": duels, "rows": rows, "plot": png if drawn else None,
            "targets": e2e_common.targets(rows, duels)}  # fmt: skip


# ----------------------------------------------------------------------------- the largest batch


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


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
        with e2e_common.dispatch_backend(args.backend):
            for _ in range(TRIAL_STEPS):
                e2e_common.step(model, opt, x[:, :-1], x[:, 1:], device)
        timing.synchronize(device)
        ok = True
    except Exception as exc:
        if not is_oom(exc):
            raise
    finally:
        del model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return ok, _gib(torch.cuda.max_memory_allocated()) if cuda and ok else None


def max_batch(name: str, config, state: dict, args, device) -> dict:
    """The largest batch up to ``--max-batch`` that fits: doubling from 1 until one fails, then
    bisection between the last that fit and the first that failed (or the bound)."""
    trials: dict[int, Optional[float]] = {}  # batch -> peak GiB, None where it failed

    def trial(batch: int) -> bool:
        ok, peak = fits(name, batch, config, state, args, device)
        trials[batch] = peak if ok else None
        print(f"{name} batch {batch}: {'fits' if ok else 'out of memory'}"
              + (f", peak {peak:.2f} GiB" if peak else ""), flush=True)  # fmt: skip
        return ok

    lo, hi, batch = 0, None, 1
    while hi is None and batch <= args.max_batch:
        lo, hi = (batch, None) if trial(batch) else (lo, batch)
        batch *= 2
    bounded = hi is None  # nothing failed: the answer is the bound's, not memory's
    hi = args.max_batch + 1 if hi is None else hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if trial(mid) else (lo, mid)
    return {"config": name, "max_batch": lo, "bounded": bounded, "tokens": lo * args.seq,
            "peak_gib": trials.get(lo), "trials": trials}  # fmt: skip


# ----------------------------------------------------------------------------- report


def decisions(config, args, device) -> dict:
    """What the dispatcher picks for the patched MLP's call at this size (bf16, training, the (gate,
    up) pair as dispatch.patch passes LLaMA's)."""
    from dispatch import explain

    m, h, f = args.batch * args.seq, config.hidden_size, config.intermediate_size
    kw = {"device": device, "dtype": torch.bfloat16, "requires_grad": True}
    x, gate, up, down = (torch.randn(*s, **kw) for s in ((m, h), (f, h), (f, h), (h, f)))
    with e2e_common.dispatch_backend(args.backend):
        return {"mlp": str(explain("fused_mlp", x, (gate, up), None, down, None, "swiglu"))}


def summary(result: dict, args) -> None:
    if "max_batch" in result:
        cols = ["config", "max_batch", "tokens", "peak_gib", "bounded"]
        print(f"\nthe largest batch of seq {args.seq} for {TRIAL_STEPS} training steps, each model alone")
        print(tabulate([[r.get(c) for c in cols] for r in result["max_batch"]], headers=cols, floatfmt=".4g"))
        return
    cols = ["config", "status", "tokens_per_s", "x_eager", "step_ms", "peak_gib", "resident_gib", "warmup_s"]
    cols += ["final_loss"]
    print(f"\nLLaMA {args.layers}x{args.hidden} (intermediate {args.intermediate}), batch {args.batch} x seq "
          f"{args.seq}, {args.warmup} + {args.steps} steps, bf16 autocast; chain entropy "
          f"{result['chain_entropy_nats']:.3f} nats")  # fmt: skip
    print(tabulate([[r.get(c, "") for c in cols] for r in result["rows"]], headers=cols, floatfmt=".4g"))
    for r in result["rows"]:
        if r["status"] != "ok":
            print(f"{r['config']} failed: {r['error']}")
    for d in result["duels"]:
        print(f"duel {d['pair'][0]} vs {d['pair'][1]}, {d['steps']} alternating steps each: step ms "
              f"{d['step_ms'][0]:.3f} vs {d['step_ms'][1]:.3f}")  # fmt: skip
    print(tabulate(result["targets"], headers=["target", "measured", ""]))


def main() -> None:
    args = arguments()
    device = common.setup(args)
    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads or 1)
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
        if args.find_max_batch:
            result = {"max_batch": [max_batch(c, config, state, args, device) for c in CONFIGS]}
        else:
            result = {"decisions": decisions(config, args, device), **train(config, state, args, device)}
        common.write(args, name, {"transformers": transformers.__version__, "model": model, **result}, device)
        summary(result, args)


if __name__ == "__main__":
    main()
