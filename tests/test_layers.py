"""The house's rules, checked on the source: imports only point down, one top-level name, importing the
library does no work (no thread, process or file), and the lists of ops and backends are the files."""

import ast
import os
import re
import subprocess
import sys
import textwrap

from dispatch import backends, ops, registry
from dispatch.heuristics import ranking

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folder -> the module prefix it installs as: the folder's own path (no package-dir remap)
FOLDERS = {"dispatch": "dispatch"}


def _layer(module: str) -> int:
    """0: contracts (import nothing of ours above them); 1: the op specs; 2: backends and heuristics;
    3: the rest (dispatcher, API, nn, patch, CLIs)."""
    if module == "dispatch.contracts" or module.startswith("dispatch.contracts."):
        return 0
    if module == "dispatch.ops" or module.startswith("dispatch.ops."):
        return 1
    if module.startswith(("dispatch.backends", "dispatch.heuristics")):
        return 2
    return 3


def _unit(module: str) -> str:
    """A backend's folder, or the heuristics package: what may import itself freely."""
    return ".".join(module.split(".")[:3 if module.startswith("dispatch.backends.") else 2])


def _room(module: str) -> str:
    """An op's room in dispatch.ops: its spec file ``<op>.py`` and the files named ``<op>_<part>.py`` it
    splits off (fused_mlp_math.py), which import each other as one module would."""
    name = module.rpartition(".")[2]
    return next((op for op in OP_NAMES if name == op or name.startswith(op + "_")), module)


def _modules() -> dict[str, str]:
    found = {}
    for folder, prefix in FOLDERS.items():
        for here, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(here, name), os.path.join(ROOT, folder))
                    parts = rel[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    found[".".join([prefix, *parts])] = os.path.join(here, name)
    return found


def _imports(path: str, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):  # function-level imports count too: a lazy upward import is still upward
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _ours(name: str, modules: dict[str, str]) -> str | None:
    """The module of ours that ``name`` refers to (a package, module or a name inside one), if any."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def test_imports_only_point_down():
    modules = _modules()
    assert "dispatch.backends.eager" in modules and "dispatch.contracts" in modules
    upward = []
    for module, path in modules.items():
        for line, name in _imports(path, module):
            target = _ours(name, modules)
            if target is None or target == "dispatch":
                continue
            allowed = _layer(target) <= _layer(module)
            # a backend may build on the reference backend (nvfuser and inductor trace eager's functions),
            # never on another backend, the dispatcher or the heuristics
            if _layer(module) == _layer(target) == 2:
                same = _unit(target) == _unit(module)
                allowed = same or target.startswith("dispatch.backends.eager") and module.startswith("dispatch.backends")
            if _layer(module) == _layer(target) == 1:  # a spec imports the registry, never another op's
                allowed = _room(target) == _room(module) or "dispatch.ops" in (target, module)
            if not allowed:
                upward.append(f"{path}:{line} ({module}) imports {target}")
    assert not upward, "\n".join(upward)


def test_one_top_level_name_no_path_remap():
    """Every package lives where it is imported from: one top-level folder, dispatch/, no package-dir
    remap in pyproject (grep and go-to-definition follow the import names)."""
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    assert "package-dir" not in text
    assert not os.path.exists(os.path.join(ROOT, "backends")) and not os.path.exists(os.path.join(ROOT, "heuristics"))
    for name in ("backends", "heuristics"):
        assert os.path.isfile(os.path.join(ROOT, "dispatch", name, "__init__.py"))


def test_import_does_no_work(tmp_path):
    """``import dispatch`` (and its public names) starts no thread or process and writes no file."""
    home = tmp_path / "home"
    home.mkdir()
    code = textwrap.dedent(
        """
        import os, subprocess, sys, threading
        started = []
        real_popen = subprocess.Popen.__init__
        def popen(self, *a, **k):
            started.append(a[0] if a else k.get("args"))
            return real_popen(self, *a, **k)
        subprocess.Popen.__init__ = popen
        real_fork = os.fork
        os.fork = lambda: started.append("fork") or real_fork()
        before = set(threading.enumerate())
        import dispatch
        from dispatch import fused_bias_act_dropout, fused_linear, explain, use_backend, patch, nn
        extra = [t.name for t in threading.enumerate() if t not in before]
        print("threads", extra, "processes", started)
        assert not extra and not started
        assert "triton" not in sys.modules, "importing dispatch imported triton"
        """
    )
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("DISPATCH_HEURISTICS_DIR", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert not written, written


def test_users_own_backends_and_heuristics_do_not_shadow_ours(tmp_path):
    """A user's project with its own ``backends/`` package and ``heuristics.py`` in the working directory."""
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "__init__.py").write_text("raise ImportError('the user backends package')\n")
    (tmp_path / "heuristics.py").write_text("lookup = None  # the user's own module\n")
    code = textwrap.dedent(
        """
        import torch
        from dispatch import fused_bias_act_dropout, fused_linear, explain
        x, b, w = torch.randn(4, 8), torch.randn(8), torch.randn(3, 8)
        torch.testing.assert_close(fused_bias_act_dropout(x, b, "relu", 0.0), torch.relu(x + b))
        torch.testing.assert_close(fused_linear(x, w, None, "relu"), torch.relu(x @ w.T))
        print(explain("fused_linear", x, w, None, "relu").backend.name)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "pytorch"


OP_NAMES = ops.builtin()
# a comparison with an op's name: ``op == "fused_linear"``, ``op in ("bias_act_dropout", ...)``
BRANCH = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](fused_)?(%s)["']""" % "|".join(OP_NAMES))


