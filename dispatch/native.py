"""The public ops' fast path reads its tensors in C++ (``_signature.cpp``), built here on first use.

Each tensor attribute read from Python costs ~0.1 us of host time (a call into libtorch_python), and
the fast path made 13-16 of them per call (benchmarks/NOTES.md, session 12). The C++ module makes the
same reads in one call. It is compiled with the system's C++ compiler against the installed torch's
headers and libraries (as torch's own C++ extensions are; no ninja, no build step at install), once
per source, torch and Python version, into a cache folder, in a background thread: until it is
loaded, and wherever it cannot be built, ``dispatch.api`` makes the same reads in Python, with the
same results. ``DISPATCH_NATIVE=0`` keeps it off; ``status()`` (printed by ``python -m dispatch.info``)
says which is in use and why.

Cache folder: ``$DISPATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/fusedispatch``, else
``~/.cache/fusedispatch``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import torch

ENV_VAR = "DISPATCH_NATIVE"
SOURCE = Path(__file__).with_name("_signature.cpp")
_BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_done = threading.Event()
_module: Optional[ModuleType] = None
_status = "not started"
_thread: Optional[threading.Thread] = None


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("DISPATCH_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusedispatch"


def library_path() -> Path:
    """Where the built module lives: named by a hash of the source, torch's version and ABI, and
    Python's version, so that an upgrade of any builds it anew."""
    tag = hashlib.sha256(SOURCE.read_bytes())
    tag.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{sys.version}".encode())
    return cache_dir() / f"_signature-{tag.hexdigest()[:16]}{sysconfig.get_config_var('EXT_SUFFIX')}"


def _compile(target: Path) -> None:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libraries = cpp_extension.library_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    errors = []
    for standard in ("c++20", "c++17"):  # torch 2.12+ builds its extensions as C++20, older ones C++17
        command = [
            os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", f"-std={standard}", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            str(SOURCE), "-o", str(partial),
            *(f"-I{d}" for d in includes), *(f"-L{d}" for d in libraries),
            *(f"-Wl,-rpath,{d}" for d in libraries), "-ltorch_python", "-ltorch", "-lc10",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode == 0:
            os.replace(partial, target)  # atomic: a process building the same file meanwhile is harmless
            return
        errors.append(f"-std={standard}: {done.stderr.strip()[-600:]}")
    raise RuntimeError("; ".join(errors))


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("dispatch._signature", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_and_load(use: Callable[[ModuleType], None]) -> None:
    global _module, _status
    try:
        target = library_path()
        if not target.exists():
            _status = f"building {target}"
            _compile(target)
        module = _import(target)
        use(module)
        _module, _status = module, f"C++ ({target})"
    except Exception as err:  # no compiler, no headers, a read-only cache: the Python reads stay
        _status = f"Python: the C++ module could not be built or loaded ({type(err).__name__}: {err})"
    finally:
        _done.set()


def start(use: Callable[[ModuleType], None]) -> None:
    """Loads the module, building it first in a background thread if it is not in the cache, then
    hands it to ``use``. Called once by ``dispatch.api`` at import; later calls do nothing."""
    global _thread, _status
    with _lock:
        if _thread is not None or _done.is_set():
            return
        if not enabled():
            _status = f"Python ({ENV_VAR}=0)"
            _done.set()
            return
        if library_path().exists():  # built before: load now, a few milliseconds
            _build_and_load(use)
            return
        _thread = threading.Thread(target=_build_and_load, args=(use,), name="fusedispatch", daemon=True)
        _thread.start()


def wait(timeout: Optional[float] = None) -> Optional[ModuleType]:
    """Blocks until the build (if any) has ended; returns the module, None if the Python reads stay.
    Benchmarks call it so that they time the path a warmed-up program runs."""
    _done.wait(timeout)
    return _module


def status() -> str:
    """Which reads the fast path makes, C++ or Python, and why."""
    return _status
