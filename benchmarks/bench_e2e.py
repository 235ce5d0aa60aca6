"""End to end: does dispatch.patch make GPT-2 train faster, with the same loss and less memory?

A GPT-2-small-sized model (12 layers, 768 wide, 12 heads, vocab 50257, context 1024) from a
transformers GPT2Config (``e2e_gpt2``), random init (nothing downloaded), bf16 autocast, fused AdamW,
dropout 0.1 everywhere (embeddings, attention, residuals; the MLP's output dropout then runs in the
fused block).
``dispatch.patch`` makes each GPT2MLP one FusedMLP (c_fc -> gelu_new -> c_proj -> dropout in one
``fused_mlp`` call). Configs (``e2e_common``'s names) train from the same initial weights on the same
batches: eager, patched (the dispatcher picks the block's backend), patched-triton (forced onto triton),
compile, compile+patched (and, asked for, compile+patched-triton). Each reports tokens/s (median step
time after warm-up, between CUDA events on the stream: the GPU's clock, idle gaps included when the GPU
waits on the host), the wall time per step over the same steps (perf_counter, synchronized at both
ends), the speedups vs eager (plain PyTorch) and vs torch.compile of the original, peak memory
(torch.cuda.max_memory_allocated, reset between configs) and its loss curve (PNG); a config that fails
is recorded and the others still run.

Data: a fixed Markov chain (1024 tokens, each with 8 successors drawn once, Zipf(1) probabilities over
them, seeded here), so the loss has a known floor, the chain's entropy. Parity (``loss_parity``): the
mean loss of the last 20 steps, patched vs eager, within 1%, judged on runs with every dropout off and
on the mean over several dropout seeds: one seed's loss escapes the early plateau at a step its dropout
stream decides, so a single pair of runs can differ by far more than the op does.

Duels (``--duel`` steps each, after the separate runs): eager against each patched config, then compile
and compile+patched, built side by side and stepped in turn, so that each pair's ratio sees one GPU
clock and one host phase. ``--duel-pairs`` runs other pairs instead, including controls: one config
against a second build of itself (``compile/compile``), the offset a duel shows between identical graphs.

Profile (``--profile-steps``, eager-mode configs): the MLP blocks' share of the step (``e2e_profile``),
the block alone at this shape (the model's own GPT2MLP against its FusedMLP on each backend: bench_mlp's
gpt2 row times ``nn.GELU("tanh")``, one kernel, where GPT-2's gelu_new is seven), and the step speedup
the two predict next to the measured one.

    python benchmarks/bench_e2e.py [--out DIR] [--steps 200] [--quick] [--backend NAME]
    python benchmarks/bench_e2e.py --tiny          # 2 layers, 64 wide: on the CPU in under a minute

Targets (H200, 8 x 1024 tokens): patched > 1.14x eager tokens/s with lower peak memory;
compile+patched >= 1.02x compile; loss within 1%.
"""

from __future__ import annotations

import copy
import itertools
import time
import traceback

import common
import e2e_gpt2
import e2e_profile
import e2e_report
import torch
from e2e_common import (
    SEED,
    backend_label,
    backend_of,
    chain_batches,
    dispatch_backend,
    final_loss,
    in_turn,
    is_compiled,
    is_patched,
    median,
    optimizer,
    paired,
    release,
    schedule,
    speedups,
    step,
    why_skipped,
)
from tabulate import tabulate

from dispatch import timing

CONFIGS = ("eager", "patched", "patched-triton", "compile", "compile+patched", "compile+patched-triton")
DEFAULT_CONFIGS = CONFIGS[:5]
SPEEDUP, COMPILE_SPEEDUP = 1.14, 1.02  # the targets: past the 1.14x reached, and 1.02x compile's


