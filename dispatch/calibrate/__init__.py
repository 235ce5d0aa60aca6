"""``python -m dispatch.calibrate``: measure the backends on this machine and write its heuristics table.

``plan`` (what is measured and the decision rule), ``measure`` (the timers, the GPU and host clocks, one
point; inputs and parity checks are ``dispatch.cases``'), ``gate`` (the parity gate before a win),
``series`` (one series and its members measured into entries), ``run`` (the schedule: the settings, the
tasks of each family and their order), ``report`` (the document, the self-check and the refit), ``warm``
(compiling ahead on a GPU) and the command line in ``__main__``. The held-out judge is a benchmark,
``benchmarks/bench_heldout.py``. Importing the package does no work.
"""


def main(argv=None) -> int:
    """The command line (``python -m dispatch.calibrate``), callable from Python."""
    from dispatch.calibrate.__main__ import main as cli

    return cli(argv)
