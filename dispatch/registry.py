"""The registered backends: each folder of ``dispatch/backends`` declares a ``BACKEND``
(``dispatch.contracts.backend.Backend``), collected here on first use, never at import, in the order
the backends declare (``Backend.order``).
"""

from __future__ import annotations

import importlib
import threading

from dispatch.contracts.backend import Backend, Call, Kernels  # noqa: F401  (for the layers above)

_BACKENDS: dict[str, Backend] = {}
_loaded = False
# First calls from several threads: one imports the backend folders while the others wait, and the
# flag is set only once every backend is registered, so no thread sees a half-filled registry.
_load_lock = threading.Lock()


def register(backend: Backend) -> Backend:
    """Adds a backend; names are unique."""
    if backend.name in _BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def backends() -> dict[str, Backend]:
    """Every registered backend by name (imports the backend folders on first use)."""
    global _loaded
    if not _loaded:
        with _load_lock:
            if not _loaded:
                for backend in sorted(_declared(), key=lambda b: (b.order, b.name)):
                    register(backend)
                _loaded = True
    return _BACKENDS


def _declared() -> list[Backend]:
    """Each backend folder's ``BACKEND``, whose name must be the folder's."""
    from dispatch import backends as folder

    found = []
    for name in folder.folders():
        backend = importlib.import_module(f"dispatch.backends.{name}").BACKEND
        if backend.name != name:
            raise ValueError(f"dispatch/backends/{name} declares a backend named {backend.name!r}")
        found.append(backend)
    return found


def get(name: object) -> Backend:
    """The backend called ``name``; a ValueError listing the registered ones otherwise."""
    found = backends().get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"backend must be one of {', '.join(backends())}; got {name!r}")
    return found
