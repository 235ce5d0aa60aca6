"""The backends, one folder each: a package here whose ``__init__`` declares ``BACKEND``
(``dispatch.contracts.backend.Backend``), its kernels in its ``<op>.py`` files. ``dispatch.registry``
finds them (``folders``), imports them and registers them on first use, in the one order of backends,
each one's declared ``Backend.order``: ``python -m dispatch.info`` lists them so, ties within the
calibrator's noise go to the first, and a call no table answers runs on the first that can serve it.
Plain PyTorch (the floor) comes first, then the reference, then the fused kernels, least compiling
first (composed, the other ops chained, compiles only where its sub-calls' backends do):

    pytorch 0, eager 10, cublaslt 20, triton 30, composed 40, inductor 50, nvfuser 60

Adding a backend: one folder, its ``order`` among these."""

from __future__ import annotations

import os


def folders(path: str = os.path.dirname(__file__)) -> list[str]:
    """The backends' folders in ``path``, by name: each package there (a folder with ``__init__.py``)."""
    return sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, "__init__.py")))
