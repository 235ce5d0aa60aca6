"""torchrun entry for test_distributed: ``python -m dispatch.calibrate`` whose rank 1 raises at its
second series, every finished task checkpointed (the run stopped as a failing GPU would stop it)."""

import os
import sys

from dispatch.calibrate import __main__ as calibrate

_series = calibrate.Run.series
_calls = []


def _failing_series(self, series, features):
    _calls.append(features)
    if os.environ.get("RANK") == "1" and len(_calls) == 2:
        raise RuntimeError("rank 1 fails here on purpose")
    return _series(self, series, features)


calibrate.Run.series = _failing_series
calibrate.SAVE_EVERY_S = 0.0
sys.exit(calibrate.main(sys.argv[1:]))
