"""Probe (not shipped): A/A spread of the slow-call GPU clock (events around back-to-back runs), H200."""
import statistics, time
import torch
from tabulate import tabulate
from dispatch.calibrate import measure
from dispatch import timing

dev = torch.device("cuda")
rows = []
for training, m in ((True, 12288), (False, 12288), (True, 2048)):
    case = measure.Case("fused_linear", torch.bfloat16, "identity", training, False, m, (5120, 20480), dev)
    inp = measure.make_inputs(case, case.seed)
    clock = measure.Clock(dev, 3, False)
    with torch.set_grad_enabled(training):
        timers = {n: measure.timer(n, case, inp) for n in ("eager", "pytorch", "triton")}
        for t in timers.values():
            clock.first(t)
        for runs in (2, 8):
            samples = {n: [] for n in timers}
            for r, name in timing.rotations(list(timers), 7):
                t = timers[name]
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(runs):
                    measure._reset(t)
                    t.fn()
                end.record(); end.synchronize()
                samples[name].append(start.elapsed_time(end) / (runs * t.calls))
            med = {n: statistics.median(v) for n, v in samples.items()}
            med3 = {n: statistics.median(v[:3]) for n, v in samples.items()}
            spread = {n: (max(v) - min(v)) / statistics.median(v) for n, v in samples.items()}
            rows.append([("training" if training else "inference"), m, runs,
                         round(med["eager"], 3), round(med["pytorch"], 3), round(med["eager"] / med["pytorch"], 4),
                         round(med3["eager"] / med3["pytorch"], 4), round(med["triton"] / med["pytorch"], 4),
                         f"{max(spread.values()):.1%}"])
            print(rows[-1], flush=True)
print(tabulate(rows, headers=["mode", "M", "runs/sample", "eager ms", "pytorch ms", "eager/pt (7 rounds)",
                              "eager/pt (3)", "triton/pt", "max spread"]))
