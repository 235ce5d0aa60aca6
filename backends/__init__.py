"""The backend folders. Adding a backend: one folder that calls ``dispatch.registry.register`` in its
``__init__``, plus its name here."""

import importlib

NAMES = ("eager", "triton", "nvfuser", "inductor", "cublaslt")

for _name in NAMES:
    importlib.import_module(f"backends.{_name}")
