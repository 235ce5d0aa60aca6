"""Per-device heuristic tables (JSON, written only by ``python -m dispatch.calibrate``) and their lookup.

A table holds, per key (op, dtype, activation, mode, dropout, feature size), the measured crossover
points along the token count M: segments ``[m_from, backend, runner_up, margin, ...]``, so a call with
any M is decided by the segment it falls in, never by snapping to the nearest measured M.

Schema 2 (what the calibrator writes now) keeps per segment the two clocks it was decided on: the
winner's and runner-up's ``gpu_us`` (CUDA-graph time) and ``host_us`` (the host's cost of a call),
plain PyTorch's (``pytorch_us``), which clock bound the winner (``clock``), the winner by GPU time
alone (``gpu_backend``) and the speedup over plain PyTorch; the winner is the cheapest by
max(gpu_us, host_us) (``ranking``). On a CPU both clocks are the wall time. Schema 1 tables (one clock,
speedups over eager) load and answer as before.

The calibrator's output keeps every measured point (``points``, ``held_out``, ``held_out_sizes``);
a shipped table is that output without them (``slim()``): the segments, each entry's ``max_m``,
the provenance and the self-check's summary, with ``raw_points`` naming the file that has the rest.

The modules, by what they serve:
    device    this machine: device_info, slugs, running versions, the user directory
    schema    the calibration's data typed once: the records a document holds (Point, SegmentRecord,
              EntryRecord, SelfCheck, DeviceInfo, Document) and what a loaded table keeps (EntryKey,
              EntryId, Segment, Entry)
    validate  the document checked whole when it loads (SchemaError names the field at fault)
    table     one table: load_table, Table.choose, Choice
    save      save_table, dumps, slim
    catalog   which table serves a device (nearest GPU, nearest CPU thread count), lookup, describe
    ranking   the rule that ranks backends at a measured point (the calibrator fills tables by it)
Importing the package does no work: tables are read on the first lookup.
"""

from dispatch.heuristics.catalog import (
    CALIBRATE_HINT,
    SHIPPED_DIR,
    all_tables,
    backends_named,
    describe,
    lookup,
    m_span,
    reload,
    resolve,
    skipped_tables,
    table_for,
    why_no_choice,
)
from dispatch.heuristics.device import (
    ENV_DIR,
    cpu_model,
    cpu_slug,
    device_info,
    running_versions,
    slugify,
    user_dir,
    user_dir_problem,
)
from dispatch.heuristics.save import dumps, save_table, slim
from dispatch.heuristics.schema import (
    MODES,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    Clocks,
    DeviceInfo,
    Document,
    Entry,
    EntryId,
    EntryKey,
    EntryRecord,
    Point,
    Segment,
    SegmentRecord,
    SelfCheck,
    max_measured_m,
)
from dispatch.heuristics.table import Choice, HeuristicsWarning, Table, load_table, read_table
from dispatch.heuristics.validate import SchemaError

__all__ = [
    "CALIBRATE_HINT", "ENV_DIR", "MODES", "SCHEMA_VERSION", "SCHEMA_VERSIONS", "SHIPPED_DIR",
    "Choice", "Clocks", "DeviceInfo", "Document", "Entry", "EntryId", "EntryKey", "EntryRecord",
    "HeuristicsWarning", "Point", "SchemaError", "Segment", "SegmentRecord", "SelfCheck", "Table",
    "all_tables", "backends_named", "cpu_model", "cpu_slug", "describe", "device_info", "dumps", "load_table",
    "lookup", "m_span", "max_measured_m", "read_table", "reload", "resolve", "running_versions",
    "save_table", "skipped_tables", "slim", "slugify", "table_for", "user_dir", "user_dir_problem",
    "why_no_choice",
]  # fmt: skip
