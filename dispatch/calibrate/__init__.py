"""``python -m dispatch.calibrate``: measure the backends on this machine and write its heuristics table.

``plan`` (what is measured and the decision rule), ``measure`` (inputs, parity, the GPU and host
clocks), ``report`` (the self-check), ``warm`` (compiling ahead on a GPU), ``evaluate`` (held-out
models), and the command line in ``__main__``. Importing the package does no work.
"""


def main(argv=None) -> int:
    """The command line (``python -m dispatch.calibrate``), callable from Python."""
    from dispatch.calibrate.__main__ import main as cli

    return cli(argv)