def arguments():
    p = common.parser(__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, help="training steps per config (default 200; 40 with --quick)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (compile: the 1st)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 12; 4 with --quick)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    p.add_argument(
        "--backend", help="the backend of configs not named -triton (default: the dispatcher picks)"
    )
    p.add_argument("--tiny", action="store_true", help="2 layers, 64 wide, seq 64, batch 4: a smoke run")
    p.add_argument(
        "--mlp-blocks-off",
        action="store_true",
        help="patch(mlp_blocks=False): the per-linear rewrite (FusedLinear, dropout ops), not FusedMLP",
    )
    p.add_argument(
        "--bias-in-dropout",
        action="store_true",
        help="with --mlp-blocks-off: patch(bias_in_linear=False), c_proj's bias in the dropout's pass",
    )
    p.add_argument(
        "--no-linear-dropout",
        action="store_true",
        help="with --mlp-blocks-off: patch(linear_dropout=False), c_proj -> dropout stays native",
    )
    p.add_argument("--duel", type=int, default=60, help="timed steps of each config in each duel (0: none)")
    p.add_argument(
        "--duel-pairs",
        help="duels to run instead of the standard ones, e.g. 'compile/compile,compile/compile+patched':"
        " a pair of one config twice (two builds of the same model) measures what the duel sees between"
        " identical graphs",
    )
    p.add_argument("--profile-steps", type=int, default=8, help="steps with the MLP blocks stamped (0: none)")
    p.add_argument("--parity-steps", type=int, default=60, help="steps of each loss-parity run (0: none)")
    p.add_argument("--parity-seeds", type=int, default=3, help="dropout streams of the loss-parity runs")
    args = p.parse_args()
    if args.tiny:
        args.layers, args.seq, args.batch, args.vocab = args.layers or 2, 64, 4, 1024
        args.steps = args.steps or 24
        args.duel = min(args.duel, 6)
        args.profile_steps = min(args.profile_steps, 3)
        args.parity_steps, args.parity_seeds = min(args.parity_steps, 24), min(args.parity_seeds, 2)
    args.steps = args.steps or (40 if args.quick else 200)
    args.layers = args.layers or (4 if args.quick else 12)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    args.pairs = None
    if args.duel_pairs is not None:
        args.pairs = [tuple(pair.split("/")) for pair in args.duel_pairs.split(",") if pair]
        bad = [pair for pair in args.pairs if len(pair) != 2 or not set(pair) <= set(CONFIGS)]
        if bad:
            p.error(f"--duel-pairs: expected FIRST/SECOND pairs of {', '.join(CONFIGS)}, got {bad}")
    args.warmup = min(args.warmup, args.steps // 2)
    return args


def train(model, batches, args, device, backend, seed: int = SEED) -> tuple[list[float], list[float], float]:
    """Trains ``args.steps`` steps; returns per-step losses, per-step milliseconds between stamps on
    the device's stream (``timing.stamp``: CUDA events, no host synchronization), and the wall
    milliseconds per step over the steps after the warm-up (perf_counter, synchronized at both ends)."""
    opt = optimizer(model, args.lr, device)
    sched = schedule(opt, args.steps)
    torch.manual_seed(seed)  # the same dropout stream start for every config
    losses, marks = [], []
    wall_start = time.perf_counter()
    with dispatch_backend(backend):
        for i, (x, y) in enumerate(batches[: args.steps]):
            if i == args.warmup:
                timing.synchronize(device)
                wall_start = time.perf_counter()
            marks.append(timing.stamp(device))
            losses.append(step(model, opt, x, y, device))
            sched.step()
    marks.append(timing.stamp(device))
    timing.synchronize(device)
    wall_ms = (time.perf_counter() - wall_start) * 1e3 / max(1, len(marks) - 1 - args.warmup)
    ms = [timing.elapsed_ms(a, b) for a, b in itertools.pairwise(marks)]
    return torch.stack(losses).float().tolist(), ms, wall_ms


def run_config(name, config, state, batches, args, device) -> dict:
    row = {"config": name, "backend": backend_label(name, args.backend)}
    skip = why_skipped(name, device)
    if skip:
        print(skip)
        return {**row, "status": "skipped", "error": skip}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = compiled = None
    try:
        model, report = e2e_gpt2.build(name, config, state, device, args)
        if report is not None:
            row["patch"] = str(report)
            row["replaced"] = len(report)
        compiled = torch.compile(model) if is_compiled(name) else model
        start = time.perf_counter()
        losses, ms, wall_ms = train(compiled, batches, args, device, backend_of(name, args.backend))
        mid = median(ms[args.warmup :])
        row.update(
            status="ok",
            step_ms=mid,
            wall_step_ms=wall_ms,
            tokens_per_s=args.batch * args.seq / (mid / 1e3),
            first_step_s=ms[0] / 1e3,
            wall_s=time.perf_counter() - start,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            final_loss=final_loss(losses),
            losses=losses,
        )
    except Exception as e:  # noqa: BLE001  (one config failing must not hide the others)
        traceback.print_exc()
        row.update(status="failed", error=f"{type(e).__name__}: {e}"[:600])
    finally:
        del model, compiled
        release(device, is_compiled(name))
    return row


def duel(pair: tuple[str, str], config, state, batches, args, device) -> dict:
    """Both configs of ``pair`` built side by side and stepped in turn, ``args.duel`` timed steps each
    after a warm-up (compiles), each under its own backend: each step of one config sits between two of
    the other, so both see the same GPU clock and host phase. The separate runs train one config after
    another, minutes apart: on the H200 the patched step alone moved between 46.5 and 53.8 ms from call
    to call, and the compile / compile+patched ratio between 0.9996x and 1.0035x, for the same graphs.

    Returns the pair and ``paired``'s summary of the two configs' step times."""
    steps = []
    for name in pair:
        model, _ = e2e_gpt2.build(name, config, state, device, args)
        run = torch.compile(model) if is_compiled(name) else model
        steps.append(stepper(run, optimizer(model, args.lr, device), backend_of(name, args.backend), device))
    warm = 3
    ms = in_turn(steps, itertools.islice(itertools.cycle(batches), warm + args.duel), device, warm=warm)
    del steps
    release(device, any(is_compiled(n) for n in pair))
    return {"pair": list(pair), **paired(ms[0], ms[1])}


def stepper(model, opt, backend, device):
    """One training step of ``model`` on a batch ``(x, y)``, under ``backend``."""

    def run(x, y) -> None:
        with dispatch_backend(backend):
            step(model, opt, x, y, device)

    return run


def loss_parity(config, state, batches, args, device) -> list[list[str]]:
    """Loss parity that no plateau can flip (a run's loss escapes GPT-2's early plateau at a step the
    dropout stream decides, so one seed's last-20-step mean moved by 17%): eager against patched with
    every dropout off, from the same weights on the same batches (the same function, so within
    rounding), and with dropout over ``--parity-seeds`` dropout streams, their means compared. Each
    run is ``--parity-steps`` long. Returns the two targets' rows."""
    import copy as copy_

    quiet = copy_.deepcopy(config)
    quiet.resid_pdrop = quiet.embd_pdrop = quiet.attn_pdrop = 0.0
    short = copy_.copy(args)
    short.steps, short.warmup = args.parity_steps, 0
    finals: dict[tuple[str, int], float] = {}
    for name in ("eager", "patched"):
        for seed, cfg in [(-1, quiet)] + [(s, config) for s in range(args.parity_seeds)]:
            model, _ = e2e_gpt2.build(name, cfg, state, device, args)
            losses, _, _ = train(model, batches, short, device, backend_of(name, args.backend), SEED + 1 + seed)
            finals[(name, seed)] = final_loss(losses)
            del model
            release(device)
    rel = abs(finals[("patched", -1)] / finals[("eager", -1)] - 1)
    rows = [[f"loss parity without dropout ({args.parity_steps} steps, last 20) <= 1%", f"{100 * rel:.2f}%",
             "PASS" if rel <= 0.01 else "MISS"]]  # fmt: skip
    if args.parity_seeds:
        mean = lambda n: sum(finals[(n, s)] for s in range(args.parity_seeds)) / args.parity_seeds  # noqa: E731
        rel = abs(mean("patched") / mean("eager") - 1)
        rows.append([f"loss parity with dropout, mean of {args.parity_seeds} seeds <= 1%", f"{100 * rel:.2f}%",
                     "PASS" if rel <= 0.01 else "MISS"])  # fmt: skip
    return rows


def standard_pairs(ok: set[str]) -> list[tuple[str, str]]:
    """eager against each patched eager-mode config, compile against each compile+... one, that ran."""
    pairs = [("eager", n) for n in CONFIGS if is_patched(n) and not is_compiled(n)]
    pairs += [("compile", n) for n in CONFIGS if is_patched(n) and is_compiled(n)]
    return [p for p in pairs if set(p) <= ok]


def profile(rows, config, state, batches, args, device) -> dict:
    """The MLP blocks' share of the step in each eager-mode config that ran (fresh builds, 3 warm-up
    steps, then ``--profile-steps`` stamped), and the block alone at this shape: layer 0's GPT2MLP
    against the patched model's FusedMLP under each patched config's backend."""
    names = [r["config"] for r in rows if r["status"] == "ok" and not is_compiled(r["config"])]
    shares, blocks = {}, {}
    warm = 3
    for name in names:
        model, _ = e2e_gpt2.build(name, config, state, device, args)
        backend = backend_of(name, args.backend)
        blocks[name] = (copy.deepcopy(e2e_gpt2.mlps(model)[0]), backend)  # layer 0's block, initial weights
        opt = optimizer(model, args.lr, device)
        with dispatch_backend(backend):
            for x, y in batches[:warm]:
                step(model, opt, x, y, device)
        chosen = batches[warm : warm + args.profile_steps]
        shares[name] = e2e_profile.mlp_share(model, opt, e2e_gpt2.mlps(model), chosen, device, backend)
        del model, opt
        release(device)
    alone = e2e_profile.against_eager(blocks, (args.batch, args.seq, config.n_embd), device, args.tiny)
    del blocks
    release(device)
    return {"mlp_share": shares, "block_alone": alone}


def targets(rows, duels, parity) -> list[list[str]]:
    """The report's targets; where the parity runs ran, the main runs' one-seed loss line is information."""
    found = e2e_report.targets(rows, duels, speedup=SPEEDUP, compile_speedup=COMPILE_SPEEDUP)
    if parity:
        found = [[t + " (one seed: see the parity runs)", m, "-"] if "loss parity" in t else [t, m, ok]
                 for t, m, ok in found]  # fmt: skip
    return found + parity


def summary(rows, config, args, entropy, duels, prof, device, parity=()) -> None:
    """The tables and the targets, printed last."""
    cols = ["config", "backend", "status", "tokens_per_s", "x_eager", "x_compile", "step_ms", "wall_step_ms"]
    cols += ["peak_gib", "first_step_s", "final_loss"]
    print(
        f"\nGPT-2 {config.n_layer}x{config.n_embd}, batch {args.batch} x seq {args.seq}, {args.steps} steps, "
        f"bf16 autocast, dropout {args.dropout}; chain entropy {entropy:.3f} nats"
    )
    table = [[r.get(c, "") if r["status"] == "ok" or c in cols[:3] else "" for c in cols] for r in rows]
    print(tabulate(table, headers=cols, floatfmt=".4g"))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['config']} {r['status']}: {r['error'].splitlines()[0]}")
    e2e_report.print_duels(duels, "alternating steps each")
    clock = "GPU" if device.type == "cuda" else "wall"
    what = (f"the MLP blocks in the step ({args.profile_steps} stamped steps) and alone "
            f"({args.batch} x {args.seq} tokens, {clock} ms)")  # fmt: skip
    e2e_profile.print_prediction(prof, rows, duels, what)
    print(tabulate(targets(rows, duels, list(parity)), headers=["target", "measured", ""]))


