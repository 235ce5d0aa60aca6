"""Calibrating with several processes: ``torchrun --nproc-per-node N -m dispatch.calibrate ...``.

torch.distributed is the engine (NCCL-free: every exchange is a Python object over gloo, on the CPU or
beside the GPUs, so no GPU memory is taken from the measurements). Each rank measures one GPU (its
LOCAL_RANK), or the CPU; the series are dealt out round-robin in priority order, a series and its
members' checks always together (the members reuse the series' timings). Rank 0 gathers every rank's
entries, writes the one table (atomically, as a single process does) and tells every rank its path.
While measuring, each rank checkpoints its own entries beside the table (``<out>.rank<r>.json``):
``--resume`` merges them back, so a run stopped by a failed rank continues where each rank was. A rank
that raises ends the run with its error (torchrun stops the other ranks).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def lead(self) -> bool:
        return self.rank == 0


def setup() -> Ranks:
    """This process's rank among ``WORLD_SIZE`` (torchrun's variables); one process without them. On CUDA
    each rank takes the GPU of its LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return Ranks(dist.get_rank(), dist.get_world_size())


def deal(queues: dict[Any, list[tuple]], ranks: Ranks) -> dict[Any, list[tuple]]:
    """Each family's tasks that are this rank's: the (series, features) units in priority order over
    every family, round-robin, so each rank gets its share of the important ones first."""
    if ranks.world == 1:
        return queues
    units: dict[tuple, None] = {}  # insertion-ordered; a series by identity (series are not hashable)
    for fam, tasks in queues.items():
        for task in tasks:
            units.setdefault((fam, id(task[1]), task[2]), None)
    mine = {u for i, u in enumerate(units) if i % ranks.world == ranks.rank}
    return {fam: [t for t in tasks if (fam, id(t[1]), t[2]) in mine] for fam, tasks in queues.items()}


def checkpoint_path(out: str, ranks: Ranks) -> str:
    return f"{out}.rank{ranks.rank}.json" if ranks.world > 1 else out


def checkpointed_entries(out: str) -> list[dict]:
    """The entries of every rank's checkpoint beside ``out`` (for --resume)."""
    entries: list[dict] = []
    for path in sorted(glob.glob(glob.escape(out) + ".rank*.json")):
        with open(path, encoding="utf-8") as f:
            entries += json.load(f).get("entries", [])
    return entries


def gather(entries: list[dict], ranks: Ranks) -> Optional[list[dict]]:
    """Every rank's entries on rank 0 (None elsewhere)."""
    if ranks.world == 1:
        return entries
    import torch.distributed as dist

    got: Optional[list] = [None] * ranks.world if ranks.lead else None
    dist.gather_object(entries, got, dst=0)
    return None if got is None else [e for part in got for e in part]


def announce(path: Optional[str], ranks: Ranks) -> str:
    """Rank 0's table path, on every rank."""
    if ranks.world == 1:
        assert path is not None
        return path
    import torch.distributed as dist

    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def finish(out: str, ranks: Ranks) -> None:
    """After the table is written: the ranks' checkpoints go, the process group ends."""
    if ranks.world == 1:
        return
    import torch.distributed as dist

    dist.barrier()
    if ranks.lead:
        for path in glob.glob(glob.escape(out) + ".rank*.json"):
            os.unlink(path)
    dist.destroy_process_group()
