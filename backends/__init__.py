"""The backend folders, in the order ``python -m dispatch.info`` lists them. Adding a backend: one
folder whose ``__init__`` declares ``BACKEND`` (``dispatch.contracts.backend.Backend``), plus its name
here; ``dispatch.registry`` imports and registers it on first use."""

NAMES = ("eager", "triton", "nvfuser", "inductor", "cublaslt")
