"""Probe of issue 4: does the compiled backends' CUDA backward reuse the forward's dropout mask?

On the H200 the (since removed) test test_compiled_dropout_masks_gpu failed three times, always in
the first dropout call of a backend in its process (nvfuser float32 once, inductor float32 and
bfloat16 once each): grad_x's zero pattern differed from y's. nvfuser computes the mask outside its
graph with eager torch ops, inductor traces it, so the cause is not the mask code itself.

Each case runs in a fresh process (a worker of this script), with the backends' CUDA refusal lifted,
and replays that test: for M x N in (257, 1000), (1023, 1000), (8, 3, 1000), identity activation, no
bias, p = 0.1, y = op(x) then grad_x = autograd.grad(y, x, grad_y) twice (retain_graph), eager the
same. Factors: backend, dtype, ``warm`` (a small dropout call of the backend first) and ``sync``
(torch.cuda.synchronize() between forward and backward). A failure is described: kept elements with
grad 0, dropped ones with grad != 0, NaNs, rows involved, whether the second backward is right, and
whether grad_x equals eager's where it is not zero.

    PYTHONPATH=. python3 benchmarks/probes/probe_compiled_dropout_first_call.py [--repeats 2] [--jobs 6]
    ... --pytest   the same cases inside pytest processes (as the failing test ran: its per-test seed,
                   pytest's log capture on or off with -p no:logging, one case or all four per process)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SHAPES = ((257, 1000), (1023, 1000), (8, 3, 1000))
P = 0.1
SEED = 20261130


def worker(backend: str, dtype_name: str, warm: bool, sync: bool, device: str, seed: int = SEED) -> list[dict]:
    import torch

    from dispatch import fused_bias_act_dropout
    from dispatch import rng as dropout_rng
    from dispatch.registry import backends

    b = backends()[backend]
    object.__setattr__(b, "extra_reasons", lambda call, explicit: [])  # lift the CUDA refusal
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)

    def gen() -> torch.Generator:
        return torch.Generator(device).manual_seed(SEED + 1)

    def run(name: str, x: torch.Tensor, g: torch.Tensor):
        xs = x.detach().requires_grad_()
        y = fused_bias_act_dropout(xs, None, "identity", P, generator=gen(), backend=name)
        if sync and device == "cuda":
            torch.cuda.synchronize()
        (gx,) = torch.autograd.grad(y, xs, g, retain_graph=True)
        (gx2,) = torch.autograd.grad(y, xs, g)
        return y.detach(), gx, gx2

    if warm:
        run(backend, torch.randn(16, 1000, device=device, dtype=dtype), torch.randn(16, 1000, device=device, dtype=dtype))
    out = []
    for i, shape in enumerate(SHAPES):
        x = torch.randn(shape, device=device, dtype=dtype)
        g = torch.randn(shape, device=device, dtype=dtype)
        y, gx, gx2 = run(backend, x, g)
        ey, egx, _ = run("eager", x, g)
        rng = dropout_rng.draw_for(x, gen())
        keep = dropout_rng.keep_mask(rng, x.numel() // shape[-1], shape[-1], P, x.device).view(shape)
        bwd = gx != 0
        rec = {
            "i": i,
            "shape": shape,
            "fwd_ok": bool(torch.equal(y != 0, keep)),
            "bwd_ok": bool(torch.equal(bwd, keep)),
            "bwd2_ok": bool(torch.equal(gx2 != 0, keep)),
            "y_eq_eager": bool(torch.equal(y, ey)),
            "gx_eq_eager": bool(torch.equal(gx, egx)),
            "eager_bwd_ok": bool(torch.equal(egx != 0, keep)),
            "x_zeros": int((x == 0).sum()),
            "grad_y_zeros": int((g == 0).sum()),
        }
        if not rec["bwd_ok"]:
            bad = bwd != keep
            rows = bad.reshape(-1, shape[-1]).any(1).nonzero().flatten()
            nz = bwd & keep
            rec.update(
                kept_zero=int((keep & ~bwd).sum()),
                dropped_nonzero=int((~keep & bwd).sum()),
                nan=int(gx.isnan().sum()),
                bad_rows=int(rows.numel()),
                first_bad_row=int(rows[0]) if rows.numel() else -1,
                last_bad_row=int(rows[-1]) if rows.numel() else -1,
                nonzero_match_eager=bool(torch.equal(gx[nz], egx[nz])),
                gx_all_zero=bool((gx == 0).all()),
            )
        out.append(rec)
    return out


PYTEST_FILE = """
import json, os, sys, zlib
import pytest, torch
sys.path.insert(0, {probes!r})
from probe_compiled_dropout_first_call import worker

