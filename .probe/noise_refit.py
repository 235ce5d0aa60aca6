import copy, json, sys
from dispatch.calibrate import plan, refit, report
from dispatch import heuristics
a0 = heuristics.load_table("benchmarks/results/calibrate_points-nvidia-h200.json").data
b0 = heuristics.load_table("benchmarks/results/calibrate_points_run2-nvidia-h200.json").data
for noise in (0.03, 0.04, 0.05, 0.07):
    plan.NOISE = noise
    a = refit.refit(copy.deepcopy(a0)); b = refit.refit(copy.deepcopy(b0))
    share, cells = report.agreement(a, b)
    sa, sb = a["self_check"], b["self_check"]
    print(f"NOISE {noise}: agree {share:.1%} of {cells}; self-check A {sa['within_5pct']:.0%} worst {sa['worst_regret']:+.1%} gpu {sa['by_gpu_time']['within_5pct']:.0%} {sa['by_gpu_time']['worst_regret']:+.1%}; B {sb['within_5pct']:.0%} {sb['worst_regret']:+.1%} gpu {sb['by_gpu_time']['within_5pct']:.0%}", flush=True)
