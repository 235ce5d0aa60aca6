"""The table-schema tests' material: a valid schema 2 heuristics table with every field the schema
knows (its CPU variant this machine's), mutations of it, and the public ops run through the user
directory as a model meets the table."""

import copy

import torch

from dispatch import heuristics
from dispatch import explain, fused_bias_act_dropout, fused_linear, select

CPU = torch.device("cpu")
CPU_SLUG = heuristics.device_info(CPU)["slug"]


def point(m, **us):
    gpu = us or {"eager": 1.0, "triton": 0.5, "pytorch": 1.2}
    return {"m": m, "gpu_us": gpu, "host_us": {n: 2 * t for n, t in gpu.items()}, "err": {"triton": 1e-6},
            "rejected": {}, "gpu_clock": {"eager": "do_bench (capture failed: ...)"}, "drained": []}  # fmt: skip


def valid_document(device_type="cpu"):
    """A schema 2 table with every field the schema knows, as the calibrator writes it; its CPU variant
    is this machine's, so lookups use it."""
    segments = [
        {
            "m_from": 1,
            "backend": "eager",
            "runner_up": "triton",
            "margin": 0.1,
            "speedup": 1.0,
            "m": 32,
            "clock": "host",
            "gpu_backend": "triton",
            "gpu_us": {"eager": 1.0, "triton": 0.5},
            "host_us": {"eager": 2.0, "triton": 3.0},
            "pytorch_us": {"gpu": 1.2, "host": 2.0},
            "errors": {},
        },
        {
            "m_from": 48,
            "backend": "eager",
            "runner_up": None,
            "margin": None,
            "speedup": None,
            "errors": {"eager": 0.0},
        },
    ]
    common = {
        "dtype": "float32",
        "activation": "gelu",
        "mode": "training",
        "measured_as": "gelu",
        "parity_checked": True,
    }
    entries = [
        {
            **common,
            "op": "bias_act_dropout",
            "dropout": True,
            "features": [64],
            "segments": segments,
            "points": [point(1), point(32), point(64, eager=1.0)],
            "held_out": [point(8)],
            "max_m": 64,
        },
        {
            **common,
            "op": "fused_linear",
            "dropout": False,
            "features": [32, 16],
            "measured_dtype": "bfloat16",
            "segments": segments[:1],
            "points": [point(4)],
            "held_out": [],
        },
    ]
    cuda = device_type == "cuda"
    return {
        "schema_version": 2,
        "device": {
            "type": device_type,
            "name": "NVIDIA H200" if cuda else "test cpu",
            "slug": "nvidia-h200" if cuda else CPU_SLUG,
            "capability": [9, 0] if cuda else None,
            "sm_count": 132 if cuda else None,
            "peak_bandwidth_gbs": 4800.0 if cuda else None,
            "measured_bandwidth_gbs": None,
        },
        "versions": {**heuristics.running_versions(), "python": "3.12"},
        "date": "2026-01-01",
        "settings": {
            "quick": True,
            "noise": 0.03,
            "preference": ["eager", "triton"],
            "budget_s": 60.0,
            "elapsed_s": 10.0,
            "stopped_by_budget": False,
            "runs": [
                {"run": "quick", "date": "2026-01-01", "elapsed_s": 9.0, "parts": 1},
                {
                    "run": "refresh",
                    "date": "2026-01-02",
                    "elapsed_s": 1.0,
                    "families": ["fused_linear float32 training"],
                },
            ],
        },
        "backends": {"eager": "eager", "triton": "triton"},
        "entries": entries,
        "held_out_sizes": [
            {**common, "op": "bias_act_dropout", "dropout": True, "features": [96], "point": point(16)}
        ],
        "self_check": {
            "points": 2,
            "within_5pct": 1.0,
            "worst_regret": 0.0,
            "worst_vs_pytorch": None,
            "confirmed_points": 0,
        },
        "raw_points": {"file": "benchmarks/results/x.json", "moved": []},
    }


def run_public_ops():
    """The ops and explain() on this CPU, as a model would call them; the explain() rules."""
    heuristics.reload()
    select.clear_cache()
    x, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    y = fused_bias_act_dropout(x, b, "gelu", 0.1)
    y.sum().backward()
    assert y.shape == (64, 64) and x.grad is not None
    xl, w, bl = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32)
    torch.testing.assert_close(fused_linear(xl, w, bl, "relu"), torch.relu(xl @ w.T + bl))
    return [
        explain("fused_bias_act_dropout", x, b, "gelu", 0.1).rule,
        explain("fused_linear", xl.requires_grad_(), w, bl, "gelu").rule,
        heuristics.describe(CPU),
    ]


def heuristics_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, heuristics.HeuristicsWarning)]


def set_at(path, value):
    """A mutation of valid_document(): the field at ``path`` (keys and indices) set to ``value``,
    or removed when ``value`` is DELETE."""

    def mutate(doc):
        *parents, last = path
        node = doc
        for k in parents:
            node = node[k]
        if value is DELETE:
            del node[last]
        else:
            node[last] = copy.deepcopy(value)
        return doc

    return mutate


DELETE = object()