@pytest.mark.parametrize("backend", ("nvfuser", "inductor"))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_masks(backend, dtype):
    i = ("float32", "bfloat16").index(dtype)
    nodeid = f"tests/test_compiled_backends.py::test_compiled_dropout_masks_gpu[dtype{{i}}-{{backend}}]"
    recs = worker(backend, dtype, False, False, "cuda" if torch.cuda.is_available() else "cpu", zlib.crc32(nodeid.encode()))
    print("RESULT", json.dumps(recs))
    bad = [r for r in recs if not (r["fwd_ok"] and r["bwd_ok"] and r["bwd2_ok"] and r["gx_eq_eager"])]
    assert not bad, bad
"""


def run_pytest(args) -> None:
    """The cases as pytest tests: one case per process or all four in one, log capture on or off."""
    import tempfile

    from tabulate import tabulate

    folder = tempfile.mkdtemp(prefix="probe-dropout-")
    path = os.path.join(folder, "test_probe_masks.py")
    with open(path, "w") as f:
        f.write(PYTEST_FILE.format(probes=os.path.dirname(os.path.abspath(__file__))))
    runs = []
    for rep in range(args.repeats):
        for logging_on in (True, False):
            runs.append((rep, logging_on, None))  # all four cases, in file order
            for backend in args.backends.split(","):
                for dtype in ("float32", "bfloat16"):
                    runs.append((rep, logging_on, f"{backend} and {dtype}"))

    def launch(run):
        rep, logging_on, k = run
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", path]
        cmd += [] if logging_on else ["-p", "no:logging"]
        cmd += ["-k", k] if k else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder, env={**os.environ, "PYTHONPATH": os.getcwd()})
        tail = [ln for ln in proc.stdout.splitlines() if "passed" in ln or "failed" in ln][-1:]
        fails = [ln[:400] for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
        return run, proc.returncode, (tail[0] if tail else proc.stdout[-300:]), fails

    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for (rep, logging_on, k), rc, tail, fails in pool.map(launch, runs):
            rows.append([rep, "on" if logging_on else "off", k or "all four", rc, tail, " | ".join(fails)])
    print(tabulate(rows, headers=["rep", "log capture", "cases", "rc", "summary", "failures"]))
    print(f"{sum(r[3] != 0 for r in rows)} of {len(rows)} pytest processes failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=4, metavar=("BACKEND", "DTYPE", "WARM", "SYNC"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=SEED, help="worker: torch.manual_seed for the data")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--backends", default="nvfuser,inductor")
    ap.add_argument("--pytest", action="store_true", help="run the cases inside pytest processes")
    args = ap.parse_args()
    if args.pytest:
        run_pytest(args)
        return
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.worker:
        backend, dtype, warm, sync = args.worker
        print(json.dumps(worker(backend, dtype, warm == "1", sync == "1", device, args.seed)))
        return

    cases = list(
        itertools.product(args.backends.split(","), ("float32", "bfloat16"), ("0", "1"), ("0", "1"), range(args.repeats))
    )

    def launch(case):
        backend, dtype, warm, sync, rep = case
        cmd = [sys.executable, os.path.abspath(__file__), "--device", device, "--worker", backend, dtype, warm, sync]
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "."})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
        recs = json.loads(lines[-1]) if lines else None
        return case, recs, proc.stderr[-600:] if recs is None else "", time.time() - start

    from tabulate import tabulate

    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for case, recs, err, secs in pool.map(launch, cases):
            backend, dtype, warm, sync, rep = case
            if recs is None:
                rows.append([backend, dtype, warm, sync, rep, "CRASH", err.strip().splitlines()[-1:] , f"{secs:.0f}"])
                continue
            fails = [r for r in recs if not (r["fwd_ok"] and r["bwd_ok"] and r["bwd2_ok"] and r["gx_eq_eager"])]
            verdict = "ok" if not fails else "FAIL"
            detail = "; ".join(json.dumps({k: v for k, v in r.items() if k != "shape"}) for r in fails)
            rows.append([backend, dtype, warm, sync, rep, verdict, detail, f"{secs:.0f}"])
    print(tabulate(rows, headers=["backend", "dtype", "warm", "sync", "rep", "result", "failures", "s"]))
    n_fail = sum(r[5] != "ok" for r in rows)
    print(f"{n_fail} of {len(rows)} processes failed")


if __name__ == "__main__":
    main()
