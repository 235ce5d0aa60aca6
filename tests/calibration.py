"""The calibrator's tests' helpers: the command line of a small synthetic-clock run, an entry's
segments, a bias_act_dropout call on this CPU. (The fixtures user_dir and clocks are conftest.py's.)"""

import torch

from dispatch import ops

CPU = torch.device("cpu")


def args(out, *extra, ops=("bias_act_dropout",), modes=("inference",), acts=("gelu",), features=("32",),
         tokens=("1", "16", "1024"), backends=("flat",)):  # fmt: skip
    return ["--quick", "--dtypes", "float32", "--ops", *ops, "--modes", *modes, "--activations", *acts,
            "--features", *features, "--tokens", *tokens, "--backends", "eager", *backends, "--out", str(out),
            *extra]  # fmt: skip


def segments(e):
    return [(s["m_from"], s["backend"]) for s in e["segments"]]


def bad_call(m, n=32, activation="gelu", training=False, dropout=False, dtype=torch.float32):
    spec = ops.get("bias_act_dropout")
    return spec.call(CPU, dtype, (m, n), training, activation=activation, dropout=dropout)
