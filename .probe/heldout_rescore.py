import copy, json, sys, importlib
import torch
sys.path.insert(0, "benchmarks")
bh = importlib.import_module("bench_heldout")
from dispatch import heuristics, select
from dispatch.cases import Case
from dispatch.calibrate import plan, refit
raw = heuristics.load_table("benchmarks/results/calibrate_points-nvidia-h200.json").data
rows = json.load(open("/work/.device/7/x/heldout.json"))["rows"]
dev = torch.device("cpu")
for noise in [float(v) for v in sys.argv[1:]]:
    plan.NOISE = noise
    doc = refit.refit(copy.deepcopy(raw))
    table = heuristics.Table(doc, "<refit>")
    new = []
    for r in rows:
        case = Case(r["op"], torch.bfloat16, r["activation"], r["mode"] == "training",
                    r["op"] == "bias_act_dropout" and r["mode"] == "training", r["m"], tuple(r["features"]), dev)
        choice = table.choose(case.call())
        pick = choice.backend if choice else "eager"
        found = select.capture_pick(choice, {})[0] if choice else None
        captured = found.name if found is not None else None
        new.append({**r, "pick": pick, "captured_pick": captured, "score": bh.score(r["us"], pick, captured)})
    changed = sum((a["pick"], a["captured_pick"]) != (b["pick"], b["captured_pick"]) for a, b in zip(rows, new))
    lines, ok = bh.summary(new)
    print(f"NOISE {noise}: picks changed at {changed} of {len(rows)}")
    for l in lines: print("  ", l)
    for d in bh.diagnostics(new): print("  ", d)
