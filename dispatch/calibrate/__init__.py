"""``python -m dispatch.calibrate``: measure the backends on this machine and write its heuristics table.

``plan`` (what is measured and the decision rule), ``measure`` (the timers and the GPU and host clocks;
inputs and parity checks are ``dispatch.cases``'), ``report`` (the self-check and the refit), ``warm``
(compiling ahead on a GPU) and the command line in ``__main__``. The held-out judge is a benchmark,
``benchmarks/bench_heldout.py``. Importing the package does no work.
"""


def main(argv=None) -> int:
    """The command line (``python -m dispatch.calibrate``), callable from Python."""
    from dispatch.calibrate.__main__ import main as cli

    return cli(argv)