def main() -> None:
    args = arguments()
    device = common.setup(args)
    import transformers

    config = e2e_gpt2.gpt2_config(args)
    state = e2e_gpt2.initial_state(config)  # kept on CPU, out of the memory peaks
    batches, entropy = chain_batches(args.steps, args.batch, args.seq, device)

    with common.logged(args, "bench_e2e"):
        rows = []
        for name in args.configs:
            print(f"--- {name}", flush=True)
            rows.append(run_config(name, config, state, batches, args, device))
        duels = []
        ok = {r["config"] for r in rows if r["status"] == "ok"}
        for pair in (args.pairs or standard_pairs(ok)) if args.duel else ():
            print(f"--- duel {pair[0]} vs {pair[1]}", flush=True)
            try:
                duels.append(duel(pair, config, state, batches, args, device))
            except Exception:  # noqa: BLE001  (the separate runs still stand)
                traceback.print_exc()
        prof = {"mlp_share": {}, "block_alone": {}}
        if args.profile_steps:
            print("--- profile: the MLP blocks' share of the step, the block alone", flush=True)
            try:
                prof = profile(rows, config, state, batches, args, device)
            except Exception:  # noqa: BLE001  (the runs and duels still stand)
                traceback.print_exc()
        parity = []
        if args.parity_steps and {"eager", "patched"} <= ok:
            print("--- loss parity: without dropout, and over dropout seeds", flush=True)
            parity = loss_parity(config, state, batches, args, device)
        speedups(rows, ("eager", "compile"))  # the baselines: plain PyTorch, torch.compile of the original

        png = common.path(args, "bench_e2e_loss", "png")
        drawn = e2e_report.plot(rows, entropy, png, e2e_gpt2.TITLE)
        model = {
            "layers": config.n_layer, "width": config.n_embd, "heads": config.n_head,
            "vocab": config.vocab_size, "attn_implementation": getattr(config, "_attn_implementation", None),
        }  # fmt: skip
        result = {
            "transformers": transformers.__version__,
            "model": model,
            "chain_entropy_nats": entropy,
            "decisions": e2e_gpt2.decisions(config, args, device),
            "targets": targets(rows, duels, parity),
            "duels": duels,
            "profile": prof,
            "rows": rows,
            "plot": png if drawn else None,
        }
        common.write(args, "bench_e2e", result, device)
        print(f"wrote {png}" if drawn else "no matplotlib: no plot")
        report = next((r["patch"] for r in rows if r.get("patch")), None)
        if report:
            print("\n".join(report.splitlines()[:2]))
        summary(rows, config, args, entropy, duels, prof, device, parity)


if __name__ == "__main__":
    main()
