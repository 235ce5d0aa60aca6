"""Tile-config sweep for the TMA (persistent) Triton matmul of fused_linear, on the H200.

Issue 6's forward targets (bf16, M >= 2048: >= 0.97x torch.mm, >= cuBLASLt's epilogue) were missed by
3-10% in session 1, where the TMA kernel ran the config table's 128x256x64 / 8 warps / 3 stages. Count:
llama-2-7b up at M = 8192 is 739 GFLOP, 1.04 ms at torch.mm's 709 TFLOP/s; the epilogue writes y and
the pre-activation (2 x 8192 x 11008 x 2 bytes = 361 MB, ~0.09 ms at the copy rate) and overlaps the
next tile's main loop only partly. Candidates: a deeper pipeline, the transposed tile (256x128), wider
K steps, other group sizes, and one warpgroup. Each config's forward (bias + gelu_tanh, without and
with the pre-activation write) and a plain product (the backward's) are checked against the shipped
config's output within the bf16 tolerance, then timed with do_bench next to torch.mm, F.linear +
gelu_tanh and the cuBLASLt epilogue. The first configs also run with the epilogue storing through
tensor descriptors (variant "tma_store"): registers -> shared memory -> one TMA bulk store a tile,
instead of masked pointer stores; Triton's persistent-matmul tutorial stores this way on Hopper.

    PYTHONPATH=. python3 benchmarks/probes/sweep_fused_linear.py [--quick]
    PYTHONPATH=. python3 benchmarks/probes/sweep_fused_linear.py --set epilogue --acts gelu_tanh,gelu,relu
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from backends.triton import fused_linear as triton_op  # noqa: E402
from backends.triton import matmul  # noqa: E402
from dispatch.activations import ACTIVATIONS  # noqa: E402
from dispatch.registry import backends  # noqa: E402
from dispatch.tolerances import check  # noqa: E402

C = matmul.Config
CANDIDATES = (
    C(128, 256, 64, num_warps=8, num_stages=3),  # the table's first entry (shipped)
    C(128, 256, 64, num_warps=8, num_stages=4),
    C(256, 128, 64, num_warps=8, num_stages=3),
    C(256, 128, 64, num_warps=8, num_stages=4),
    C(128, 256, 64, num_warps=8, num_stages=3, group_m=16),
    C(128, 256, 64, num_warps=8, num_stages=3, group_m=4),
    C(128, 128, 64, num_warps=8, num_stages=4),
    C(128, 128, 64, num_warps=4, num_stages=5),
    C(128, 128, 128, num_warps=8, num_stages=3),
    C(64, 256, 64, num_warps=4, num_stages=4),
)
# the epilogue through TMA stores ("tma_store", session 7, interpreter-tested only) with these
# candidates: its staging tile takes BLOCK_M x BLOCK_N x 2 bytes more shared memory, which puts the
# 4-stage 128x256 and 256x128 configs over the H200's 227 KiB (benchmarks/probes/aot_matmul.py)
STORE_CONFIGS = (0, 2, 6)
# --set epilogue (session 10): what hides the activation's math behind the tensor cores. The forward's
# epilogue runs after the tile's main loop on the same warps, so gelu_tanh costs ~9% of torch.mm's time at
# llama-2-7b.up (relu ~1-4%). Candidates: the epilogue on half tiles (fewer live registers: the 128x256
# forward epilogue sits at 255 registers), two resident programs per SM (one's epilogue under the other's
# main loop: the warp scheduler's ping-pong; 96 KiB of shared memory each), and tl.range's warp
# specialization (a producer warp for the TMA loads; triton 3.6 on sm_90 may refuse it).
EPILOGUE_CANDIDATES = (
    C(128, 256, 64, num_warps=8, num_stages=3),  # shipped
    C(128, 256, 64, num_warps=8, num_stages=3, epilogue_split=2),
    C(128, 256, 64, num_warps=8, num_stages=4, epilogue_split=2),
    C(128, 128, 64, num_warps=4, num_stages=3, ctas_per_sm=2),
    C(128, 128, 64, num_warps=8, num_stages=3, ctas_per_sm=2),
    C(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True),
    C(128, 128, 64, num_warps=8, num_stages=4, warp_specialize=True),
)
EPILOGUE_STORE_CONFIGS = (0, 1)  # tma_store: the tutorial's subtiled TMA-store epilogue is index 1
EPILOGUE_SHAPES = (
    ("llama-2-7b.up", 8192, 11008, 4096),
    ("mistral-7b.down", 8192, 4096, 14336),
    ("llama-2-70b.up", 8192, 28672, 8192),
)
DEVICE = "cuda"
SHAPES = (  # (label, M, N, K): N = out_features, K = in_features
    ("llama-2-7b.up", 8192, 11008, 4096),
    ("mistral-7b.down", 8192, 4096, 14336),
    ("gpt2.up", 8192, 3072, 768),
    ("llama-2-70b.down", 16384, 8192, 28672),
)


def ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes, four configs")
    p.add_argument("--out", default="", help="a folder for sweep_fused_linear.json")
    p.add_argument("--set", choices=("tiles", "epilogue"), default="tiles", help="candidate list")
    p.add_argument("--acts", default="gelu_tanh", help="activations (comma list): forward timed for each")
    args = p.parse_args()
    acts = args.acts.split(",")
    act = acts[0]  # the one whose pre-activation write and grad_x are timed too
    epilogue_set = args.set == "epilogue"
    all_candidates = EPILOGUE_CANDIDATES if epilogue_set else CANDIDATES
    store_configs = EPILOGUE_STORE_CONFIGS if epilogue_set else STORE_CONFIGS
    rows, records = [], []
    cublaslt = backends().get("cublaslt")
    for label, M, N, K in (EPILOGUE_SHAPES if epilogue_set else SHAPES)[: 2 if args.quick else None]:
        g = torch.Generator(device=DEVICE).manual_seed(M + N + K)
        x = torch.randn(M, K, device=DEVICE, generator=g).to(torch.bfloat16)
        w = (torch.randn(N, K, device=DEVICE, generator=g) / K**0.5).to(torch.bfloat16)
        b = torch.randn(N, device=DEVICE, generator=g).to(torch.bfloat16)
        gy = torch.randn(M, N, device=DEVICE, generator=g).to(torch.bfloat16)
        tflop = 2 * M * N * K / 1e12
        base = {"torch.mm": ms(lambda: torch.mm(x, w.t()))}
        for a in acts:
            base[f"F.linear+{a}"] = ms(lambda: ACTIVATIONS[a].forward(F.linear(x, w, b)))
            if cublaslt is not None and not cublaslt.not_supported_reasons(_call(x, w, a), explicit=True):
                op = cublaslt.ops["fused_linear"]
                base[f"cublaslt {a}"] = ms(lambda: op.forward(x, w, b, a))
        refs = {}
        with matmul.options(variant="tma", config=all_candidates[0]):
            for a in acts:
                refs[a] = triton_op.forward(x, w, b, a)
            ref_gx = triton_op.launch_mm(gy, w)
        candidates = all_candidates[: 4 if args.quick else None]
        runs = [("tma", cfg) for cfg in candidates]
        runs += [("tma_store", candidates[i]) for i in store_configs if i < len(candidates)]
        for variant, cfg in runs:
            for a in acts:
                rec = {"shape": label, "M": M, "N": N, "K": K, "variant": variant, "config": str(cfg)}
                rec.update(group_m=cfg.group_m, act=a)
                try:
                    with matmul.options(variant=variant, config=cfg):
                        y, pre = triton_op.forward(x, w, b, a)
                        check(f"y {cfg} {a}", y, refs[a][0])
                        check(f"pre {cfg} {a}", pre, refs[a][1])
                        rec["fwd_ms"] = ms(lambda: triton_op.infer(x, w, b, a))  # no pre-activation write
                        if a == act:
                            check(f"grad_x {cfg}", triton_op.launch_mm(gy, w), ref_gx)
                            rec["fwd_save_ms"] = ms(lambda: triton_op.forward(x, w, b, a))
                            rec["grad_x_ms"] = ms(lambda: triton_op.launch_mm(gy, w))
                except Exception as exc:  # a config the compiler rejects (shared memory) or a wrong one
                    rec["error"] = repr(exc)[:160]
                records.append(rec)
                fwd = rec.get("fwd_ms")
                lt = base.get(f"cublaslt {a}", float("nan"))
                rows.append(
                    [label, variant, f"{cfg} g{cfg.group_m}", a, fwd, fwd and tflop / fwd * 1e3,
                     fwd and base["torch.mm"] / fwd, fwd and lt / fwd,
                     rec.get("fwd_save_ms"), rec.get("grad_x_ms"), rec.get("error", "")]
                )  # fmt: skip
        records.append({"shape": label, "M": M, "N": N, "K": K, "baselines_ms": base})
        print(f"{label} M={M}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in base.items()), flush=True)
    headers = ["shape", "variant", "config", "act", "fwd ms", "TFLOP/s", "x mm", "x cublaslt", "fwd+pre ms"]
    headers += ["grad_x ms", "error"]
    print(tabulate(rows, headers=headers, floatfmt=".3f"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "sweep_fused_linear_epilogue.json" if epilogue_set else "sweep_fused_linear.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "records": records}, f, indent=1)


def _call(x, w, act):
    from dispatch.registry import Call

    return Call("fused_linear", x.device, x.dtype, (x.shape[0], w.shape[0], w.shape[1]), act, False, False)


if __name__ == "__main__":
    main()
