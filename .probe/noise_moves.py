import copy, statistics
from dispatch.calibrate import plan, refit
from dispatch import heuristics
a0 = heuristics.load_table("benchmarks/results/calibrate_points-nvidia-h200.json").data
a = refit.refit(copy.deepcopy(a0))  # pooled host costs in place
changes = []
npts = 0
for e in a["entries"]:
    order = plan.preference(e["mode"])
    for p in e["points"]:
        c = plan.costs(p)
        if not c: continue
        npts += 1
        plan.NOISE = 0.03; w3 = plan.rank(c, order)[0]; g3 = plan.gpu_winner(p, order)
        plan.NOISE = 0.05; w5 = plan.rank(c, order)[0]; g5 = plan.gpu_winner(p, order)
        if w3 != w5:
            changes.append((c[w5] / c[w3], w3, w5, e["op"], e["mode"], e["activation"], e["dtype"], p["m"], e["features"], "cost"))
        if g3 != g5:
            changes.append((p["gpu_us"][g5] / p["gpu_us"][g3], g3, g5, e["op"], e["mode"], e["activation"], e["dtype"], p["m"], e["features"], "gpu"))
plan.NOISE = 0.03
print("points", npts, "changes", len(changes))
from collections import Counter
print(Counter((c[1], c[2], c[-1]) for c in changes))
r = [c[0] for c in changes]
print("ratio new/old: median", statistics.median(r), "max", max(r))