def test_no_op_name_branches_outside_the_op_specs():
    """What differs between ops lives in their spec (dispatch/ops/<op>.py): no other module of the
    package compares an op's name."""
    found = []
    for module, path in _modules().items():
        if module.startswith("dispatch.ops"):
            continue
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
            if BRANCH.search(line):
                found.append(f"{path}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_core_imports_no_backend():
    """Only the registry imports the backend folders (by name, at first use); the dispatcher, API,
    parity, calibration and CLIs reach kernels through it."""
    modules = _modules()
    found = []
    for module, path in modules.items():
        if _layer(module) != 3 or module == "dispatch.registry":
            continue
        for line, name in _imports(path, module):
            target = _ours(name, modules) or ""
            if target.startswith("dispatch.backends"):
                found.append(f"{path}:{line} imports {target}")
    assert not found, "\n".join(found)


def test_no_file_over_400_lines_but_triton_kernels():
    """~400: a file that grows past it is telling you to split it (an op's one room may run a few over)."""
    long = []
    for module, path in _modules().items():
        lines = sum(1 for _ in open(path, encoding="utf-8"))
        if lines > 410 and not module.startswith("dispatch.backends.triton"):
            long.append(f"{path}: {lines} lines")
    assert not long, "\n".join(long)


def test_the_op_and_backend_lists_are_the_files(tmp_path):
    """No list of ops or backends is kept by hand: an op is a spec file (not a part ``<op>_<part>.py``
    nor a ``_*.py``), a backend a folder with an ``__init__``, its ops its ``<op>.py`` files."""
    (tmp_path / "ops").mkdir()
    for name in ("__init__", "_shared", "toy", "toy_math", "other_op", "other_op_kernels"):
        (tmp_path / "ops" / f"{name}.py").write_text("")
    assert ops.spec_files(str(tmp_path / "ops")) == ("other_op", "toy")
    for folder, package in (("toy_backend", True), ("notes", False)):
        (tmp_path / "backends" / folder).mkdir(parents=True)
        if package:
            (tmp_path / "backends" / folder / "__init__.py").write_text("")
    (tmp_path / "backends" / "helpers.py").write_text("")
    assert backends.folders(str(tmp_path / "backends")) == ["toy_backend"]

    assert ops.builtin() == ops.spec_files(os.path.join(ROOT, "dispatch", "ops"))
    assert ops.names()[: len(ops.builtin())] == ops.builtin()
    import dispatch

    assert {n for s in map(ops.get, ops.builtin()) for n in s.public_names} <= set(dispatch.__all__)
    shipped = [registry.get(name) for name in backends.folders()]
    in_order = [b.name for b in sorted(shipped, key=lambda b: (b.order, b.name))]
    assert [n for n in registry.backends() if n in in_order] == in_order
    # ties and defaults follow this order: pinned here, and the calibrator's tie-break keeps it
    assert in_order == ["pytorch", "eager", "cublaslt", "triton", "composed", "inductor", "nvfuser"]
    assert list(ranking.PREFERENCE) == in_order
    for backend in shipped:
        if isinstance(backend.kernels, ops.KernelFiles):
            folder = os.path.join(ROOT, "dispatch", "backends", backend.name)
            files = {op for op in ops.builtin() if os.path.isfile(os.path.join(folder, f"{op}.py"))}
            assert set(backend.kernels) == files, backend.name
            assert all(backend.kernels[op] is not None for op in files if backend.unavailable() is None)
