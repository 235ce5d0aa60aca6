"""add_norm is one spec file and a kernel file per backend: everything else finds it. The op, its public
functions and the backends serving it come from the files on disk (the registry, ``dispatch.__all__``,
the command lines, parity and the info report read them), and no other file of the package names it:
the diff that added it touched only its spec, its kernel files, its tests, nn/patch, tables and docs.
"""

from __future__ import annotations

import fnmatch
import os
import re

import torch

import dispatch
from dispatch import backends, info, ops, parity, registry
from dispatch.calibrate import __main__ as calibrate_cli
from dispatch.ops import add_norm as spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the op may be named: its room, its kernel files, the modules and patch over it, the tables the
# calibrator writes, and what is not the package (tests, benchmarks, docs).
OWN = (
    "dispatch/ops/add_norm.py", "dispatch/ops/add_norm_*.py", "dispatch/backends/*/add_norm.py",
    "dispatch/backends/*/add_norm_*.py", "dispatch/nn/*", "dispatch/patch.py", "dispatch/patch_*.py",
    "dispatch/heuristics/tables/*.json", "tests/*", "benchmarks/*", "docs/*", "README.md",
)  # fmt: skip
NAMED = re.compile(r"\badd_norm\b|fused_add_rms_norm|fused_add_layer_norm")
TEXT = (".py", ".md", ".toml", ".json", ".txt", ".cfg", ".ini", ".sh", ".yaml", ".yml")


def test_no_file_but_its_own_names_the_op():
    found = []
    for here, folders, files in os.walk(ROOT):
        folders[:] = [f for f in folders if not f.startswith(".") and f not in ("__pycache__", "build")
                      and not f.endswith(".egg-info")]  # the tree, not what an install writes into it
        for name in files:
            path = os.path.relpath(os.path.join(here, name), ROOT).replace(os.sep, "/")
            if not name.endswith(TEXT) or any(fnmatch.fnmatch(path, pattern) for pattern in OWN):
                continue
            with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
                found += [f"{path}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if NAMED.search(line)]
    assert not found, "files outside the op's own name it (they should derive it):\n" + "\n".join(found)


def test_the_op_and_its_backends_are_derived_from_the_files():
    assert "add_norm" in ops.builtin() == ops.spec_files(os.path.join(ROOT, "dispatch", "ops"))
    assert ops.get("add_norm") is spec.SPEC
    assert spec.SPEC.public_names == ("fused_add_rms_norm", "fused_add_layer_norm")
    for name in spec.SPEC.public_names:
        assert name in dispatch.__all__ and getattr(dispatch, name) is getattr(spec, name)
    folder = os.path.join(ROOT, "dispatch", "backends")
    with_files = {b for b in backends.folders() if os.path.isfile(os.path.join(folder, b, "add_norm.py"))}
    assert with_files == {"triton", "inductor"}
    serving = {n for n, b in registry.backends().items() if b.implements("add_norm")}
    assert serving == with_files | {"pytorch", "eager"}  # the two serve every op from its spec
    assert registry.get("eager").kernels_for("add_norm") is spec.SPEC.reference_kernels()
    assert registry.get("pytorch").kernels_for("add_norm") is spec.SPEC.baseline_kernels()


def test_the_command_lines_parity_and_info_list_it():
    assert "add_norm" in calibrate_cli.parse_args([]).ops
    assert {c[0] for c in parity.grid(torch.device("cpu"), quick=True)} == set(ops.names())
    rows = {line.split()[0]: line for line in info.report(torch.device("cpu")).splitlines() if line.strip()}
    assert "add_norm" in rows["eager"] and "add_norm" in rows["inductor"]
    assert "add_norm" not in rows["nvfuser"]
