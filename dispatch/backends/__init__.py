"""The backend folders, in the one order of backends: ``python -m dispatch.info`` lists them so, ties
within the calibrator's noise go to the first, and a call no table answers runs on the first that can
serve it: plain PyTorch (the floor), the reference, then the fused kernels, least compiling first
(composed, the other ops chained, compiles only where its sub-calls' backends do).
Adding a backend: one folder whose ``__init__`` declares ``BACKEND``
(``dispatch.contracts.backend.Backend``), plus its name here; ``dispatch.registry`` imports and
registers it on first use."""

NAMES = ("pytorch", "eager", "cublaslt", "triton", "composed", "inductor", "nvfuser")
