"""What each bench_mlp row's line leaves for the pointwise work, against the bytes that work must move.

    python benchmarks/mlp_lines.py benchmarks/results/bench_mlp-2026-12-06-h100.json [more.json ...]
                                   [--tbs 3.35] [--compile-ratio 0.97] [--floor-ratio 1.10]

A row's line is min(compile-ratio x torch.compile's GPU time, floor-ratio x the six GEMMs' time alone;
1.03 for LLaMA-2-7B); the budget is the line minus the floor: the time every byte the products do not
move must fit in. F = M x inner x 2 bytes (bf16). The passes' bytes, at the card's peak rate:
  unfused       a plain activation 5F (forward: pre read, a written; backward: grad_a and pre read,
                grad_pre written), a gate 8F (forward: gate and up read, h written; backward: grad_h,
                gate and up read, their grads written)
  fwd epilogue  the forward inside the first product's epilogue: 4F / 6F (the aux or h written beside
                its output, the backward unfused)
  both          the backward in the dgrad's epilogue too: 2F / 4F (pre, or gate and up, read there)
The fused columns are upper bounds: a GEMM whose epilogue overlaps the next tile's main loop hides part
of them. A negative budget means no design meets the line with products at the floor's speed.
Rows also show mlp/dispatch's time and its ratios to compile and to the floor.
"""

from __future__ import annotations

import argparse
import json
import sys

from tabulate import tabulate

from dispatch.contracts.activations import GATES

PEAK_TBS = {"H100": 3.35, "H200": 4.1}  # the cards' HBM3 / HBM3e peak the project's ceilings use
FLOOR_RATIO_OF = {"llama-2-7b": 1.03}  # its products are 98% of its block (9.74 of 9.99 ms, H200)
BYTES_F = {False: (5, 4, 2), True: (8, 6, 4)}  # (unfused, fwd epilogue, both) in units of F, by gated


def peak_tbs(gpu: str, override: float | None = None) -> float:
    """The card's peak rate in TB/s: ``override``, else by name (H100 / H200)."""
    if override:
        return override
    for name, tbs in PEAK_TBS.items():
        if name in gpu:
            return tbs
    raise ValueError(f"gpu {gpu!r}: no peak rate known for it ({', '.join(PEAK_TBS)}); pass --tbs")


def line_row(row: dict, tbs: float, compile_ratio: float = 0.97, floor_ratio: float = 1.10) -> dict:
    """One bench_mlp row's line, budget and pass times (us) at ``tbs`` TB/s."""
    compiled, floor = row["gpu_us:compile"], row["gpu_us:torch.mm"]
    line = min(compile_ratio * compiled, FLOOR_RATIO_OF.get(row["block"], floor_ratio) * floor)
    f_bytes = row["M"] * row["F"] * 2
    unfused, fwd, both = (k * f_bytes / (tbs * 1e6) for k in BYTES_F[row["act"] in GATES])
    dispatched = row.get("gpu_us:mlp/dispatch")
    return {
        "block": row["block"], "compile": compiled, "floor": floor, "line": line, "budget": line - floor,
        "unfused": unfused, "fwd epilogue": fwd, "both": both, "dispatch": dispatched,
        "dispatch / compile": dispatched / compiled if dispatched else None,
        "dispatch / floor": dispatched / floor if dispatched else None,
    }  # fmt: skip


def verdict(r: dict) -> str:
    """The cheapest design whose pass bytes fit the budget (fused columns as upper bounds)."""
    if r["budget"] <= 0:
        return "under the floor: needs products faster than cuBLAS"
    for name in ("unfused", "fwd epilogue", "both"):
        if r[name] <= r["budget"]:
            return f"fits {name}"
    return "only with epilogues hidden behind the products"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="bench_mlp results files (.json)")
    ap.add_argument("--tbs", type=float, default=None, help="peak TB/s (default by the file's GPU)")
    ap.add_argument("--compile-ratio", type=float, default=0.97)
    ap.add_argument("--floor-ratio", type=float, default=1.10)
    args = ap.parse_args(argv)
    table = []
    for path in args.results:
        with open(path) as f:
            result = json.load(f)
        gpu, date = result["environment"]["gpu"], result["environment"]["date"]
        tbs = peak_tbs(gpu, args.tbs)
        for row in result["rows"]:
            if "gpu_us:compile" not in row or "gpu_us:torch.mm" not in row:
                continue
            r = line_row(row, tbs, args.compile_ratio, args.floor_ratio)
            table.append([gpu, date, *r.values(), verdict(r)])
    heads = ["gpu", "date", "block", "compile", "floor", "line", "budget", "passes unfused", "fwd epilogue",
             "fwd and bwd epilogues", "mlp/dispatch", "dispatch / compile", "dispatch / floor", "verdict"]
    print(tabulate(table, headers=heads, floatfmt=".3g", tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
