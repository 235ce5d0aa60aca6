"""Per-GPU heuristic tables and their lookup.

Tables are JSON files written only by ``python -m dispatch.calibrate``; until one exists for the
running GPU, :func:`lookup` answers None and the dispatcher uses its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dispatch.registry import Call


@dataclass(frozen=True)
class Choice:
    backend: str
    description: str  # which table and cell decided, for explain()


def lookup(call: Call) -> Optional[Choice]:
    """The table's backend for ``call``, or None when no table covers it."""
    return None


def describe(device: torch.device) -> str:
    """Which table serves ``device`` (for ``dispatch.info`` and explain())."""
    return f"no calibrated table for {device.type}"
